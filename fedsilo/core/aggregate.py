"""Streaming weighted aggregation of client updates.

Clients finish one at a time; holding every client's update until the round ends would cost a
model copy per client. Since p_i = score_i / Σ score_j, we keep Σ score_i·Δ_i per tensor and
normalise once the round is over. A second, size-weighted sum is kept only when the policy can
degenerate, so the size fallback (DESIGN.md §3) needs no replay.
"""
from __future__ import annotations

import math

import torch

from .tensors import Tensors
from .weighting import Weights, client_score, client_weights


class StreamingMean:
    """Σ w_i·x_i and Σ w_i per tensor, over the clients that sent that tensor."""

    def __init__(self) -> None:
        self.sums: Tensors = {}
        self.norms: dict[str, float] = {}

    def add(self, update: Tensors, weight: float) -> None:
        for name, t in update.items():
            if name in self.sums:
                self.sums[name].add_(t, alpha=weight)
            else:
                self.sums[name] = t.detach().to(torch.float32 if t.is_floating_point() else t.dtype) * weight
            self.norms[name] = self.norms.get(name, 0.0) + weight

    def mean(self) -> Tensors:
        """Per-tensor weighted mean; a tensor whose weights sum to zero is left out (no update)."""
        return {k: s / self.norms[k] for k, s in self.sums.items() if self.norms[k] > 0}


class RoundAggregator:
    """Collects one round's client deltas under a weighting policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.primary = StreamingMean()
        self.by_size = StreamingMean() if policy != "size" else self.primary
        self.clients: list[str] = []
        self.sizes: list[int] = []
        self.deltas: list[float] = []
        self.losses: list[float] = []

    def add(self, client: str, update: Tensors, n_examples: int, delta_loss: float = math.nan,
            loss: float = math.nan) -> None:
        score = client_score(self.policy, n_examples, delta_loss, loss)
        self.primary.add(update, score if math.isfinite(score) else 0.0)
        if self.by_size is not self.primary:
            self.by_size.add(update, float(n_examples))
        self.clients.append(client)
        self.sizes.append(n_examples)
        self.deltas.append(delta_loss)
        self.losses.append(loss)

    def finish(self) -> tuple[Tensors, Weights]:
        """The aggregated delta Σ p_i Δ_i and the weights p_i that produced it."""
        if not self.clients:
            return {}, Weights([], False)
        weights = client_weights(self.policy, self.sizes, self.deltas, self.losses)
        source = self.by_size if weights.fallback else self.primary
        return source.mean(), weights
