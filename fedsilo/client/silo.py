"""One silo's side of a round: take the received tensors, run the round hook, train, build the upload.

In-process every silo borrows the same working model; what a silo owns between rounds lives in the
client store (DESIGN.md §4: no model copy per client in RAM): its private tensors, its whole model
when the exchange plan needs it (partial download/overwrite, a selector that compares with the
previous round, personal models), its optimiser state when that persists, and small metadata.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedsilo.core.exchange import ExchangePlan, SelectionContext
from fedsilo.core.masking import weighted_vector
from fedsilo.privacy.silo_dp import silo_noise
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import (SILO_CHECKS, RoundInstructions, SiloRefused, TransformContext, encode,
                                     refusal)
from fedsilo.core.lora import limit_rank
from fedsilo.errors import StoreError
from fedsilo.models.lora import RECEIVED_ONLY
from fedsilo.models.precision import autocast
from fedsilo.tasks.tokens import PreTokenized, row_length, tokenized

from .hooks import AFTER_TRAINING, PSEUDO_SOURCES, ROUND_HOOKS, AfterContext, HookContext
from .objective import CLIENT_OBJECTIVES
from .policy import Asked, SiloPolicy, breach
from .private import Budget, check_budget, plan_budget, steps_per_round, train_private
from .schedule import round_steps, span_of
from .settings import ClientConfig
from .store import ClientState, ClientStore, optimizer_from_slot, optimizer_to_slot
from .train import train_local


def client_seed(seed: int, round_idx: int, silo_idx: int) -> int:
    """Distinct, reproducible randomness per (run seed, round, silo)."""
    return (seed * 1_000_003 + round_idx * 10_007 + silo_idx) % (2**63)


def federated_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters federation deals in: the trainable ones. A frozen parameter (sinusoidal
    positions, a LoRA model's base) is the same on every client by construction, so it is never sent
    or stored — unless the model names it received-only (`received_only`)."""
    extra = set(received_only(model))
    return {n: p for n, p in model.named_parameters() if p.requires_grad or n in extra}


def received_only(model: torch.nn.Module) -> tuple[str, ...]:
    """Frozen parameters the server still sends and changes (the exact LoRA merge's base weights): a silo
    receives them and never uploads them."""
    return tuple(getattr(model, RECEIVED_ONLY, ()))


def load_tensors(model: torch.nn.Module, *tensor_sets: Tensors) -> None:
    """Copy named tensors into the model's parameters (later sets win)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for tensors in tensor_sets:
            for name, t in tensors.items():
                params[name].copy_(t)


class SiloClient:
    def __init__(self, name: str, index: int, examples: Sequence, task: Any, cfg: ClientConfig,
                 model: torch.nn.Module, plan: ExchangePlan, store: ClientStore, initial: Tensors,
                 persist_optimizer: bool = False, token_cache: Path | None = None, precision: str = "fp32",
                 rounds: int = 1, secure: tuple | None = None, silo_clip: tuple[float, float] | None = None,
                 seeded_noise: bool = False, lora_rank: int | None = None) -> None:
        self.name, self.index = name, index
        self.lora_rank = lora_rank  # heterogeneous LoRA ranks: this silo's adapters are held at this rank
        self.silo_clip, self.seeded_noise = silo_clip, seeded_noise  # silo-level DP: (C, the noise std it adds)
        self.policy: tuple[SiloPolicy, str] | None = None  # the silo's own policy file (fedsilo.client.policy)
        self.secure = secure  # secure aggregation: (masking.Layout, WeightingPolicy, the statistic it reads)
        self.rounds = rounds  # the run's federation.rounds: the length of a `run`-span lr schedule
        self.examples, self.task, self.cfg = examples, task, cfg
        self.model, self.plan, self.store = model, plan, store
        self.shared_names, self.private_names = plan.split(federated_parameters(model))
        self.received_only = set(received_only(model))
        self.initial = initial  # the initial private tensors (one copy shared by all clients)
        self.persist_optimizer = persist_optimizer
        self.precision = precision
        self.loss_fn = CLIENT_OBJECTIVES.get(cfg.objective)(task, cfg)
        self.checks = SILO_CHECKS.resolve_chain(cfg.upload_checks, "upload_checks")
        self.hook = ROUND_HOOKS.resolve(cfg.before_training, cfg.hook_options, "hook_options") \
            if cfg.before_training else None
        self.pseudo_source = PSEUDO_SOURCES.resolve(cfg.pseudo_source)
        after = cfg.after_pass()
        self.after = AFTER_TRAINING.resolve(*after, where="after_training_options") if after else None
        # Tokenised once here (read from the cache when an earlier run wrote it); batches are padded
        # from these tensors. A task without `tokenize`/`pad` is collated from its examples each batch.
        self.rows = tokenized(task, examples, token_cache) if isinstance(task, PreTokenized) else None

    def batches_from(self, examples: Sequence) -> tuple[Sequence, Callable, list[int] | None]:
        """(items, collate, token lengths) the training loop batches: the silo's cached rows, rows of
        a round hook's examples (pseudo labels) tokenised now, or raw examples."""
        if self.rows is None:
            return examples, self.task.collate, None
        rows = self.rows if examples is self.examples else self.task.tokenize(examples)
        return rows, self.task.pad, [row_length(r) for r in rows]

    def planned_steps(self) -> int:
        cfg = self.cfg
        own = round_steps(len(self.examples), cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.steps)
        after = self.after.value.steps(len(self.examples), cfg, self.after.options) if self.after else 0
        return own + after

    def _state(self) -> ClientState:
        """The stored state, whose tensors must fit this model (a store of another model never loads)."""
        state = self.store.get(self.name) or ClientState()
        params = federated_parameters(self.model)
        for slot in ("own", *([self.after.value.slot] if self.after else [])):
            for name, t in state.slot(slot).items():
                if name not in params or tuple(t.shape) != tuple(params[name].shape):
                    where = state.source or f"{self.name}'s stored state"
                    raise StoreError(f"{where}: its {slot} tensor {name!r} {tuple(t.shape)} does not fit the model; "
                                     "restore it, or start a new run (another --out)")
        return state

    def start_point(self, received: Tensors, state: ClientState) -> list[str]:
        """Working model ← own tensors, then the received tensors the overwrite policy takes.
        Returns the names taken from `received`."""
        uploaded = state.meta.get("uploaded")
        taken = self.plan.choose_overwrite(list(received), uploaded)
        own = state.slot("own") or {k: v for k, v in self.initial.items()}
        load_tensors(self.model, own, {k: received[k] for k in taken})
        self._limit_rank()
        return taken

    def _limit_rank(self) -> None:
        """A silo of a lower LoRA rank zeroes its adapters' rows and columns above it (fedsilo.core.lora)."""
        if self.lora_rank is not None:  # frozen A too (FFA): its zero rows keep B's columns without gradient
            adapters = {k: p.detach() for k, p in self.model.named_parameters() if ".lora_" in k}
            load_tensors(self.model, limit_rank(adapters, self.lora_rank))

    def load_for_eval(self, global_tensors: Tensors) -> None:
        """The model this silo would train from next: what it would receive and take, over its own;
        with an after-training pass (Ditto's personal model), what it keeps once it has kept some."""
        state = self._state()
        if self.after and state.slot(self.after.value.slot):
            load_tensors(self.model, state.slot(self.after.value.slot))
            return
        names = self.plan.choose_download(self.store.round + 1, self.shared_names, state.meta.get("uploaded"))
        self.start_point({k: global_tensors[k] for k in names}, state)

    def fit(self, round_idx: int, received: Tensors, seed: int, on_step: Callable[[], None] | None = None
            ) -> ClientUpdate:
        start = time.perf_counter()
        reason = refusal(self.checks, RoundInstructions(round_idx, self.name, self.plan.upload_transforms))
        if reason:  # before anything is trained or sent
            raise SiloRefused(reason)
        state = self._state()
        budget = self._budget(state)
        if self.policy is not None:
            rule = breach(self.policy[0], self._asked(round_idx, budget))
            if rule:
                raise SiloRefused(f"policy {self.policy[1]}: {rule}")
        if budget is not None:  # refused before anything is trained when the round would pass the target ε
            check_budget(budget, self._private_steps(), self.name, round_idx)
        device = next(self.model.parameters()).device
        received = {k: v.to(device) for k, v in received.items()}  # no copy when already there
        received = self.plan.decode_download(received, federated_parameters(self.model))
        self.start_point(received, state)
        run_seed = client_seed(seed, round_idx, self.index)
        examples = self.examples
        phases = {}  # seconds per phase of the round (the FewFedWeight paper's Table 4: generating vs training)
        if self.hook is not None:
            ctx = HookContext(self.name, round_idx, run_seed, self.model, self.examples, received,
                              state.slot("own"), self.pseudo_source, self.task, self.hook.options)
            with autocast(self.precision, device):
                examples = self.hook.value.run(ctx)
            self.start_point(received, state)  # the hook may have loaded another model to label with
            phases["before_training"] = time.perf_counter() - start
        restore = None
        if self.persist_optimizer and state.slot("optimizer"):
            restore = lambda opt: optimizer_from_slot(opt, state.slot("optimizer"), state.meta["optimizer_scalars"])  # noqa: E731
        items, collate, lengths = self.batches_from(examples)
        steps_done = int(state.meta.get("steps_done", 0))
        schedule_start, schedule_total = span_of(self.cfg.schedule_span, steps_done, self.rounds, round_steps(
            len(items), self.cfg.batch_size, self.cfg.grad_accum, self.cfg.epochs, self.cfg.steps))
        if budget is not None:
            result, opt = train_private(
                self.model, items, collate, self.task, budget, self.cfg.dp, steps=self._private_steps(),
                lr=self.cfg.lr, lr_overrides=self._private_lrs(), batch_size=self.cfg.batch_size,
                optimizer=self.cfg.optimizer, weight_decay=self.cfg.weight_decay, regularizers=self.cfg.regularizers,
                anchor={k: received[k] for k in received if k in self.shared_names}, seed=run_seed,
                max_grad_norm=self.cfg.max_grad_norm or None, optimizer_state=restore, on_step=on_step,
                lr_schedule=self.cfg.lr_schedule, warmup=self.cfg.warmup, schedule_start=schedule_start,
                schedule_total=schedule_total)
        else:
            result, opt = self._train(items, collate, lengths, received, run_seed, steps_done, restore, on_step,
                                      schedule_start, schedule_total)
        phases["training"] = time.perf_counter() - start - sum(phases.values())
        self._limit_rank()  # a regulariser (FedProx) may have pulled the zero rows towards the global ones
        params = federated_parameters(self.model)
        with torch.no_grad():
            now = {k: params[k].detach() for k in self.shared_names}
            own = state.slot("own")  # all tensors when the plan keeps everything, else the private ones
            previous = self._reference(own, received)
            ctx = SelectionContext(round_idx, self.name, self.shared_names, now, previous, seed,
                                   self.plan.upload_options)
            upload = [k for k in self.plan.choose_upload(ctx) if k not in self.received_only]
            slots, meta = self._kept(state, params, upload, result.steps, opt)
            if budget is not None:
                meta["dp"] = budget.to_meta()
            del opt  # its moments (two model copies) are freed before the upload's copy is made
            values = {k: now[k].clone() for k in upload}
            if self.silo_clip is not None:  # silo-level DP: clipped (and, distributed, noised) before it leaves
                values = self._silo_dp(values, received, run_seed)
            kept = [dict(state.slot(f"transform{i}")) for i in range(len(self.plan.upload_transforms))]
            # last, so a codec compresses what DP already released (post-processing)
            values, transformed = encode(self.plan.upload_transforms, values,
                                         TransformContext(round_idx, self.name, received, seed), kept)
            slots.update({f"transform{i}": t for i, t in enumerate(kept) if t})  # e.g. error feedback's residual
        personal_terms = {}
        if self.after:
            began, slot = time.perf_counter(), self.after.value.slot
            slots[slot], personal_terms = self.after.value(
                AfterContext(self, received, state.slot(slot), examples, run_seed, on_step), self.after.options)
            phases[slot] = time.perf_counter() - began
        self.store.put(self.name, ClientState(slots, meta))
        lr_last = result.lr if self.cfg.lr_schedule != "constant" else None
        if budget is not None:  # what leaves: the noisy model and the accountant's ε; no loss computed on records
            update = ClientUpdate(values, len(self.examples), result.steps, seconds=time.perf_counter() - start,
                                  phase_seconds=phases, lr_last=lr_last, transforms=transformed,
                                  privacy=budget.record())
        else:  # n: the silo's own data (FedAvg's n_k, what it registered), not counting pseudo-labelled extras
            update = ClientUpdate(values, len(self.examples), result.steps, result.losses,
                                  time.perf_counter() - start, delta_loss=result.delta_loss,
                                  mean_loss=result.mean_loss, terms=result.terms, personal_terms=personal_terms,
                                  phase_seconds=phases, lr_last=lr_last, transforms=transformed)
        return self._masked(update, received) if self.secure is not None else update

    def _silo_dp(self, values: Tensors, received: Tensors, run_seed: int) -> Tensors:
        clip, std = self.silo_clip
        g = torch.Generator()
        g.manual_seed(run_seed if self.seeded_noise else int.from_bytes(os.urandom(8), "little"))
        noisy = silo_noise({k: v - received[k] for k, v in values.items()}, clip, std, g)
        return {k: received[k] + d for k, d in noisy.items()}

    def _masked(self, update: ClientUpdate, received: Tensors) -> ClientUpdate:
        """Secure aggregation: the weighted update as one vector for the mask (fedsilo.core.masking); its
        weight and every loss statistic stay inside it."""
        layout, policy, stat = self.secure
        value = update.statistic(stat) if stat else math.nan
        delta = {k: update.tensors[k].double() - received[k].double() for k in layout.names if k in update.tensors}
        vector = weighted_vector(delta, update.n_examples, value, policy, layout)
        # what the transforms did stays inside too: a clip's record holds the update's norm
        return dataclasses.replace(update, tensors={}, losses=[], delta_loss=math.nan, mean_loss=math.nan, terms={},
                                   personal_terms={}, transforms=[{"name": t["name"]} for t in update.transforms],
                                   secure_input=vector)

    def _train(self, items, collate, lengths, received: Tensors, run_seed: int, steps_done: int, restore, on_step,
               schedule_start: int, schedule_total: int):
        return train_local(
            self.model, items, collate, self.loss_fn, lengths=lengths, batch_order=self.cfg.batching,
            length_window=self.cfg.length_window, precision=self.precision,
            epochs=self.cfg.epochs, lr=self.cfg.lr, lr_overrides=self._private_lrs(), batch_size=self.cfg.batch_size,
            grad_accum=self.cfg.grad_accum,
            optimizer=self.cfg.optimizer, weight_decay=self.cfg.weight_decay, logging_steps=self.cfg.logging_steps,
            regularizers=self.cfg.regularizers, anchor={k: received[k] for k in received if k in self.shared_names},
            tracked_terms=self.cfg.tracked_terms, seed=run_seed, step_offset=steps_done,
            max_grad_norm=self.cfg.max_grad_norm or None, optimizer_state=restore, on_step=on_step,
            max_steps=self.cfg.steps, lr_schedule=self.cfg.lr_schedule, warmup=self.cfg.warmup,
            schedule_start=schedule_start, schedule_total=schedule_total,
        )

    def _budget(self, state: ClientState) -> Budget | None:
        """This silo's DP accountant as its store keeps it; planned (σ fixed) at its first DP round."""
        if self.cfg.dp is None:
            return None
        if "dp" in state.meta:
            return Budget.from_meta(state.meta["dp"])
        return plan_budget(self.cfg.dp, len(self.examples), self.cfg.batch_size, self._private_steps(), self.rounds)

    def _asked(self, round_idx: int, budget: Budget | None) -> Asked:
        """This round's demands as the silo's policy reads them: every shared tensor may be sent; its DP ε
        projected to the last round from its own accountant."""
        left = max(0, self.rounds - round_idx + 1) * self._private_steps()
        return Asked(round_idx, self.rounds, tuple(self.shared_names),
                     budget.epsilon(left) if budget is not None else None,
                     self.cfg.dp is not None and self.cfg.dp.noise == "seeded", self.secure is not None)

    def _private_steps(self) -> int:
        return steps_per_round(len(self.examples), self.cfg.batch_size, self.cfg.epochs, self.cfg.steps)

    def _reference(self, own: Tensors, received: Tensors) -> Tensors | None:
        """What an upload selector compares this round's tensors with: the client's own at the end of its
        previous round; in its first round, the model it started from (what it received)."""
        if not self.plan.keeps_everything:
            return None
        if own and all(k in own for k in self.shared_names):
            return {k: own[k] for k in self.shared_names}
        return {k: received[k] for k in self.shared_names} if all(k in received for k in self.shared_names) else None

    def _private_lrs(self) -> dict[str, float]:
        rate = self.cfg.private_lr
        return {} if rate is None else dict.fromkeys(self.private_names, rate)

    def _kept(self, state: ClientState, params: dict, upload: list[str], steps: int,
              opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The slots and metadata this round leaves in the store."""
        keep = list(params) if self.plan.keeps_everything else self.private_names
        slots = {"own": {k: params[k].detach().clone() for k in keep}} if keep else {}
        meta = {"steps_done": int(state.meta.get("steps_done", 0)) + steps, "uploaded": upload}
        if self.persist_optimizer:
            slots["optimizer"], meta["optimizer_scalars"] = optimizer_to_slot(opt)
        return slots, meta
