"""Dynamic Pulling (Passban et al. 2022): each client uploads the tensors that changed least (`dp_l`)
or most (`dp_g`) on it since its previous round, or tensors chosen at random (`random`).

For a tensor t, c_t = ‖w_t(end of round r) − w_t(reference)‖ on that client (the measure: `l2`, the
paper's ‖·‖; `l1`; or `mean_abs`, mean |Δw| per entry). The reference is the client's tensors at the
end of its previous round; in its first round, the model it started that round from (the model every
client started from), so round 1 pulls a part too. Encoder and decoder tensors are ranked apart (the
paper: "calculated separately as they vary at different scales").

How much goes up (`threshold`):
- `parameters` (default): DP_l takes the least-changed tensors, DP_g the most-changed, until they
  hold `share` of the group's *parameters* (the cut nearest that share). The paper sends half of the
  parameters: 22,863,104 of 45,724,160 for DP_l (§5.4), "excluding half the parameters" (fn. 6), and
  "33% of the parameters" in Table 7. At share 0.5 both cut the same ranking at the same point, so
  DP_l and DP_g are complements (θ is the parameter-weighted median of c_t: Equations 2 and 3).
- `count`: θ is a quantile of c_t over the group's *tensors* (the median at share 0.5; linear
  interpolation as numpy's default): DP_g uploads c_t ≥ q(1 − share), DP_l c_t < q(share). Read
  literally ("the median of the differences") this is the paper's text, but on a Transformer, whose
  tensor sizes differ by 1000×, DP_l then sends the biases and LayerNorms (0.7% of the parameters)
  and DP_g the rest, far from the paper's reported counts.

`random` draws tensors of each group at random until they hold as many parameters as DP_l's
(`count`: as many tensors), seeded per run, round and client.

Tensors in neither the encoder nor the decoder — with the tied vocabularies of our models, the word
embeddings and the output layer, which are one tensor — join the group named by `other`
(default: the decoder's, since the decoder both reads and writes them), form their own group, or
are always or never uploaded.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .exchange import SelectionContext, matches, register_selector

MEASURES = ("l2", "l1", "mean_abs")


class PullingSettings(BaseModel):
    """`exchange.upload_options` of dp_g, dp_l and random."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    share: float = Field(0.5, gt=0, lt=1, description="the share of each group exchanged: of its parameters "
                                                       "(threshold = parameters) or of its tensors (count)")
    threshold: Literal["parameters", "count"] = Field(
        "parameters", description="parameters: tensors until they hold `share` of the group's parameters (the "
                                  "paper's reported counts); count: θ = a quantile of the changes over tensors")
    encoder: list[str] = Field(default_factory=lambda: ["*encoder.*"], description="globs of encoder tensors")
    decoder: list[str] = Field(default_factory=lambda: ["*decoder.*"], description="globs of decoder tensors")
    other: Literal["decoder", "encoder", "own", "always", "never"] = Field(
        "decoder", description="where tensors in neither group go (embeddings, output layer)")
    measure: Literal["l2", "l1", "mean_abs"] = Field(
        "l2", description="l2: ‖Δw_t‖₂ (the paper's norm); l1: ‖Δw_t‖₁; mean_abs: mean |Δw| per entry, so a "
                          "large tensor does not rank as changed for being large")

    @field_validator("measure", mode="before")
    @classmethod
    def _old_name(cls, v):
        return "l2" if v == "norm" else v  # "norm": this setting's name for l2 before l1 and mean_abs


def groups(names: Sequence[str], settings: PullingSettings) -> tuple[list[list[str]], list[str]]:
    """(groups ranked apart, names always uploaded), in model order."""
    enc, dec, rest = [], [], []
    for n in names:
        (enc if matches(n, settings.encoder) else dec if matches(n, settings.decoder) else rest).append(n)
    always: list[str] = []
    if settings.other == "encoder":
        enc = [n for n in names if n in set(enc) | set(rest)]
    elif settings.other == "decoder":
        dec = [n for n in names if n in set(dec) | set(rest)]
    elif settings.other == "always":
        always = rest
    out = [enc, dec] + ([rest] if settings.other == "own" else [])
    return [g for g in out if g], always


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def change(now: torch.Tensor, before: torch.Tensor, measure: str = "l2") -> float:
    d = now.detach().double() - before.detach().to(now.device).double()
    if measure == "l1":
        return float(d.abs().sum())
    if measure == "mean_abs":
        return float(d.abs().mean())
    return float(torch.linalg.vector_norm(d))


def leading_share(ranked: Sequence[str], sizes: Mapping[str, int], share: float) -> list[str]:
    """The first tensors of `ranked` whose parameters come nearest `share` of all of theirs (on a tie,
    the shorter prefix)."""
    target = share * sum(sizes[n] for n in ranked)
    best, best_gap, held = 0, target, 0
    for k, n in enumerate(ranked, start=1):
        held += sizes[n]
        if abs(held - target) < best_gap:
            best, best_gap = k, abs(held - target)
        if held >= target:
            break
    return list(ranked[:best])


def _by_parameters(mode: str, names: list[str], c: dict[str, float], sizes: dict[str, int], share: float,
                   rng) -> list[str]:
    ascending = sorted(names, key=lambda n: c[n])  # stable: equal changes stay in model order
    if mode == "dp_g":
        return leading_share(ascending[::-1], sizes, share)
    least = leading_share(ascending, sizes, share)
    if mode == "dp_l":
        return least
    return random_fill(rng.sample(list(names), len(names)), sizes, sum(sizes[n] for n in least))


def random_fill(drawn: Sequence[str], sizes: Mapping[str, int], target: int) -> list[str]:
    """Tensors in drawn order while they fit under `target` parameters, then the one left out that
    brings the total nearest it: random exchanges as many parameters as DP_l, not as many tensors."""
    taken, held = [], 0
    for n in drawn:
        if held + sizes[n] <= target:
            taken.append(n)
            held += sizes[n]
    rest = [n for n in drawn if n not in set(taken)]
    best = min(rest, key=lambda n: abs(held + sizes[n] - target), default=None)
    if best is not None and abs(held + sizes[best] - target) < target - held:
        taken.append(best)
    return taken


def _by_count(mode: str, names: list[str], c: dict[str, float], share: float, rng) -> list[str]:
    less = quantile(list(c.values()), share)
    if mode == "dp_g":
        theta = quantile(list(c.values()), 1 - share)
        return [n for n in names if c[n] >= theta]
    if mode == "dp_l":
        return [n for n in names if c[n] < less]
    return rng.sample(list(names), sum(c[n] < less for n in names))


def _select(ctx: SelectionContext, mode: str) -> list[str]:
    settings: PullingSettings = ctx.options or PullingSettings()
    if ctx.previous is None:  # nothing to compare with (the engines always pass a reference): send everything
        return list(ctx.names)
    group_list, chosen = groups(ctx.names, settings)
    chosen, rng = list(chosen), ctx.rng()
    for names in group_list:
        c = {n: change(ctx.now[n], ctx.previous[n], settings.measure) for n in names}
        if settings.threshold == "count":
            chosen += _by_count(mode, names, c, settings.share, rng)
        else:
            sizes = {n: ctx.now[n].numel() for n in names}
            chosen += _by_parameters(mode, names, c, sizes, settings.share, rng)
    return chosen


@register_selector("dp_g", needs_previous=True, settings=PullingSettings)
def dp_g(ctx: SelectionContext) -> list[str]:
    """The tensors that changed most on this client since its previous round."""
    return _select(ctx, "dp_g")


@register_selector("dp_l", needs_previous=True, settings=PullingSettings)
def dp_l(ctx: SelectionContext) -> list[str]:
    """The tensors that changed least: the paper's better variant."""
    return _select(ctx, "dp_l")


@register_selector("random", needs_previous=True, settings=PullingSettings)
def random_pull(ctx: SelectionContext) -> list[str]:
    """As many parameters per group as DP_l would upload (count: tensors), drawn at random."""
    return _select(ctx, "random")
