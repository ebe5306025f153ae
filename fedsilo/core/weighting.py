"""Client weighting policies p_i (DESIGN.md §3, Lorar paper Eqn. 2 and 6; FewFedWeight Eqn. 7).

A policy turns each client's *score* into a weight p_i = score_i / Σ score_j. A score depends only on
the client's own numbers — its size and one statistic it reports, read by name (ΔL, mean loss, a
metric) — so the server can aggregate as clients finish (streaming) and normalise at the end.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedsilo.registry import Registry


@dataclass(frozen=True)
class WeightingPolicy:
    score: Callable[[float, float], float]  # (n_examples, value of the statistic it reads) -> score
    reads: str | None = None                # the client statistic it reads by default
    can_degenerate: bool = True             # scores may all be 0 / NaN: keep a size-weighted fallback sum


WEIGHTINGS: Registry[WeightingPolicy] = Registry("weighting policy")
WEIGHTINGS.add("size", WeightingPolicy(lambda n, _: float(n), None, can_degenerate=False))
WEIGHTINGS.add("equal", WeightingPolicy(lambda n, _: 1.0, None, can_degenerate=False))
WEIGHTINGS.add("lorar", WeightingPolicy(lambda n, dl: n * dl, "delta_loss"))
WEIGHTINGS.add("loss_reduction", WeightingPolicy(lambda n, dl: dl, "delta_loss"))
WEIGHTINGS.add("loss", WeightingPolicy(lambda n, loss: loss, "mean_loss"))  # FewFedWeight: harder tasks weigh more


def delta_loss(logged: Sequence[float]) -> float:
    """ΔL = max − min of the losses a client logged during this round (nan if none)."""
    values = [float(v) for v in logged]
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return max(values) - min(values)


def client_score(policy: str, n_examples: float, value: float = math.nan) -> float:
    """Unnormalised weight of one client under `policy`."""
    return WEIGHTINGS.get(policy).score(n_examples, value)


def _usable(scores: Sequence[float]) -> bool:
    return all(math.isfinite(s) and s >= 0 for s in scores) and sum(scores) > 0


@dataclass(frozen=True)
class Weights:
    values: list[float]
    fallback: bool  # True when the policy was degenerate and size weights were used instead


def client_weights(policy: str, sizes: Sequence[float], values: Sequence[float] | None = None) -> Weights:
    """p_i for one round. Degenerate scores (all zero, a NaN/inf, a negative) fall back to size."""
    values = list(values) if values is not None else [math.nan] * len(sizes)
    scores = [client_score(policy, s, v) for s, v in zip(sizes, values)]
    fallback = not _usable(scores)
    if fallback:
        scores = [float(s) for s in sizes]
        if not _usable(scores):
            raise ValueError(f"client sizes {list(sizes)} give no usable weights")
    total = sum(scores)
    return Weights([s / total for s in scores], fallback)
