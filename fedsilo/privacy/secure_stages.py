"""Secure aggregation's two stages: the silo's mask (the last position of its round) and the server's
sum (its round aggregation). fedsilo.privacy.secagg runs the protocol between them; fedsilo.core.masking
lays the vectors out. The server never holds one silo's update, so nothing here weighs, clips or screens
a single one: `SumGuard` bounds what the sum can do to the model instead."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence

import numpy as np
import torch

from fedsilo.core.masking import Layout, mean_from_sum, weighted_vector
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.rounds import Outcome, Pending
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import SiloRefused, decode
from fedsilo.core.weighting import WeightingPolicy


@dataclasses.dataclass(frozen=True)
class SecureMask:
    """The silo's side: its weighted update as one vector for the mask; its weight and every loss statistic
    stay inside it. A codec's wire is decoded here, on the silo, against what it received: the server
    could only undo it per silo, and it never holds one silo's update."""
    layout: Layout
    policy: WeightingPolicy
    statistic: str | None   # what the weighting reads (None: nothing)
    chain: tuple = ()       # the plan's upload transforms (a codec's decode runs here)

    @classmethod
    def factory(cls, policy: WeightingPolicy, statistic: str | None, chain: tuple = ()):
        """(model, shared names) -> the mask, once the silo's model is built."""
        def make(model: torch.nn.Module, shared: Sequence[str]) -> "SecureMask":
            return cls(Layout.of(dict(model.named_parameters()), shared, policy), policy, statistic, chain)
        return make

    def __call__(self, update: ClientUpdate, received: Tensors) -> ClientUpdate:
        value = update.statistic(self.statistic) if self.statistic else math.nan
        values = decode(self.chain, update.tensors, received)
        delta = {k: values[k].double() - received[k].double() for k in self.layout.names if k in values}
        vector = weighted_vector(delta, update.n_examples, value, self.policy, self.layout)
        if not np.isfinite(vector).all():  # masked, it would lose the round for every silo: it drops out alone
            raise SiloRefused("its own update is not finite (NaN/Inf): it sits this round out before masking, "
                              "and the other silos' sum goes on without it")
        # what the transforms did stays inside too: a clip's record holds the update's norm
        return dataclasses.replace(update, tensors={}, losses=[], delta_loss=math.nan, mean_loss=math.nan, terms={},
                                   personal_terms={}, transforms=[{"name": t["name"]} for t in update.transforms],
                                   secure_input=vector)


def secure_sum_round(recipe, params: Tensors) -> "SecureSumRound":
    """The server's round aggregation under secure aggregation (fedsilo.server.ServerRecipe.collect)."""
    return SecureSumRound(params)


class SecureSumRound:
    """One round under secure aggregation: the mean Δ decoded from the sum (`take_sum`), or why none."""

    def __init__(self, like: Tensors) -> None:
        self.like = like  # the global tensors the mean update is for
        self._delta: Tensors | None = None
        self._protocol: dict = {"silos": [], "failed": "no sum"}

    def add(self, pending: Pending, entry: dict) -> None:
        raise RuntimeError("under secure aggregation the server takes only the silos' sum (take_sum)")

    def take_sum(self, total, layout: Layout, silos: list[str], protocol: dict) -> str | None:
        """The sum of `silos`' masked vectors; returns why it cannot be used, or None."""
        self._protocol = {"silos": sorted(silos), **protocol}
        try:
            self._delta = mean_from_sum(total, layout, self.like)
        except ValueError as err:
            self._protocol["failed"] = str(err)
            return str(err)
        return None

    def failed(self, reason: str, silos: list[str]) -> None:
        """The protocol could not form the sum (too few silos finished it)."""
        self._protocol = {"silos": sorted(silos), "failed": reason}

    def finish(self, records: dict[str, dict]) -> Outcome:
        return Outcome(self._delta, self._protocol["silos"], {"aggregation": "secure mean", "fallback": None},
                       body={"secure": self._protocol},
                       none_reason=f"secure aggregation: {self._protocol.get('failed', 'no sum')}")


SUM_ONLY = ("under secure aggregation the server sees only the sum, so one silo's oversized update (or claimed "
            "weight) can only show here; skipped, not applied")


class SumGuard:
    """The server's stage around a secure round (fedsilo.server.RoundStage): a round whose mean update is
    longer than `max_ratio` × the global tensors' norm (at least 1), or than `max_growth` × the median of
    the mean updates of the rounds applied before it, is skipped with the reason (max_failed_rounds such
    rounds in a row stop the run). Its limit: a silo whose update keeps the mean under both bounds moves
    the model unseen, and one accepted in most rounds can raise the median by up to `max_growth` each time.
    Registered after silo-level DP, so it reads the released (noisy) mean: post-processing."""
    state_key = "sum_guard"

    def __init__(self, max_ratio: float | None, max_growth: float | None) -> None:
        self.max_ratio, self.max_growth = max_ratio, max_growth
        self.applied: list[float] = []  # the mean update's norm of each round it let through

    def wrap(self, inner, round_idx: int, sampled: list[str], registered: dict[str, int]) -> "GuardedRound":
        return GuardedRound(inner, self)

    def refuses(self, round_idx: int, sampled: list[str] | None = None) -> str | None:
        return None

    def limits(self, limits):
        return limits

    def state_dict(self) -> str:
        return json.dumps(self.applied)

    def load_state_dict(self, state: str | None) -> None:
        self.applied = [float(x) for x in json.loads(state)] if state is not None else []

    def state_problem(self, state: str | None, recorded: list) -> str | None:
        """The rounds.jsonl records are the authority: the checkpoint's norms must be those they list."""
        kept = [r["mean_norm"] for r in recorded if isinstance(r, dict) and r.get("passed")]
        try:
            held = [float(x) for x in json.loads(state)] if state is not None else []
        except (TypeError, ValueError):
            return "its secure-aggregation step history is unreadable"
        if held != kept:
            return "its secure-aggregation step history differs from the rounds recorded in rounds.jsonl"
        return None

    def check(self, norm: float, model_norm: float) -> str | None:
        """Why a mean update of this `norm` must not be applied to a model of `model_norm`, or None."""
        if self.max_ratio is not None and norm > self.max_ratio * max(model_norm, 1.0):
            return (f"the round's mean update (norm {norm:.3g}) is {norm / max(model_norm, 1.0):.3g}× the global "
                    f"tensors' norm ({model_norm:.3g}); the limit is federation.secure_aggregation.max_mean_ratio = "
                    f"{self.max_ratio:g}: {SUM_ONLY}")
        if self.max_growth is not None and self.applied:
            ref = statistics.median(self.applied)
            if ref > 0 and norm > self.max_growth * ref:
                return (f"the round's mean update (norm {norm:.3g}) is {norm / ref:.3g}× the median of the "
                        f"{len(self.applied)} applied round(s) before it ({ref:.3g}); the limit is "
                        f"federation.secure_aggregation.max_mean_growth = {self.max_growth:g}: {SUM_ONLY}")
        return None


class GuardedRound:
    """One round's aggregation under `SumGuard`; whatever else the inner stage offers passes through."""

    def __init__(self, inner, guard: SumGuard) -> None:
        self.inner, self.guard = inner, guard

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def finish(self, records: dict[str, dict]) -> Outcome:
        out = self.inner.finish(records)
        if out.delta is None:
            return out
        norm = _norm(out.delta)
        finite = math.isfinite(norm)  # else the server's own check skips it
        why = self.guard.check(norm, _norm(self.inner.like)) if finite else None  # like: the global tensors
        out.tail[SumGuard.state_key] = {"mean_norm": norm if finite else None, "passed": finite and why is None}
        if why is not None:
            out.delta, out.none_reason = None, why
        elif finite:
            self.guard.applied.append(norm)
        return out


def _norm(tensors: Tensors) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values()))
