"""Client weighting policies p_i (DESIGN.md §3, Lorar paper Eqn. 2 and 6; FewFedWeight Eqn. 7).

A policy turns each client's *score* into a weight p_i = score_i / Σ score_j. A score depends only on
the client's own numbers — its size and one statistic it reports, read by name (ΔL, mean loss, a
metric) — so the server can aggregate as clients finish (streaming) and normalise at the end.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedsilo.registry import Registry


@dataclass(frozen=True)
class WeightingPolicy:
    score: Callable[[float, float], float]  # (n_examples, value of the statistic it reads) -> score
    reads: str | None = None                # the client statistic it reads by default
    can_degenerate: bool = True             # scores may all be 0 / NaN: keep a size-weighted fallback sum
    # Abilities that privacy stages read (fedsilo.privacy.silo_dp):
    public_weight: Callable[[int], float] | None = None  # the weight from the size a silo registered before the
                                                         # first round alone (None: it reads the silo's data)
    uniform: bool = False                   # every silo weighs the same, whatever its size


WEIGHTINGS: Registry[WeightingPolicy] = Registry("weighting policy")
WEIGHTINGS.add("size", WeightingPolicy(lambda n, _: float(n), None, can_degenerate=False, public_weight=float))
WEIGHTINGS.add("equal", WeightingPolicy(lambda n, _: 1.0, None, can_degenerate=False, public_weight=lambda n: 1.0,
                                        uniform=True))
WEIGHTINGS.add("lorar", WeightingPolicy(lambda n, dl: n * dl, "delta_loss"))
WEIGHTINGS.add("loss_reduction", WeightingPolicy(lambda n, dl: dl, "delta_loss"))
WEIGHTINGS.add("loss", WeightingPolicy(lambda n, loss: loss, "mean_loss"))  # FewFedWeight: harder tasks weigh more


def delta_loss(logged: Sequence[float]) -> float:
    """ΔL = max − min of the losses a client logged during this round (nan if none)."""
    values = [float(v) for v in logged]
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return max(values) - min(values)


def client_score(policy: WeightingPolicy, n_examples: float, value: float = math.nan) -> float:
    """Unnormalised weight of one client under `policy`."""
    return policy.score(n_examples, value)


@dataclass(frozen=True)
class Weights:
    values: list[float]
    fallback: list[bool]  # per client: its score was unusable (NaN, negative, inf), so it took its size share
    capped: list[bool]    # per client: held at max_weight_ratio × the others' median or max_client_weight

    @property
    def any_fallback(self) -> bool:
        return any(self.fallback)


def usable_score(score: float) -> bool:
    """A score a weight can be formed from (else that client falls back to its size share)."""
    return math.isfinite(score) and score >= 0


def client_weights(policy: WeightingPolicy, sizes: Sequence[float], values: Sequence[float] | None = None,
                   max_weight: float | None = None, max_ratio: float | None = None) -> Weights:
    """p_i for one round.

    A client whose score is unusable (its ΔL NaN, negative or infinite) falls back alone: it takes
    its size share n_i/Σn, and the other clients share the rest by their scores. When no usable
    score is positive, every client falls back to size weights. `max_ratio` then holds each p_i at
    most that many times the median of the others' (sizes and statistics are self-reported: a silo
    claiming 10¹² examples or ΔL = 1e30 cannot take the round), and `max_weight` caps each p_i,
    handing the excess to the others in proportion.
    """
    values = list(values) if values is not None else [math.nan] * len(sizes)
    scores = [client_score(policy, n, v) for n, v in zip(sizes, values)]
    total_n = float(sum(sizes))
    if not (math.isfinite(total_n) and total_n > 0):
        raise ValueError(f"client sizes {list(sizes)} give no usable weights")
    fallback = [not usable_score(s) for s in scores]
    usable_total = sum(s for s, fb in zip(scores, fallback) if not fb)
    if usable_total <= 0:
        fallback = [True] * len(scores)
    share = sum(n for n, fb in zip(sizes, fallback) if fb) / total_n  # taken by the fallback clients
    p = [n / total_n if fb else (1 - share) * s / usable_total for n, s, fb in zip(sizes, scores, fallback)]
    capped = [False] * len(p)
    if max_ratio is not None:
        p, capped = cap_ratio(p, max_ratio)
    if max_weight is not None:
        p, by_weight = cap_weights(p, max_weight)
        capped = [a or b for a, b in zip(capped, by_weight)]
    return Weights(p, fallback, capped)


def cap_ratio(p: Sequence[float], ratio: float) -> tuple[list[float], list[bool]]:
    """Hold each weight at most `ratio` × the median of the others' (final, positive) weights, then renormalise.
    Lowering a weight only lowers the others' bounds, so the passes converge from above; the smallest
    weight never moves (ratio ≥ 1). With m equal honest silos one silo can reach ratio/(ratio+m−1)."""
    p = [float(x) for x in p]
    capped = [False] * len(p)
    if len(p) < 2:
        return p, capped
    for _ in range(100):  # converges in a few passes; the bound keeps a runaway loop finite
        changed = False
        for i, x in enumerate(p):
            others = [q for j, q in enumerate(p) if j != i and q > 0]  # zero weights bound nothing
            bound = ratio * statistics.median(others) if others else math.inf
            if x > bound * (1 + 1e-12):
                p[i], capped[i], changed = bound, True, True
        if not changed:
            break
    total = sum(p)
    return [x / total for x in p], capped


def cap_weights(p: Sequence[float], cap: float) -> tuple[list[float], list[bool]]:
    """Water-filling: no weight above `cap`, the excess shared by the others in proportion to their
    weights (equally among zero-weight ones if only they are left); equal weights if cap < 1/k."""
    p = [float(x) for x in p]
    if cap * len(p) <= 1:
        return [1 / len(p)] * len(p), [True] * len(p)
    capped = [False] * len(p)
    while True:
        over = [i for i, x in enumerate(p) if not capped[i] and x > cap]
        if not over:
            return p, capped
        for i in over:
            capped[i] = True
        free = [i for i in range(len(p)) if not capped[i]]
        rest = 1 - cap * (len(p) - len(free))
        mass = sum(p[i] for i in free)
        for i in range(len(p)):
            if capped[i]:
                p[i] = cap
            elif mass > 0:
                p[i] = rest * p[i] / mass
            else:
                p[i] = rest / len(free)
