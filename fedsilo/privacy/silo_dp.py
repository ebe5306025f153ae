"""Silo-level differential privacy: each silo is one user, and the global model after every round is
(ε, δ)-DP with respect to any one silo's whole contribution (DP-FedAvg, McMahan et al. 2018, with every
sampled silo each round).

Every silo clips its update Δ_i to L2 norm C. The round's aggregate uses a fixed denominator — the
public weights of the silos sampled this round, W = Σ w_j — so adding or removing one silo's update moves
the sum Σ w_i·Δ_i / W by at most w_max·C / W:

- central: the server adds N(0, (σ·C·w_max / W)²) to each coordinate of the aggregate. The server is
  trusted with the single (clipped) updates; what it releases, the model, is private.
- distributed: each silo adds N(0, σ²C²/m) to its own clipped update (equal weights, m silos sampled), so
  the sum carries N(0, σ²C²·k/m) when k silos answer: the ratio to the sensitivity C is σ·√(k/m), which
  the accountant composes. With secure aggregation the server sees only that noisy sum.

Weights: `equal` (w = 1) or `size` (w = n_i, the size each silo registered before the first round: public,
fixed). A weight computed from a silo's data (Lorar's ΔL, FewFedWeight's loss) is itself a release no
noise covers, and bounds no silo's share: refused (fedsilo.config). Sampling a fraction of the silos is
accounted as if every silo took part each round (q = 1): fedsilo samples a fixed number without
replacement, which Opacus's Poisson accountant does not model, and no amplification is the safe side.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from fedsilo.core.tensors import Tensors

from .accountant import Budget


@dataclass
class SiloDP:
    mode: str               # central | distributed
    clip: float             # C
    noise_multiplier: float  # σ
    budget: Budget          # q = 1, one step per round
    seed: int | None = None  # None: noise from os.urandom; else reproducible from (seed, round)

    def refuses(self, round_idx: int) -> str | None:
        """Why round `round_idx` would pass the target ε (then the run ends before it), or None."""
        if self.budget.target_epsilon is None:
            return None
        planned = Budget(self.noise_multiplier, 1.0, self.budget.delta, history=list(self.budget.history))
        after = planned.epsilon(1)
        if after > self.budget.target_epsilon * (1 + 1e-9):
            return (f"silo-level privacy budget: round {round_idx} would take the federation to ε = {after:.3f} > "
                    f"target ε = {self.budget.target_epsilon:g} (δ = {self.budget.delta:.3g}); the run ends here")
        return None

    def privatise(self, mean: Tensors, accepted: dict[str, float], sampled: dict[str, float], round_idx: int
                  ) -> tuple[Tensors, dict]:
        """The aggregate over the fixed denominator, with the central noise; the round's accountant record.

        `mean`: the weighted mean over the `accepted` silos ({silo: weight w}); `sampled`: the weights of
        every silo sampled this round (W = their sum)."""
        total = sum(sampled.values())
        if not (total > 0 and accepted):
            raise ValueError("silo-level DP: no weight to aggregate")
        scale = sum(accepted.values()) / total
        out = {k: t * scale for k, t in mean.items()}
        if self.mode == "central":
            std = self.noise_multiplier * self.clip * max(sampled.values()) / total
            g = torch.Generator()
            g.manual_seed(int.from_bytes(os.urandom(8), "little") if self.seed is None
                          else (self.seed * 1_000_003 + round_idx) % 2**63)
            for k, t in out.items():
                noise = torch.normal(0.0, std, t.shape, generator=g, dtype=torch.float64).to(t.device)
                out[k] = (t.double() + noise).to(t.dtype)
            effective = self.noise_multiplier
        else:  # the silos added it; fewer answers carry less of it
            effective = self.noise_multiplier * math.sqrt(len(accepted) / len(sampled))
        self.budget.noise_multiplier = effective
        self.budget.spend(1)
        return out, {"mode": self.mode, "clip": self.clip, "noise_multiplier": effective, **self.budget.record(),
                     "silos": sorted(accepted)}


def silo_noise(delta: Tensors, clip: float, std: float, g: torch.Generator | None) -> Tensors:
    """A silo's side: Δ clipped to `clip` (L2 over all tensors), plus N(0, std²) per coordinate when std > 0."""
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in delta.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {}
    for k, t in delta.items():
        x = t.double() * scale
        if std > 0:
            x = x + torch.normal(0.0, std, t.shape, generator=g, dtype=torch.float64).to(t.device)
        out[k] = x.to(t.dtype)
    return out
