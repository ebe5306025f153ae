"""Client weighting policies p_i (DESIGN.md §3, Lorar paper Eqn. 2 and 6).

A policy turns each client's *score* into a weight p_i = score_i / Σ score_j. Scores are what a
client's own numbers give, so the engine can aggregate as clients finish (streaming, one
accumulator) and normalise at the end.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("size", "equal", "lorar", "loss_reduction", "loss")


def delta_loss(logged: Sequence[float]) -> float:
    """ΔL = max − min of the losses a client logged during this round (nan if none)."""
    values = [float(v) for v in logged]
    if not values:
        return math.nan
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values) - min(values)


def client_score(policy: str, n_examples: int, delta: float, loss: float = math.nan) -> float:
    """Unnormalised weight of one client under `policy`."""
    if policy == "size":
        return float(n_examples)
    if policy == "equal":
        return 1.0
    if policy == "lorar":
        return n_examples * delta
    if policy == "loss_reduction":
        return delta
    if policy == "loss":  # FewFedWeight: harder tasks weigh more
        return loss
    raise ValueError(f"unknown weighting policy {policy!r}; choose one of {', '.join(POLICIES)}")


def _usable(scores: Sequence[float]) -> bool:
    return all(math.isfinite(s) and s >= 0 for s in scores) and sum(scores) > 0


@dataclass(frozen=True)
class Weights:
    values: list[float]
    fallback: bool  # True when the policy was degenerate and size weights were used instead


def client_weights(
    policy: str,
    sizes: Sequence[int],
    deltas: Sequence[float] | None = None,
    losses: Sequence[float] | None = None,
) -> Weights:
    """p_i for one round. Degenerate scores (all zero, a NaN/inf, a negative) fall back to size."""
    n = len(sizes)
    deltas = list(deltas) if deltas is not None else [math.nan] * n
    losses = list(losses) if losses is not None else [math.nan] * n
    scores = [client_score(policy, s, d, l) for s, d, l in zip(sizes, deltas, losses)]
    fallback = not _usable(scores)
    if fallback:
        scores = [float(s) for s in sizes]
        if not _usable(scores):
            raise ValueError(f"client sizes {list(sizes)} give no usable weights")
    total = sum(scores)
    return Weights([s / total for s in scores], fallback)
