"""Dynamic Pulling (Passban et al. 2022): each client uploads only the tensors that changed least
(`dp_l`) or most (`dp_g`) on it since its previous round, or as many chosen at random (`random`).

For a tensor t, c_t = ‖w_t(end of round r) − w_t(end of round r−1)‖ on that client. The threshold
θ is taken separately over encoder and decoder tensors, which change at different scales: at the
default share (50%) θ is the median of c_t and DP_g uploads c_t ≥ θ, DP_l c_t < θ (the paper's
Equations 2 and 3). Another share s moves θ to a quantile: DP_g uploads c_t ≥ q(1 − s), DP_l
c_t < q(s) (linear interpolation, as numpy's default; q(0.5) is the median). A client's first round
has no previous tensors: it uploads everything.

Tensors in neither the encoder nor the decoder — with the tied vocabularies of our models, the word
embeddings and the output layer, which are one tensor — join the group named by `other`
(default: the decoder's, since the decoder both reads and writes them), form their own group, or
are always or never uploaded.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .exchange import SelectionContext, matches, register_selector


class PullingSettings(BaseModel):
    """`exchange.upload_options` of dp_g, dp_l and random."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    share: float = Field(0.5, gt=0, lt=1, description="the share of each group's tensors exchanged "
                                                       "(0.5: θ = the median, as the paper)")
    encoder: list[str] = Field(default_factory=lambda: ["*encoder.*"], description="globs of encoder tensors")
    decoder: list[str] = Field(default_factory=lambda: ["*decoder.*"], description="globs of decoder tensors")
    other: Literal["decoder", "encoder", "own", "always", "never"] = Field(
        "decoder", description="where tensors in neither group go (embeddings, output layer)")
    measure: Literal["norm", "rms"] = Field(
        "norm", description="norm: ‖Δw_t‖ (the paper); rms: ‖Δw_t‖/√size, so large tensors do not "
                            "rank as changed only for being large")


def groups(names: Sequence[str], settings: PullingSettings) -> tuple[list[list[str]], list[str]]:
    """(groups the threshold is taken over, names always uploaded), in model order."""
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


def change(now: torch.Tensor, before: torch.Tensor, measure: str = "norm") -> float:
    d = float(torch.linalg.vector_norm(now.detach().double() - before.detach().to(now.device).double()))
    return d / math.sqrt(now.numel()) if measure == "rms" else d


def _select(ctx: SelectionContext, mode: str) -> list[str]:
    settings: PullingSettings = ctx.options or PullingSettings()
    if ctx.previous is None:  # the client's first round: nothing to compare with, send everything
        return list(ctx.names)
    group_list, chosen = groups(ctx.names, settings)
    chosen, rng = list(chosen), ctx.rng()
    for names in group_list:
        c = {n: change(ctx.now[n], ctx.previous[n], settings.measure) for n in names}
        less = quantile(list(c.values()), settings.share)
        if mode == "dp_g":
            theta = quantile(list(c.values()), 1 - settings.share)
            chosen += [n for n in names if c[n] >= theta]
        elif mode == "dp_l":
            chosen += [n for n in names if c[n] < less]
        else:  # random: as many as DP_l would take from this group
            k = sum(c[n] < less for n in names)
            chosen += rng.sample(list(names), k)
    return chosen


@register_selector("dp_g", needs_previous=True, settings=PullingSettings)
def dp_g(ctx: SelectionContext) -> list[str]:
    """The tensors that changed most on this client since its previous round (c_t ≥ θ)."""
    return _select(ctx, "dp_g")


@register_selector("dp_l", needs_previous=True, settings=PullingSettings)
def dp_l(ctx: SelectionContext) -> list[str]:
    """The tensors that changed least (c_t < θ): the paper's better variant."""
    return _select(ctx, "dp_l")


@register_selector("random", needs_previous=True, settings=PullingSettings)
def random_pull(ctx: SelectionContext) -> list[str]:
    """As many tensors per group as DP_l would upload, chosen at random (seeded per client and round)."""
    return _select(ctx, "random")
