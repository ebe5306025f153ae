"""How one round's accepted updates become one aggregate Δ: the server's aggregation stage.

The server checks each update on arrival (fedsilo.server) and hands it to the round's aggregation; at
the end of the round the aggregation returns the aggregate and what the round record says about it.
`MeanRound` is the plain path (per-update limits, weighting, a mean or a robust rule). Other stages
take the round's updates in another form (secure aggregation: only their sum) or wrap one of these
(silo-level DP: noise on the aggregate), as Flower's DP strategies wrap any strategy: the server
never branches on which is running.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

from fedsilo.registry import Policy

from .aggregate import ROBUST_MIN_CLIENTS, Aggregation, RoundAggregator
from .tensors import Tensors
from .weighting import WeightingPolicy


@dataclass(frozen=True)
class Limits:
    """The per-update safeguards of the plain mean (docs/reliability.md); None: off."""
    max_client_weight: float | None = None
    max_weight_ratio: float | None = None
    clip_norm: float | None = None
    max_update_ratio: float | None = None
    max_step_ratio: float | None = None


@dataclass
class Pending:
    """An update that passed the per-client checks."""
    client: str
    delta: Tensors
    n_examples: int
    value: float   # the statistic the weighting reads (nan: none)
    norm: float
    rms: float     # ‖Δ‖ per uploaded element: comparable across clients that upload different tensors


@dataclass
class Outcome:
    """What a round's aggregation made of its updates."""
    delta: Tensors | None              # None: nothing to apply (`none_reason` says why)
    contributors: list[str]            # the silos whose update is in it with a weight above 0
    head: dict                         # the round record's "aggregation", "fallback"
    body: dict = field(default_factory=dict)   # after the record's "clients" (e.g. the secure protocol)
    tail: dict = field(default_factory=dict)   # at the record's end (e.g. rejected_at_end, silo_dp)
    none_reason: str = "no client update was accepted"


class RoundAggregation(Protocol):
    """One round's aggregation. `add` takes a checked update (the plain path); a stage that receives
    updates otherwise (a secure sum) offers its own method for it, which the engine calls."""
    def add(self, pending: Pending, entry: dict) -> None: ...
    def finish(self, records: dict[str, dict]) -> Outcome: ...


class MeanRound:
    """The plain path: each update is clipped (`clip_norm`), screened against the round's others
    (`max_update_ratio`, against their median: a reference one silo cannot inflate), weighted (capped by
    `max_client_weight`, `max_weight_ratio`) and combined by the aggregation rule."""

    def __init__(self, weighting: Policy[WeightingPolicy], aggregation: Policy[Aggregation], limits: Limits,
                 like: Tensors) -> None:
        self.weighting, self.aggregation, self.limits = weighting, aggregation, limits
        weighted = aggregation.value.weighted  # robust rules count each client once
        self._agg = RoundAggregator(weighting.value, like=like, rule=aggregation.value, options=aggregation.options,
                                    max_weight=limits.max_client_weight,
                                    max_ratio=limits.max_weight_ratio if weighted else None)
        self._held: list[Pending] = []
        self.folded: dict[str, list[str]] = {}  # client → the tensors it sent, for those in the aggregate

    def add(self, pending: Pending, entry: dict) -> None:
        if self.limits.max_update_ratio is None:
            self._fold(pending, entry)
        else:
            entry["norm"] = pending.norm
            self._held.append(pending)

    def _fold(self, pending: Pending, entry: dict) -> None:
        clip = self.limits.clip_norm
        if clip is not None and pending.norm > clip:
            for t in pending.delta.values():
                t.mul_(clip / pending.norm)
            entry["clipped_from"] = pending.norm
        self._agg.add(pending.client, pending.delta, pending.n_examples, pending.value)
        self.folded[pending.client] = list(pending.delta)

    def _screen(self, records: dict[str, dict]) -> dict[str, str]:
        """Reject each held update whose RMS exceeds `max_update_ratio` × the median RMS of the other
        updates this round, then fold the rest in arrival order. A lone update has nothing to be
        compared with; zero-length peers bound nothing. Returns {client: reason} of the rejected."""
        rejected = {}
        rms = [p.rms for p in self._held]
        ratio = self.limits.max_update_ratio
        for i, pending in enumerate(self._held):
            others = [r for j, r in enumerate(rms) if j != i and r > 0]
            ref = statistics.median(others) if others else None
            if ref is not None and pending.rms > ratio * ref:
                rejected[pending.client] = (
                    f"update RMS {pending.rms:.3g} is {pending.rms / ref:.3g}× the median of the other "
                    f"{len(others)} updates this round (limit federation.max_update_ratio = {ratio:g})")
        while self._held:  # popped as folded: the round holds one fewer copy at each step
            pending = self._held.pop(0)
            entry = records[pending.client]
            entry.pop("norm")
            if pending.client in rejected:
                entry["rejected"] = rejected[pending.client]
            else:
                self._fold(pending, entry)
        return rejected

    def finish(self, records: dict[str, dict]) -> Outcome:
        late = self._screen(records)
        delta, weights = self._agg.finish()
        weighted = self.aggregation.value.weighted
        for i, client in enumerate(self._agg.clients):
            entry = records[client]
            entry["weight"] = weights.values[i] if weighted else None
            if weights.fallback[i]:
                entry["fallback"] = True
            if weights.capped[i]:
                entry["capped"] = True
        tail = {}
        if late:  # rejected against the round's other updates: the engines warn from the record
            tail["rejected_at_end"] = late
        n = len(self._agg.clients)
        if not weighted and 0 < n < ROBUST_MIN_CLIENTS:
            tail["not_robust"] = (f"{self.aggregation.name} of {n} update(s) is their mean: "
                                  f"a robust rule needs at least {ROBUST_MIN_CLIENTS}")
        contributors = [c for c, w in zip(self._agg.clients, weights.values) if w > 0]
        return Outcome(delta if n else None, contributors,
                       {"aggregation": self.aggregation.name, "fallback": weights.any_fallback}, tail=tail)
