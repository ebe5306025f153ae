"""The federation server: global shared tensors, per-client payloads, aggregation, server optimiser.

Transport-free: engines (in-process, Flower) ask it what to send each client and hand it the
clients' updates. Clients upload tensor *values*; the server forms Δ_i = w_i − w itself, so a
client may send a tensor it did not receive this round (partial downloads).
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedsilo.core.aggregate import MEAN, Aggregation
from fedsilo.core.compression import carried_values
from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.lora import merged_delta
from fedsilo.core.masking import Layout
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.rounds import Limits, MeanRound, Pending, RoundAggregation
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import Tensors, clone, is_finite, nbytes, numel
from fedsilo.core.transforms import decode
from fedsilo.core.weighting import WeightingPolicy
from fedsilo.registry import Policy


def sample_clients(clients: list[str], round_idx: int, seed: int, fraction: float = 1.0,
                   count: int | None = None) -> list[str]:
    """Seeded per round, so a resumed run samples the same clients."""
    k = count if count is not None else max(1, round(fraction * len(clients)))
    if k >= len(clients):
        return list(clients)
    chosen = set(random.Random(f"{seed}/{round_idx}").sample(clients, k))
    return [c for c in clients if c in chosen]


def reject_reason(update: ClientUpdate, expected: Tensors, registered: int | None = None) -> str | None:
    """Why an update cannot be aggregated as sent, or None: an unknown tensor, a wrong shape, a dtype
    that is not real floating point, NaN/Inf, an empty update (it would take a weight for nothing), or a size
    that is not a positive count within what the silo `registered` at the start (a client cannot claim more
    data to take more weight)."""
    for name, t in update.tensors.items():
        if name not in expected:
            return f"unknown tensor {name!r}"
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return f"tensor {name!r} has dtype {getattr(t, 'dtype', type(t).__name__)}, expected a real floating dtype"
        if tuple(t.shape) != tuple(expected[name].shape):
            return f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
    if not sum(t.numel() for t in update.tensors.values()):
        return "an empty update (no tensors, or no values in them)"
    if not is_finite(update.tensors):
        return "non-finite values (NaN/Inf) in the update"
    n = update.n_examples
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return f"n_examples {n!r} is not a positive count"
    if registered is not None and n > registered:
        return f"n_examples {n} is more than the {registered} examples the silo registered"
    return None


def _norm(tensors: Tensors) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values()))


def _json_number(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class RoundStage(Protocol):
    """A stage around the round's aggregation (silo-level DP): wraps it each round, keeps its own state
    in the server's checkpoint under `state_key`."""
    state_key: str

    def wrap(self, inner: RoundAggregation, round_idx: int, sampled: list[str],
             registered: dict[str, int]) -> RoundAggregation: ...
    def refuses(self, round_idx: int, sampled: list[str] | None = None) -> str | None: ...
    def limits(self, limits: Limits) -> Limits: ...
    def state_dict(self) -> str: ...
    def load_state_dict(self, state: str | None) -> None: ...
    # optional: state_problem(state, recorded) -> why a checkpoint's state disagrees with the stage's
    # own record of each round done (rounds.jsonl's tail under state_key), or None


def _state_problem(stage: RoundStage, state: dict, logged: list[dict]) -> str | None:
    check = getattr(stage, "state_problem", None)  # a stage that keeps nothing to check declares none
    return check(state.get(stage.state_key), [r.get(stage.state_key) for r in logged]) if check else None


def mean_round(recipe: "ServerRecipe", params: Tensors) -> RoundAggregation:
    """The plain path: every update checked, screened and weighted on its own."""
    return MeanRound(recipe.weighting, recipe.aggregation, recipe.limits, params)


@dataclass(frozen=True)
class ServerRecipe:
    """The server's resolved parts (fedsilo.recipe.build_recipe builds one per run)."""
    optimizer: ServerOptimizer
    weighting: Policy[WeightingPolicy]
    statistic: str | None = None            # what the weighting reads (None: the policy's default)
    aggregation: Policy[Aggregation] = Policy("mean", MEAN)
    limits: Limits = Limits()
    plan: ExchangePlan = field(default_factory=ExchangePlan)
    collect: Callable[["ServerRecipe", Tensors], RoundAggregation] = mean_round  # or a secure sum
    stages: tuple[RoundStage, ...] = ()     # around the aggregation, innermost first (silo-level DP)
    lora_merge: float | None = None         # exact LoRA: each silo's s·BᵢAᵢ is its Δ on the base weights


class Server:
    """Safeguards against a buggy or hostile client (docs/reliability.md): updates are checked in
    the server's dtype and sizes against what each silo registered, then handed to the round's
    aggregation stage (fedsilo.core.rounds: the plain mean's per-update limits; a secure sum; silo-level
    DP around either); a round whose aggregate or server step would break the global tensors
    (`max_step_ratio`) is skipped, never applied."""

    def __init__(self, global_tensors: Tensors, recipe: ServerRecipe) -> None:
        self.params = clone(global_tensors)
        self.recipe = recipe
        self.optimizer, self.weighting, self.plan = recipe.optimizer, recipe.weighting, recipe.plan
        self.stat = recipe.statistic or recipe.weighting.value.reads
        self._coded: dict[tuple[str, ...], Tensors] = {}  # this round's download wire, per set of names sent
        self._received_view: Tensors | None = None
        self.sampled: list[str] = []
        self.registered: dict[str, int] = {}  # silo → the number of examples it declared at the start
        self.uploaded: dict[str, list[str]] = {}  # per client: the names it uploaded last (download policies)
        self.round = 0
        self._round: RoundAggregation | None = None
        self._record: dict = {}
        self._sent: dict[str, int] = {}  # bytes sent to each client this round
        self._sent_params: dict[str, int] = {}

    def register(self, sizes: dict[str, int]) -> None:
        """Each silo's size as known before any round: the bound on the size it may report."""
        self.registered = dict(sizes)

    def refuses(self, round_idx: int, sampled: list[str] | None = None) -> str | None:
        """Why a stage refuses round `round_idx` of the `sampled` silos before it starts (silo-level DP: the
        budget, planned for the fewest of them that can answer), or None."""
        return next((why for stage in self.recipe.stages if (why := stage.refuses(round_idx, sampled))), None)

    def begin_round(self, round_idx: int, sampled: list[str] | None = None) -> None:
        self.round = round_idx
        self.sampled = list(sampled or [])  # silo-level DP's fixed denominator: the public weights of these
        self._round = self.recipe.collect(self.recipe, self.params)
        for stage in self.recipe.stages:
            self._round = stage.wrap(self._round, round_idx, self.sampled, self.registered)
        self._record, self._sent, self._sent_params = {}, {}, {}
        self._coded, self._received_view = {}, None

    def payload(self, client: str) -> Tensors:
        """The tensors this client receives this round (coded by a download codec); their bytes are counted
        as sent."""
        names = self.plan.choose_download(self.round, list(self.params), self.uploaded.get(client))
        wire = dict(self._wire(names))  # a dict of its own: a caller may change it
        self._sent[client] = nbytes(wire)
        self._sent_params[client] = numel({k: self.params[k] for k in names})
        return wire

    def _wire(self, names: list[str]) -> Tensors:
        """The server's values of `names` as sent (coded once a round for every client sent the same names)."""
        key = tuple(names)
        if key not in self._coded:
            self._coded[key] = self.plan.encode_download({k: self.params[k] for k in names})
        return self._coded[key]

    def _received(self) -> Tensors:
        """The values every client starts from this round: the server's own, or what the download codec
        makes of them (the reference an upload codec's Δ was taken against)."""
        if not self.plan.download_transforms:
            return self.params
        if self._received_view is None:
            self._received_view = self.plan.decode_download(self._wire(list(self.params)), self.params)
        return self._received_view

    def reject(self, client: str, reason: str, key: str = "rejected", final: bool = False) -> str:
        """Record a client whose reply could not even be read as an update (a malformed message), or
        (key "refused") a silo whose own check refused the round: it sent nothing. `final`: it will refuse
        every later round too (its privacy budget is spent)."""
        self._record[client] = {"n_examples": None, "weight": None, "bytes_down": self._sent.get(client, 0),
                                "bytes_up": 0, "params_down": self._sent_params.get(client, 0), "params_up": 0,
                                key: reason, **({"final": True} if final else {})}
        return reason

    def _delta(self, client: str, update: ClientUpdate) -> tuple[Tensors | None, str | None, float | None]:
        """Δ_i in the server's dtype and device and its L2 norm; or the reason it cannot be used."""
        if self.registered and client not in self.registered:
            return None, f"{client!r} is not a registered silo", None
        reason = reject_reason(update, self.params, self.registered.get(client))
        if reason:
            return None, reason, None
        # updates may arrive on another device and dtype (a GPU silo, float64, Flower's CPU arrays)
        cast = {k: t.to(self.params[k].device, self.params[k].dtype) for k, t in update.tensors.items()}
        if not is_finite(cast):
            return None, f"values overflow the server's dtype ({next(iter(self.params.values())).dtype})", None
        delta = {k: t - self.params[k] for k, t in cast.items()}
        if self.recipe.lora_merge is not None:
            delta = merged_delta(delta, self.params, self.recipe.lora_merge)
        norm = _norm(delta)
        if not math.isfinite(norm):
            return None, "the update's difference to the global tensors overflows", None
        return delta, None, norm

    def secure_layout(self) -> Layout:
        """The layout every silo's masked vector has (the same shared tensors, the same policy)."""
        return Layout.of(self.params, list(self.params), self.weighting.value)

    def receive_sum(self, total, layout, updates: dict[str, ClientUpdate], protocol: dict) -> str | None:
        """Secure aggregation: the sum of the `updates`' masked vectors (the server never had one alone).
        Each silo's entry keeps its numbers that were not masked (size, steps, seconds, its DP accountant).
        Returns why the sum cannot be used, or None."""
        self._secure_entries(updates, layout)
        reason = self._round.take_sum(total, layout, list(updates), protocol)
        if reason is None:
            for client in updates:
                self.uploaded[client] = list(layout.names)
        return reason

    def secure_failed(self, reason: str, updates: dict[str, ClientUpdate] | None = None) -> None:
        """The round's secure sum could not be formed (too few silos finished the protocol); the silos that
        trained are recorded all the same (their DP accountants spent this round)."""
        self._secure_entries(updates or {}, self.secure_layout())
        self._round.failed(reason, list(updates or {}))

    def _secure_entries(self, updates: dict[str, ClientUpdate], layout: Layout) -> None:
        for client, update in updates.items():
            self._record[client] = {
                "n_examples": update.n_examples, "steps": update.steps, "seconds": update.seconds, "weight": None,
                "bytes_up": 8 * layout.length, "bytes_down": self._sent.get(client, 0),
                "params_up": layout.width, "params_down": self._sent_params.get(client, 0), "secure": True,
                **({"privacy": {k: _json_number(v) for k, v in update.privacy.items()}} if update.privacy else {}),
            }

    def receive(self, client: str, update: ClientUpdate) -> str | None:
        """Take one client's update; returns a rejection reason, or None. The round's aggregation may hold
        it until `end_round` compares it with the round's other updates."""
        if client in self._record:  # a reply delivered twice must not count twice
            self._record[client]["duplicates"] = self._record[client].get("duplicates", 0) + 1
            return f"a second update from {client!r} in round {self.round} (only the first counts)"
        entry = self._record[client] = _entry(update, self._sent.get(client, 0), self._sent_params.get(client, 0))
        reason = None
        if self.plan.upload_transforms:
            try:  # a codec's wire form that does not decode (a bad shape, a missing scale) is the silo's fault
                update = dataclasses.replace(update, tensors=decode(self.plan.upload_transforms, update.tensors,
                                                                    self._received()))
            except (ValueError, KeyError, RuntimeError) as err:
                reason = f"its upload does not decode: {err}"
        if reason is None:
            delta, reason, norm = self._delta(client, update)
        if reason:
            entry["rejected"] = reason
            if not isinstance(update.n_examples, int):
                entry["n_examples"] = None  # keep rounds.jsonl valid JSON
            return reason
        value = update.statistic(self.stat) if self.stat else math.nan
        self._round.add(Pending(client, delta, update.n_examples, value, norm,
                                norm / math.sqrt(max(numel(delta), 1))), entry)
        return None

    def end_round(self) -> dict:
        """Aggregate and step the server optimiser — unless the result would break the global
        tensors: then the round is skipped (recorded with the reason). Returns the round's record."""
        out = self._round.finish(self._record)
        for client, names in getattr(self._round, "folded", {}).items():
            self.uploaded[client] = names
        skipped = self._step(out.delta, out.none_reason)
        record = {"weighting": self.weighting.name, **out.head, "applied": skipped is None, "clients": self._record,
                  **out.body,
                  "bytes_up": sum(c["bytes_up"] for c in self._record.values()),
                  "bytes_down": sum(self._sent.values()),
                  "params_up": sum(c["params_up"] for c in self._record.values()),
                  "params_down": sum(self._sent_params.values()),
                  "sent": dict(self._sent)}
        if skipped:
            record["skipped"] = skipped
        record.update(out.tail)
        self._round = None
        return record

    def _step(self, delta: Tensors | None, none_reason: str) -> str | None:
        """Apply the server optimiser with `delta`, unless there is none or it would break the global
        tensors; returns why the round was skipped, or None."""
        if delta is None:
            return none_reason
        if not is_finite(delta):
            return "the aggregate of the accepted updates is not finite"
        skipped = self.optimizer.check_step(self.params, delta, self.recipe.limits.max_step_ratio)
        if skipped is None:
            with torch.no_grad():
                self.optimizer.step(self.params, delta)
        return skipped

    def state_dict(self) -> dict:
        state = {"params": self.params, "optimizer": self.optimizer.state_dict(),
                 "uploaded": {c: ",".join(n) for c, n in self.uploaded.items()}}
        for stage in self.recipe.stages:  # e.g. the federation's DP accountant: a resume goes on from it
            state[stage.state_key] = stage.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.params = {k: v.clone() for k, v in state["params"].items()}
        self.optimizer.load_state_dict(state["optimizer"])
        self.uploaded = {c: (s.split(",") if s else []) for c, s in state.get("uploaded", {}).items()}
        for stage in self.recipe.stages:
            stage.load_state_dict(state.get(stage.state_key))

    def state_problem(self, state: dict, logged: list[dict]) -> str | None:
        """What is wrong with a checkpoint's server `state` given the rounds it has done (`logged`): each
        stage checks its state against its own record of each round (the records are the authority)."""
        return next((why for stage in self.recipe.stages if (why := _state_problem(stage, state, logged))), None)


def _entry(update: ClientUpdate, bytes_down: int, params_down: int) -> dict:
    """A client's entry in the round record, as its update arrived."""
    entry = {
        "n_examples": update.n_examples, "steps": update.steps, "losses": update.losses,
        "delta_loss": _json_number(update.delta_loss), "mean_loss": _json_number(update.mean_loss),
        "terms": {k: _json_number(v) for k, v in update.terms.items()},
        "bytes_up": nbytes(update.tensors), "bytes_down": bytes_down,
        "params_up": numel(carried_values(update.tensors)), "params_down": params_down,
        "seconds": update.seconds, "weight": None,
    }
    if update.personal_terms:  # Ditto: the personal model's own training, beside the federated update
        entry["personal_terms"] = {k: _json_number(v) for k, v in update.personal_terms.items()}
    if update.phase_seconds:  # where the client's seconds went: before_training (pseudo labels), training, personal
        entry["phase_seconds"] = {k: _json_number(v) for k, v in update.phase_seconds.items()}
    if update.lr_last is not None:  # a client lr schedule: the rate of its last optimiser step
        entry["lr_last"] = _json_number(update.lr_last)
    if update.privacy:  # DP-SGD: the silo's own accountant, after this round
        entry["privacy"] = {k: _json_number(v) for k, v in update.privacy.items()}
    if update.transforms:  # what the silo's upload went through before it left
        entry["transforms"] = [{k: _json_number(v) if isinstance(v, float) else v for k, v in t.items()}
                               for t in update.transforms]
    return entry
