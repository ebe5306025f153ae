"""Streaming weighted aggregation of client updates.

Clients finish one at a time; holding every client's update until the round ends would cost a
model copy per client. Since p_i = score_i / Σ score_j, we keep Σ score_i·Δ_i per tensor and
normalise once the round is over. A second, size-weighted sum is kept only when the policy can
degenerate, so the size fallback (DESIGN.md §3) needs no replay. Sums are kept in the dtype of the
global tensor (float64 stays float64), never below float32.
"""
from __future__ import annotations

import math

import torch

from .tensors import Tensors
from .weighting import WEIGHTINGS, Weights, client_score, client_weights


def _acc_dtype(t: torch.Tensor, like: torch.Tensor | None) -> torch.dtype:
    dtype = like.dtype if like is not None else t.dtype
    if not dtype.is_floating_point:
        return dtype
    return torch.promote_types(dtype, torch.float32)


class StreamingMean:
    """Σ w_i·x_i and Σ w_i per tensor, over the clients that sent that tensor with weight > 0."""

    def __init__(self, like: Tensors | None = None) -> None:
        self.like = like or {}
        self.sums: Tensors = {}
        self.norms: dict[str, float] = {}

    def add(self, update: Tensors, weight: float) -> None:
        for name, t in update.items():
            if name in self.sums:
                self.sums[name].add_(t.to(self.sums[name].dtype), alpha=weight)
            else:
                self.sums[name] = t.detach().to(_acc_dtype(t, self.like.get(name))) * weight
            self.norms[name] = self.norms.get(name, 0.0) + weight

    def mean(self) -> Tensors:
        """Per-tensor weighted mean; a tensor whose weights sum to zero is left out (no update)."""
        return {k: s.div_(self.norms[k]) for k, s in self.sums.items() if self.norms[k] > 0}


class RoundAggregator:
    """Collects one round's client deltas under a weighting policy."""

    def __init__(self, policy: str, like: Tensors | None = None) -> None:
        self.policy = policy
        self.primary = StreamingMean(like)
        self.by_size = StreamingMean(like) if WEIGHTINGS.get(policy).can_degenerate else None
        self.clients: list[str] = []
        self.sizes: list[float] = []
        self.values: list[float] = []

    def add(self, client: str, update: Tensors, n_examples: float, value: float = math.nan) -> None:
        """`value`: the statistic the policy reads (ΔL, mean loss, ...), as the caller picked it."""
        score = client_score(self.policy, n_examples, value)
        self.primary.add(update, score if math.isfinite(score) and score > 0 else 0.0)
        if self.by_size is not None:
            self.by_size.add(update, float(n_examples))
        self.clients.append(client)
        self.sizes.append(n_examples)
        self.values.append(value)

    def finish(self) -> tuple[Tensors, Weights]:
        """The aggregated delta Σ p_i Δ_i and the weights p_i that produced it."""
        if not self.clients:
            return {}, Weights([], False)
        weights = client_weights(self.policy, self.sizes, self.values)
        source = self.by_size if weights.fallback else self.primary
        return source.mean(), weights
