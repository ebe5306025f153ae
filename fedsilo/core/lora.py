"""How the server aggregates low-rank adapters (LoRA, Hu et al. 2022): one registered policy per method.

A LoRA layer computes W·x + s·B·A·x (s = alpha / rank); only A (rank × in) and B (out × rank) train.
Averaging A and B apart (FedIT, Zhang et al. 2024) does not give the average of the updates:
(Σ pᵢBᵢ)(Σ pᵢAᵢ) ≠ Σ pᵢ·BᵢAᵢ. Three policies:

- ``fedit``: A and B are averaged apart, like any other tensor (the common practice; inexact).
- ``ffa``: FFA-LoRA (Sun et al. 2024): A stays at its seeded start on every silo, only B trains and
  travels; with one shared A the mean of B·A is exact, at the cost of training half the adapter.
- ``exact``: every silo starts each round from the same adapters (A at its seeded start, B = 0) and
  the server merges each silo's own product into the base weights: ΔWᵢ = s·(BᵢAᵢ − B₀A₀), so the
  global update is Σ pᵢ·s·BᵢAᵢ exactly (the merge of FLoRA, Wang et al. 2024, without its
  stacking). Silos may train different ranks: a silo of rank rᵢ below the layer's rank keeps the
  adapters' last rows of A and columns of B at zero (`limit_rank`), so its product has rank rᵢ. The
  cost: the adapted base weights travel down (dense, each round), the adapters up.

Names follow peft's layers: ``<module>.lora_A.<adapter>.weight``, ``<module>.lora_B.<adapter>.weight``,
``<module>.base_layer.weight``. This module sees only named tensors (no model, no peft).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fedsilo.registry import Registry

from .tensors import Tensors


@dataclass(frozen=True)
class LoraAggregation:
    freeze_a: bool = False  # A never trains (FFA-LoRA): the silos share its seeded start
    merge: bool = False     # the server merges each silo's s·BᵢAᵢ into the base weights (exact)


LORA_AGGREGATIONS: Registry[LoraAggregation] = Registry("LoRA aggregation")
LORA_AGGREGATIONS.add("fedit", LoraAggregation())
LORA_AGGREGATIONS.add("ffa", LoraAggregation(freeze_a=True))
LORA_AGGREGATIONS.add("exact", LoraAggregation(merge=True))

_A = re.compile(r"^(?P<module>.+)\.lora_A\.(?P<adapter>[^.]+)\.weight$")


@dataclass(frozen=True)
class Pair:
    module: str
    a: str     # lora_A's tensor name
    b: str     # lora_B's
    base: str  # the adapted layer's base weight


def pairs(names: Iterable[str]) -> list[Pair]:
    """The adapter pairs among `names` (sorted by module)."""
    names = set(names)
    out = []
    for name in sorted(names):
        m = _A.match(name)
        if m:
            b = f"{m['module']}.lora_B.{m['adapter']}.weight"
            out.append(Pair(m["module"], name, b, f"{m['module']}.base_layer.weight"))
    return out


def merged_delta(delta: Tensors, reference: Tensors, scaling: float) -> Tensors:
    """A silo's Δ on (A, B) as the change of its effective weights: ΔW = s·(BᵢAᵢ − B₀A₀) on each base
    weight, in the base weight's dtype; the adapters' own Δ is dropped (they restart every round). A
    half the silo did not send (an upload selector left it out) is taken as unchanged. Tensors other
    than adapters pass through."""
    out = dict(delta)
    for p in pairs(reference):
        if p.a not in delta and p.b not in delta:
            continue
        if p.base not in reference:
            raise ValueError(f"the exact LoRA merge needs {p.module}'s base weight among the shared tensors")
        a0, b0 = reference[p.a].double(), reference[p.b].double()
        a = a0 + delta[p.a].double() if p.a in delta else a0
        b = b0 + delta[p.b].double() if p.b in delta else b0
        out[p.base] = (scaling * (b @ a - b0 @ a0)).to(reference[p.base].dtype)
        out.pop(p.a, None)
        out.pop(p.b, None)
    return out


def limit_rank(tensors: Tensors, rank: int) -> Tensors:
    """The adapters held at rank `rank`: rows ≥ rank of every A and columns ≥ rank of every B are zero
    (other tensors unchanged). With B's columns at zero the zero rows of A get no gradient, and the
    reverse, so a silo trains a rank-`rank` product inside the layer's larger shape (HetLoRA's padding)."""
    out = dict(tensors)
    for name, t in tensors.items():
        if ".lora_A." in name and t.shape[0] > rank:
            out[name] = torch.cat([t[:rank], t.new_zeros(t.shape[0] - rank, *t.shape[1:])])
        elif ".lora_B." in name and t.dim() == 2 and t.shape[1] > rank:
            out[name] = torch.cat([t[:, :rank], t.new_zeros(t.shape[0], t.shape[1] - rank)], dim=1)
    return out


def product_sum(updates: list[Tensors], weights: list[float], scaling: float) -> Tensors:
    """Σ pᵢ·s·BᵢAᵢ per adapted module (p normalised): what `exact` adds to the base weights when every
    silo started from B = 0, and the reference FedIT's product of means is compared with."""
    total = sum(weights)
    out: Tensors = {}
    for tensors, w in zip(updates, weights):
        for p in pairs(tensors):
            term = (w / total) * scaling * (tensors[p.b].double() @ tensors[p.a].double())
            out[p.module] = term if p.module not in out else out[p.module] + term
    return out
