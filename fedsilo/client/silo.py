"""One silo's side of a round: take the received tensors, run the round hook, train, build the upload.

In-process every silo borrows the same working model; what a silo owns between rounds lives in the
client store (DESIGN.md §4: no model copy per client in RAM): its private tensors, its whole model
when the exchange plan needs it (partial download/overwrite, a selector that compares with the
previous round, personal models), its optimiser state when that persists, and small metadata.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedsilo.core.exchange import ExchangePlan, SelectionContext
from fedsilo.core.lora import limit_rank
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import RoundInstructions, SiloRefused, TransformContext, encode, refusal
from fedsilo.errors import ConfigError, StoreError
from fedsilo.models.lora import RECEIVED_ONLY
from fedsilo.privacy.ledger import Admission, SiloLedger
from fedsilo.models.precision import autocast
from fedsilo.tasks.tokens import PreTokenized, row_length, tokenized

from .hooks import AfterContext, HookContext
from .policy import Asked, breach
from .recipe import ClientRecipe
from .schedule import round_steps, span_of
from .store import ClientState, ClientStore, optimizer_from_slot, optimizer_to_slot
from .trainers import RoundWork


def client_seed(seed: int, round_idx: int, silo_idx: int) -> int:
    """Distinct, reproducible randomness per (run seed, round, silo)."""
    return (seed * 1_000_003 + round_idx * 10_007 + silo_idx) % (2**63)


def secret_seed(secret: bytes, seed: int, run: str, received: str) -> int:
    """A seed the server can neither predict nor repeat at will: the silo's secret (kept in its state, never
    sent) with the round's seed, the run and the sha256 of the model received. The same message again (a
    resume) gives the same seed; any other — a nudged model, a new run key — an unrelated one."""
    material = b"\0".join([secret, seed.to_bytes(8, "little"), run.encode(), received.encode()])
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") % (2**63)


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
    """One silo: its data, the working model it borrows, its store, and its recipe (the resolved parts of
    its round). `policy`: the silo's own policy file (fedsilo.client.policy), set by its operator."""

    def __init__(self, name: str, task: Any, examples: Sequence, model: torch.nn.Module, store: ClientStore,
                 recipe: ClientRecipe) -> None:
        self.name, self.task, self.examples, self.model, self.store = name, task, examples, model, store
        self.recipe, self.policy = recipe, None
        self.identity = None  # the silo's signing key and roster (fedsilo.privacy.roster), set by its operator
        self.ledger: SiloLedger | None = None  # its privacy ledger (fedsilo.privacy.ledger), set by its operator
        self.secret: bytes | None = None  # its secret randomness under secure aggregation (secret_seed), its operator's
        self.unmasked_allowed = False  # with a roster, an unmasked round only where its operator opts out by name
        self.index, self.cfg, self.plan, self.rounds = recipe.index, recipe.settings, recipe.plan, recipe.rounds
        self.precision = recipe.precision
        self.shared_names, self.private_names = self.plan.split(federated_parameters(model))
        self.received_only = set(received_only(model))
        self.initial = initial_private(model, self.plan)  # its private tensors' start
        self.loss_fn = recipe.objective(task, self.cfg)
        self.mask = recipe.mask(model, self.shared_names) if recipe.mask is not None else None
        # Tokenised once here (read from the cache when an earlier run wrote it); batches are padded
        # from these tensors. A task without `tokenize`/`pad` is collated from its examples each batch.
        self.rows = tokenized(task, examples, recipe.token_cache) if isinstance(task, PreTokenized) else None

    def batches_from(self, examples: Sequence) -> tuple[Sequence, Callable, list[int] | None]:
        """(items, collate, token lengths) the training loop batches: the silo's cached rows, rows of
        a round hook's examples (pseudo labels) tokenised now, or raw examples."""
        if self.rows is None:
            return examples, self.task.collate, None
        rows = self.rows if examples is self.examples else self.task.tokenize(examples)
        return rows, self.task.pad, [row_length(r) for r in rows]

    def planned_steps(self) -> int:
        cfg, after = self.cfg, self.recipe.after
        own = round_steps(len(self.examples), cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.steps)
        return own + (after.value.steps(len(self.examples), cfg, after.options) if after else 0)

    def _state(self) -> ClientState:
        """The stored state, whose tensors must fit this model (a store of another model never loads)."""
        state = self.store.get(self.name) or ClientState()
        params = federated_parameters(self.model)
        for slot in ("own", *([self.recipe.after.value.slot] if self.recipe.after else [])):
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
        if self.recipe.lora_rank is not None:  # frozen A too (FFA): its zero rows keep B's columns without gradient
            adapters = {k: p.detach() for k, p in self.model.named_parameters() if ".lora_" in k}
            load_tensors(self.model, limit_rank(adapters, self.recipe.lora_rank))

    def load_for_eval(self, global_tensors: Tensors) -> None:
        """The model this silo would train from next: what it would receive and take, over its own;
        with an after-training pass (Ditto's personal model), what it keeps once it has kept some."""
        state, after = self._state(), self.recipe.after
        if after and state.slot(after.value.slot):
            load_tensors(self.model, state.slot(after.value.slot))
            return
        names = self.plan.choose_download(self.store.round + 1, self.shared_names, state.meta.get("uploaded"))
        self.start_point({k: global_tensors[k] for k in names}, state)

    def fit(self, round_idx: int, received: Tensors, seed: int, on_step: Callable[[], None] | None = None,
            admitted: Admission | None = None) -> ClientUpdate:
        """One round as a fixed pipeline (fedsilo.client.recipe): ledger, check, receive, before-training
        hook, train, select the upload, after-training pass, release, encode, record, mask. The silo's
        own checks run before anything is trained; nothing leaves before the release is in its ledger.
        `admitted`: the ledger's answer when the caller asked it first (`admit`)."""
        start, trainer = time.perf_counter(), self.recipe.trainer
        admitted = admitted or self.admit(round_idx, received)
        if admitted.resend is not None:  # the same round and payload again: what left then, as it left
            stored, device = admitted.resend, next(self.model.parameters()).device
            self.store.put(self.name, ClientState(stored.slots, stored.meta))
            return dataclasses.replace(stored.update, tensors={k: t.to(device) for k, t in stored.update.tensors.items()})
        state = self._state()
        run_seed = client_seed(seed, round_idx, self.index)
        if self.secret is not None and self.mask is not None:
            run_seed = secret_seed(self.secret, run_seed, self.ledger.run, admitted.received)
        work = RoundWork(round_idx, seed, run_seed, received, state, trainer.accountant(self), on_step)
        self._check(work)
        work.received = self._receive(received, state)
        examples, phases = self._before_training(work, start)
        result, opt = self._train(work, examples)
        phases["training"] = time.perf_counter() - start - sum(phases.values())
        self._limit_rank()  # a regulariser (FedProx) may have pulled the zero rows towards the global ones
        with torch.no_grad():
            now, upload, slots, meta = self._select(work, result.steps, opt)
            del opt  # its moments (two model copies) are freed before the upload's copy is made
            values = {k: now[k].clone() for k in upload}
        personal_terms = self._after_training(work, examples, slots, phases)
        with torch.no_grad():
            if self.recipe.release is not None:  # silo-level DP: clipped (distributed: noised) before it leaves
                values = self.recipe.release(values, work.received, work.run_seed)
            values, transformed = self._encode(work, values, slots)
        self.store.put(self.name, ClientState(slots, meta))
        update = trainer.update(self, result, values, work, seconds=time.perf_counter() - start,
                                personal_terms=personal_terms, phase_seconds=phases,
                                lr_last=result.lr if trainer.parts.varies_lr else None,
                                transforms=transformed)
        self._record(work, admitted, update, result.steps, slots, meta)
        return self.mask(update, work.received) if self.mask is not None else update

    @property
    def keeps_ledger(self) -> bool:
        """Whether this silo's updates are protected releases — DP (DP-SGD, or a release stage that adds
        noise) or masked (secure aggregation: an input summed over two survivor sets is revealed by their
        difference): then its privacy ledger records each, and a run's rounds only go forward."""
        release = self.recipe.release
        return self.recipe.trainer.private or (release is not None and bool(release.accounted())) or \
            self.mask is not None

    @property
    def adds_noise(self) -> bool:
        """Whether this silo's releases carry DP noise the server cannot remove (secret, added on the silo)."""
        release, dp = self.recipe.release, self.cfg.dp
        return (self.recipe.trainer.private and dp is not None and not dp.seeded) or \
            (release is not None and release.std > 0 and not release.seeded)

    def admit(self, round_idx: int, received: Tensors) -> Admission:
        """The ledger's stage, first of all: a round not above this run's last release is refused
        (SiloRefused), unless it provably re-sends that release (fedsilo.privacy.ledger)."""
        if not self.keeps_ledger:
            return Admission()
        if self.ledger is None:
            raise ConfigError(f"silo {self.name} releases under DP but was given no privacy ledger (its engine "
                              "gives one: a SuperNode's node config `ledger`, in-process the run directory)")
        return self.ledger.admit(round_idx, received, secure=self.mask is not None)

    def _record(self, work: RoundWork, admitted: Admission, update: ClientUpdate, steps: int, slots: dict,
                meta: dict) -> None:
        """Each DP mechanism of the release into the ledger, durably, before the update leaves."""
        if not self.keeps_ledger:
            return
        release = self.recipe.release
        mechanisms = self.recipe.trainer.accounted(self, work, steps) + (release.accounted() if release else [])
        self.ledger.record(work.round, admitted, update, mechanisms, slots, meta, masked=self.mask is not None)

    def _check(self, work: RoundWork) -> None:
        """The silo's own checks, its policy and its trainer's budget: SiloRefused before anything else."""
        reason = refusal(self.recipe.checks, RoundInstructions(work.round, self.name, self.plan.upload_transforms))
        if reason:
            raise SiloRefused(reason)
        if self.identity is not None and self.mask is None and not self.unmasked_allowed:
            raise SiloRefused(f"silo {self.name} holds a roster: it sends no update in the clear "
                              "(federation.secure_aggregation is not set); its operator opts out by name with the "
                              "node config allow-unmasked=true")
        if self.policy is not None:
            rule = breach(self.policy[0], self._asked(work))
            if rule:
                raise SiloRefused(f"policy {self.policy[1]}: {rule}")
        if work.budget is not None:
            self.recipe.trainer.refuse(self, work)

    def _receive(self, received: Tensors, state: ClientState) -> Tensors:
        """The round's tensors on the model's device, decoded; the working model at its start point."""
        device = next(self.model.parameters()).device
        received = {k: v.to(device) for k, v in received.items()}  # no copy when already there
        received = self.plan.decode_download(received, federated_parameters(self.model))
        self.start_point(received, state)
        return received

    def _before_training(self, work: RoundWork, start: float) -> tuple[Sequence, dict]:
        """The examples to train on (a round hook's, e.g. pseudo labels) and the seconds it took."""
        hook = self.recipe.hook
        if hook is None:
            return self.examples, {}
        ctx = HookContext(self.name, work.round, work.run_seed, self.model, self.examples, work.received,
                          work.state.slot("own"), self.recipe.pseudo_source, self.task, hook.options)
        with autocast(self.precision, next(self.model.parameters()).device):
            examples = hook.value.run(ctx)
        self.start_point(work.received, work.state)  # the hook may have loaded another model to label with
        return examples, {"before_training": time.perf_counter() - start}

    def _train(self, work: RoundWork, examples: Sequence):
        cfg, state = self.cfg, work.state
        restore = None
        if self.recipe.persist_optimizer and state.slot("optimizer"):
            restore = lambda opt: optimizer_from_slot(opt, state.slot("optimizer"), state.meta["optimizer_scalars"])  # noqa: E731
        items, collate, lengths = self.batches_from(examples)
        steps_done = int(state.meta.get("steps_done", 0))
        span = (*span_of(cfg.schedule_span, steps_done, self.rounds, round_steps(
            len(items), cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.steps), work.round), steps_done)
        return self.recipe.trainer.train(self, work, items, collate, lengths, restore, span)

    def _select(self, work: RoundWork, steps: int, opt) -> tuple[Tensors, list[str], dict, dict]:
        """The shared tensors now, the selector's choice of them to upload, and what the store keeps."""
        params = federated_parameters(self.model)
        now = {k: params[k].detach() for k in self.shared_names}
        own = work.state.slot("own")  # all tensors when the plan keeps everything, else the private ones
        ctx = SelectionContext(work.round, self.name, self.shared_names, now, self._reference(own, work.received),
                               work.seed, self.plan.upload_options)
        upload = [k for k in self.plan.choose_upload(ctx) if k not in self.received_only]
        slots, meta = self._kept(work.state, params, upload, steps, opt)
        return now, upload, slots, meta

    def _after_training(self, work: RoundWork, examples: Sequence, slots: dict, phases: dict) -> dict:
        """Ditto's personal model (or a user's pass): trained once the upload is taken, kept in its slot."""
        after = self.recipe.after
        if after is None:
            return {}
        began, slot = time.perf_counter(), after.value.slot
        slots[slot], terms = after.value(AfterContext(self, work.received, work.state.slot(slot), examples,
                                                      work.run_seed, work.on_step), after.options)
        phases[slot] = time.perf_counter() - began
        return terms

    def _encode(self, work: RoundWork, values: Tensors, slots: dict) -> tuple[Tensors, list[dict]]:
        """The plan's upload chain (codecs last): what it did, and what each keeps on the silo."""
        chain = self.plan.upload_transforms
        kept = [dict(work.state.slot(f"transform{i}")) for i in range(len(chain))]
        values, transformed = encode(chain, values, TransformContext(work.round, self.name, work.received, work.seed),
                                     kept)
        slots.update({f"transform{i}": t for i, t in enumerate(kept) if t})  # e.g. error feedback's residual
        return values, transformed

    def _asked(self, work: RoundWork) -> Asked:
        """This round's demands as the silo's policy reads them, from the config of the message that asks:
        every shared tensor may be sent; its DP ε projected to the last round from its own accountant; σ the
        smaller of the accountant's and the one this config plans (a server that lowers σ or raises the
        target mid-run asks for less noise, whatever the silo still holds)."""
        trainer, budget = self.recipe.trainer, work.budget
        epsilon = trainer.projected_epsilon(self, work) if budget is not None else None
        sigma = min(budget.noise_multiplier, trainer.planned(self).noise_multiplier) \
            if budget is not None else None
        secure = self.mask is not None
        return Asked(work.round, self.rounds, tuple(self.shared_names), epsilon, sigma,
                     self.cfg.dp is not None and self.cfg.dp.seeded, secure, secure and self.identity is not None,
                     budget.delta if budget is not None else None, self.adds_noise)

    def _reference(self, own: Tensors, received: Tensors) -> Tensors | None:
        """What an upload selector compares this round's tensors with: the client's own at the end of its
        previous round; in its first round, the model it started from (what it received)."""
        if not self.plan.keeps_everything:
            return None
        if own and all(k in own for k in self.shared_names):
            return {k: own[k] for k in self.shared_names}
        return {k: received[k] for k in self.shared_names} if all(k in received for k in self.shared_names) else None

    def private_lrs(self) -> dict[str, float]:
        rate = self.cfg.private_lr
        return {} if rate is None else dict.fromkeys(self.private_names, rate)

    def _kept(self, state: ClientState, params: dict, upload: list[str], steps: int,
              opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The slots and metadata this round leaves in the store."""
        keep = list(params) if self.plan.keeps_everything else self.private_names
        slots = {"own": {k: params[k].detach().clone() for k in keep}} if keep else {}
        meta = {"steps_done": int(state.meta.get("steps_done", 0)) + steps, "uploaded": upload}
        if self.recipe.persist_optimizer:
            slots["optimizer"], meta["optimizer_scalars"] = optimizer_to_slot(opt)
        return slots, meta


def initial_private(model: torch.nn.Module, plan: ExchangePlan) -> Tensors:
    """Initial values of the private tensors: the start of a silo that has kept none yet."""
    params = federated_parameters(model)
    _, private = plan.split(params)
    return {k: params[k].detach().clone() for k in private}
