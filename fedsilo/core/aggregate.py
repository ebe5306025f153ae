"""Aggregation of one round's client updates: weighted mean (streaming), median, trimmed mean.

Clients finish one at a time; holding every client's update until the round ends would cost a
model copy per client. For the weighted mean p_i = score_i / Σ score_j, so we keep Σ score_i·Δ_i per
tensor and normalise once the round is over. Policies that can degenerate
(`WeightingPolicy.can_degenerate`) also keep a size-weighted sum of every client (the whole round
falls back to size weights) and, once a client's own score is unusable, a size-weighted sum of the
clients that fell back alone — so no fallback needs a replay.

The robust rules (coordinate-wise median and trimmed mean, Yin et al. 2018) and a weight cap
(`max_weight_ratio`, `max_client_weight`) need every update at once: they buffer the round (a model
copy per client).
Sums are kept in the dtype and on the device of the global tensor (`like`; float64 stays float64),
else in the update's dtype, never below float32. A tensor that no client with a positive weight
sent is left out of Δ (the server optimiser then leaves it alone).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedsilo.registry import Registry

from .tensors import Tensors
from .weighting import WeightingPolicy, Weights, client_score, client_weights, usable_score


class TrimSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trim: float = Field(0.1, ge=0, lt=0.5, description="fraction dropped at each end, per coordinate")


@dataclass(frozen=True)
class Aggregation:
    """combine(stacked client values (m, ...), their weights p (m,), options) -> the aggregate."""
    combine: Callable[[torch.Tensor, torch.Tensor, BaseModel | None], torch.Tensor]
    weighted: bool  # False: the weighting policy plays no part (each client counts once)


def _mean(x: torch.Tensor, p: torch.Tensor, _options) -> torch.Tensor:
    p = p.to(device=x.device, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
    return (p * x).sum(0) / p.sum()


def _median(x: torch.Tensor, _p, _options) -> torch.Tensor:
    """Coordinate-wise median; the mean of the two middle values for an even count."""
    s = x.sort(dim=0).values
    m = s.shape[0]
    return s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) / 2


def trimmed_count(m: int, trim: float) -> int:
    """Values dropped at each end: ⌊trim·m⌋, but at least one where m ≥ 3 leaves a value (Flower's
    aggregate_trimmed_avg drops none below 1/trim clients: a cross-silo round of 2–9 would trim nothing)."""
    k = int(math.floor(trim * m))
    return max(k, 1) if m >= 3 else k


def _trimmed_mean(x: torch.Tensor, _p, options: TrimSettings | None) -> torch.Tensor:
    """Per coordinate: drop the `trimmed_count` smallest and largest values, average the rest."""
    m = x.shape[0]
    k = trimmed_count(m, options.trim if options else 0.1)
    return x.sort(dim=0).values[k:m - k].mean(0)


ROBUST_MIN_CLIENTS = 3
"""Below this many updates a median is a mean and a trimmed mean trims nothing: not robust."""


AGGREGATIONS: Registry[Aggregation] = Registry("aggregation rule")
MEAN = Aggregation(_mean, weighted=True)  # streamed: the only rule that needs no buffer
AGGREGATIONS.add("mean", MEAN)
AGGREGATIONS.add("median", Aggregation(_median, weighted=False))
AGGREGATIONS.add("trimmed_mean", Aggregation(_trimmed_mean, weighted=False), TrimSettings)


def accumulator_dtype(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.dtype:
    """The dtype a sum of `t`s is kept in: `like`'s (else t's) floating dtype, at least float32."""
    dtype = like.dtype if like is not None and like.is_floating_point() else t.dtype
    return torch.promote_types(dtype, torch.float32)


def _to_acc(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    device = like.device if like is not None else t.device
    return t.detach().to(device=device, dtype=accumulator_dtype(t, like), copy=True)


class StreamingMean:
    """Σ w_i·x_i and Σ w_i per tensor, over the clients that sent that tensor with a weight > 0."""

    def __init__(self, like: Tensors | None = None) -> None:
        self.like = like or {}
        self.sums: Tensors = {}
        self.norms: dict[str, float] = {}

    def add(self, update: Tensors, weight: float) -> None:
        """Fold in one client's tensors; a weight that is not positive and finite adds nothing."""
        if not (math.isfinite(weight) and weight > 0):
            return
        for name, t in update.items():
            acc = self.sums.get(name)
            if acc is None:
                self.sums[name] = _to_acc(t, self.like.get(name)).mul_(weight)
            else:
                acc.add_(t.detach().to(acc.device), alpha=weight)  # add_ casts to the sum's dtype
            self.norms[name] = self.norms.get(name, 0.0) + weight


def combined_mean(parts: list[tuple[StreamingMean, float]]) -> Tensors:
    """Per tensor Σ_j f_j·sums_j / Σ_j f_j·norms_j over the parts that hold it (sums divided in place)."""
    out: Tensors = {}
    names = dict.fromkeys(k for part, _ in parts for k in part.sums)  # in arrival order: seeded noise drawn
    for name in names:                                                 # after it is the same in every process
        held = [(part, f) for part, f in parts if name in part.sums and f > 0]
        if not held:
            continue
        total = held[0][0].sums[name].mul_(held[0][1])
        for part, f in held[1:]:
            total.add_(part.sums[name], alpha=f)
        out[name] = total.div_(sum(f * part.norms[name] for part, f in held))
    return out


class RoundAggregator:
    """Collects one round's client deltas under a weighting policy and an aggregation rule (with its
    validated options), optionally capping each client's weight."""

    def __init__(self, policy: WeightingPolicy, like: Tensors | None = None, rule: Aggregation | None = None,
                 options: BaseModel | None = None, max_weight: float | None = None,
                 max_ratio: float | None = None) -> None:
        self.policy, self.like, self.max_weight, self.max_ratio = policy, like or {}, max_weight, max_ratio
        self.can_degenerate = policy.can_degenerate
        self.rule = rule or MEAN
        self.options = options
        capping = max_weight is not None or max_ratio is not None
        self.buffered: list[Tensors] | None = [] if (self.rule is not MEAN or capping) else None
        self.scored = StreamingMean(like)  # usable scores
        self.by_size = StreamingMean(like) if self.can_degenerate else None  # every client, by size
        self.fallen: StreamingMean | None = None  # clients whose score was unusable, by size
        self.clients: list[str] = []
        self.sizes: list[float] = []
        self.values: list[float] = []
        self._result: tuple[Tensors, Weights] | None = None

    def add(self, client: str, update: Tensors, n_examples: float, value: float = math.nan) -> None:
        """`value`: the statistic the policy reads (ΔL, mean loss, ...), as the caller picked it."""
        if self._result is not None:
            raise RuntimeError("this round's aggregate is already finished")
        if self.buffered is not None:
            self.buffered.append({k: _to_acc(t, self.like.get(k)) for k, t in update.items()})
        else:
            self._stream(update, n_examples, value)
        self.clients.append(client)
        self.sizes.append(n_examples)
        self.values.append(value)

    def _stream(self, update: Tensors, n_examples: float, value: float) -> None:
        score = client_score(self.policy, n_examples, value)
        if usable_score(score):
            self.scored.add(update, score)
        else:
            self.fallen = self.fallen or StreamingMean(self.like)
            self.fallen.add(update, float(n_examples))
        if self.by_size is not None:
            self.by_size.add(update, float(n_examples))

    def finish(self) -> tuple[Tensors, Weights]:
        """The aggregated delta (per tensor, over the clients that sent it) and the weights p_i, one
        per client in `clients` order. Idempotent; the sums are released."""
        if self._result is None:
            self._result = self._finish()
            self.scored = self.by_size = self.fallen = self.buffered = None
        return self._result

    def _finish(self) -> tuple[Tensors, Weights]:
        if not self.clients:
            return {}, Weights([], [], [])
        weights = client_weights(self.policy, self.sizes, self.values, self.max_weight, self.max_ratio)
        if self.buffered is not None and self.rule.weighted and not any(weights.capped):
            # no cap bound: the streaming sums, replayed in arrival order, so a cap that could have bitten
            # but did not leaves the aggregate bit-identical to a run without it
            for i in range(len(self.buffered)):
                update, self.buffered[i] = self.buffered[i], {}  # released once folded
                self._stream(update, self.sizes[i], self.values[i])
        elif self.buffered is not None:
            return self._combine_buffered(weights.values), weights
        if not weights.any_fallback:
            return combined_mean([(self.scored, 1.0)]), weights
        if all(weights.fallback):
            if self.by_size is None:
                raise ValueError(f"weighting policy {self.policy!r} says it cannot degenerate, yet its scores "
                                 f"did this round (sizes {self.sizes}, values {self.values})")
            return combined_mean([(self.by_size, 1.0)]), weights
        # p_i = a·score_i for usable clients, b·n_i for those that fell back alone (client_weights)
        total_n = float(sum(self.sizes))
        usable = [(n, v) for n, v, fb in zip(self.sizes, self.values, weights.fallback) if not fb]
        fallen_n = total_n - sum(n for n, _ in usable)
        a = (1 - fallen_n / total_n) / sum(client_score(self.policy, n, v) for n, v in usable)
        return combined_mean([(self.scored, a), (self.fallen, 1 / total_n)]), weights

    def _combine_buffered(self, p: list[float]) -> Tensors:
        out: Tensors = {}
        for name in dict.fromkeys(k for u in self.buffered for k in u):  # a set's order would follow the hash seed
            held = [(u[name], w) for u, w in zip(self.buffered, p) if name in u]
            if self.rule.weighted:
                held = [(t, w) for t, w in held if w > 0]
            if held:
                x = torch.stack([t for t, _ in held])
                out[name] = self.rule.combine(x, torch.tensor([w for _, w in held], dtype=torch.float64),
                                              self.options)
        return out
