"""The weighted mean as one sum: what a silo puts inside secure aggregation's mask, and how the server
reads the round's aggregate from the sum alone.

Under secure aggregation the server never sees one silo's update, weight or statistic (Lorar's ΔL),
only the sum over the silos. So each silo computes its own score s_i (the weighting policy of
fedsilo.core.weighting, from its size and its own statistic) and sends the vector
[s_i·Δ_i, s_i]; the mean Σ s_i·Δ_i / Σ s_i is the weighted mean of fedsilo.core.aggregate.

A policy whose score can be unusable (ΔL NaN, negative, zero) falls back to size shares; here a silo
whose score is not positive and finite fills a second part instead, [n_i·Δ_i, n_i], and every silo
adds n_i to a third total. From the three totals the server forms what RoundAggregator forms in the
clear — the fallen silos their size share n_i/Σn, the others the rest by their scores, every silo its
size share when none is usable — with one difference: a zero score falls back here (in the clear it
weighs 0 unless every score is 0), since the sum cannot tell the server which silo's score was zero.
That part doubles the vector, so a policy that cannot degenerate (size, equal) sends one part.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .tensors import Tensors
from .weighting import WeightingPolicy, client_score


@dataclass(frozen=True)
class Layout:
    """The order and shapes of the tensors in a masked vector, and whether it has the fallback part."""
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fallback: bool

    @classmethod
    def of(cls, like: Tensors, names: Sequence[str], policy: WeightingPolicy) -> "Layout":
        """Names sorted: the silos and the server build the same layout from their own tensors."""
        names = sorted(names)
        return cls(tuple(names), tuple(tuple(like[n].shape) for n in names), policy.can_degenerate)

    @property
    def width(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def length(self) -> int:
        """[s·Δ, (n·Δ if fallback), s, (n_fallen, n_all if fallback)]"""
        return (2 if self.fallback else 1) * self.width + (3 if self.fallback else 1)


def flatten(delta: Tensors, layout: Layout) -> np.ndarray:
    missing = [n for n in layout.names if n not in delta]
    if missing:
        raise ValueError(f"secure aggregation needs every shared tensor from every silo; {missing[:3]} missing")
    return np.concatenate([delta[n].detach().to("cpu", torch.float64).reshape(-1).numpy() for n in layout.names])


def weighted_vector(delta: Tensors, n_examples: int, value: float, policy: WeightingPolicy,
                    layout: Layout) -> np.ndarray:
    """What one silo puts inside the mask (float64, `layout.length`)."""
    score = client_score(policy, n_examples, value)
    flat = flatten(delta, layout)
    out = np.zeros(layout.length)
    w = layout.width
    usable = math.isfinite(score) and score > 0
    if not layout.fallback:
        if not usable:
            raise ValueError(f"weighting score {score!r} is not positive and finite")
        out[:w] = score * flat
        out[w] = score
        return out
    if usable:
        out[:w] = score * flat
        out[2 * w] = score
    else:
        out[w:2 * w] = n_examples * flat
        out[2 * w + 1] = n_examples
    out[2 * w + 2] = n_examples
    return out


def mean_from_sum(total: np.ndarray, layout: Layout, like: Tensors) -> Tensors:
    """The round's weighted mean Δ from the silos' summed vectors (in `like`'s dtypes and devices)."""
    w = layout.width
    if total.shape != (layout.length,):
        raise ValueError(f"a secure sum of length {total.shape}, expected {layout.length}")
    if not layout.fallback:
        if not total[w] > 0:
            raise ValueError("the silos' weights sum to zero")
        flat = total[:w] / total[w]
    else:
        scores, fallen_n, all_n = total[2 * w], total[2 * w + 1], total[2 * w + 2]
        if not all_n > 0:
            raise ValueError("the silos' sizes sum to zero")
        if scores > 0:  # the fallen take their size share, the rest goes by score
            flat = (1 - fallen_n / all_n) * total[:w] / scores + total[w:2 * w] / all_n
        else:           # none usable: every silo by size (all of them filled the size part)
            flat = total[w:2 * w] / all_n
    out, at = {}, 0
    for name, shape in zip(layout.names, layout.shapes):
        size = math.prod(shape)
        ref = like[name]
        out[name] = torch.from_numpy(flat[at:at + size].reshape(shape).copy()).to(ref.device, ref.dtype)
        at += size
    return out
