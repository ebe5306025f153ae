"""Streaming weighted aggregation of client updates.

Clients finish one at a time; holding every client's update until the round ends would cost a
model copy per client. Since p_i = score_i / Σ score_j, we keep Σ score_i·Δ_i per tensor and
normalise once the round is over. A second, size-weighted sum is kept only when the policy can
degenerate (`WeightingPolicy.can_degenerate`), so the size fallback (DESIGN.md §3) needs no replay.
Sums are kept in the dtype and on the device of the global tensor (`like`; float64 stays float64),
else in the update's dtype, never below float32. A tensor that no client with a positive weight
sent is left out of Δ (the server optimiser then leaves it alone).
"""
from __future__ import annotations

import math

import torch

from .tensors import Tensors
from .weighting import WEIGHTINGS, Weights, client_score, client_weights


def accumulator_dtype(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.dtype:
    """The dtype a sum of `t`s is kept in: `like`'s (else t's) floating dtype, at least float32."""
    dtype = like.dtype if like is not None and like.is_floating_point() else t.dtype
    return torch.promote_types(dtype, torch.float32)


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
                like = self.like.get(name)
                device = like.device if like is not None else t.device
                self.sums[name] = t.detach().to(device=device, dtype=accumulator_dtype(t, like),
                                                copy=True).mul_(weight)
            else:
                acc.add_(t.detach().to(acc.device), alpha=weight)  # add_ casts to the sum's dtype
            self.norms[name] = self.norms.get(name, 0.0) + weight

    def mean(self) -> Tensors:
        """Per-tensor weighted mean, divided in place: call once, when the round is over."""
        return {k: s.div_(self.norms[k]) for k, s in self.sums.items()}


class RoundAggregator:
    """Collects one round's client deltas under a weighting policy (a `WEIGHTINGS` name)."""

    def __init__(self, policy: str, like: Tensors | None = None) -> None:
        self.policy = policy
        self.can_degenerate = WEIGHTINGS.get(policy).can_degenerate  # an unknown policy lists the choices
        self.primary = StreamingMean(like)
        self.by_size = StreamingMean(like) if self.can_degenerate else None
        self.clients: list[str] = []
        self.sizes: list[float] = []
        self.values: list[float] = []
        self._result: tuple[Tensors, Weights] | None = None

    def add(self, client: str, update: Tensors, n_examples: float, value: float = math.nan) -> None:
        """`value`: the statistic the policy reads (ΔL, mean loss, ...), as the caller picked it."""
        if self._result is not None:
            raise RuntimeError("this round's aggregate is already finished")
        self.primary.add(update, client_score(self.policy, n_examples, value))
        if self.by_size is not None:
            self.by_size.add(update, float(n_examples))
        self.clients.append(client)
        self.sizes.append(n_examples)
        self.values.append(value)

    def finish(self) -> tuple[Tensors, Weights]:
        """The aggregated delta Σ p_i Δ_i (per tensor, over the clients that sent it) and the weights
        p_i, one per client in `clients` order. Idempotent; the sums are released."""
        if self._result is None:
            self._result = self._finish()
            self.primary = self.by_size = None
        return self._result

    def _finish(self) -> tuple[Tensors, Weights]:
        if not self.clients:
            return {}, Weights([], False)
        weights = client_weights(self.policy, self.sizes, self.values)
        if not weights.fallback:
            return self.primary.mean(), weights
        if self.by_size is None:
            raise ValueError(f"weighting policy {self.policy!r} says it cannot degenerate, yet its scores "
                             f"did this round (sizes {self.sizes}, values {self.values})")
        return self.by_size.mean(), weights
