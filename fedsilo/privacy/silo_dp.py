"""Silo-level differential privacy: each silo is one user, and the global model after every round is
(ε, δ)-DP with respect to any one silo's whole contribution (DP-FedAvg, McMahan et al. 2018, with every
sampled silo each round).

Every silo clips its update Δ_i to L2 norm C. The round's aggregate uses a fixed denominator — the
public weights of the silos sampled this round, W = Σ w_j — so adding or removing one silo's update moves
the sum Σ w_i·Δ_i / W by at most w_max·C / W:

- central: the server adds N(0, (σ·C·w_max / W)²) to each coordinate of the aggregate. The server is
  trusted with the single (clipped) updates; what it releases, the model, is private.
- distributed: each silo adds N(0, σ²C²/m) to its own clipped update (equal weights), m being the number
  of silos it was told share the noise (federation's silos_per_round), so the sum carries N(0, σ²C²·k/m)
  when k silos answer: the ratio to the sensitivity C is σ·√(k/m), which the accountant composes — with
  the m the silos were told, never the number actually sampled (a spent silo is not sampled, and its
  share is missing from the sum). With secure aggregation the server sees only that noisy sum.

Fewer answers carry less noise, and the silos answer after the round has started, so each round is
planned for the worst case the protocol allows: the fewest silos that still form an aggregate (under
secure aggregation its threshold t of the n sampled; otherwise one, the server's minimum: it applies a
round from one accepted update — and then sees that one silo's update with its share alone). A round
whose ε would pass the target at that k is refused before it starts, and a σ derived from the target is
sized so that every planned round fits at that k.

Weights: `equal` (w = 1) or `size` (w = n_i, the size each silo registered before the first round: public,
fixed). The mean is formed with these public weights, never with the size a silo reports in its update:
a silo reporting n = 1 would otherwise shrink the denominator and raise an honest silo's share past what
the noise covers. Under secure aggregation each silo weighs its own vector inside the mask, so the
server divides the sum by the public W of the silos in it, not by the weight the sum carries. A weight
computed from a silo's data (Lorar's ΔL, FewFedWeight's loss) is itself a release no noise covers, and
bounds no silo's share: refused (fedsilo.config). Sampling a fraction of the silos is
accounted as if every silo took part each round (q = 1): fedsilo samples a fixed number without
replacement, which Opacus's Poisson accountant does not model, and no amplification is the safe side.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedsilo.core.masking import Layout
from fedsilo.core.tensors import Tensors

from .accountant import Budget
from .noise import SecretNormal, SeededNormal, noise_source


@dataclass
class SiloDP:
    central: bool           # True: the server adds the noise; False (distributed): each silo adds its share
    clip: float             # C
    noise_multiplier: float  # σ
    budget: Budget          # q = 1, one step per round
    seed: int | None = None  # None: secret noise (fedsilo.privacy.noise); else reproducible from (seed, round)
    shares: int = 1         # distributed: m, the silos each silo's share σ·C/√m was sized for
    fewest: Callable[[int], int] = lambda n: 1  # distributed: of n sampled, the fewest answers that form an aggregate

    def worst_case(self, sampled: int) -> tuple[float, int | None]:
        """(the σ a round is accounted with if only the fewest silos that still form an aggregate answer, that
        number); central mode: σ whoever answers."""
        if self.central:
            return self.noise_multiplier, None
        k = max(1, min(self.fewest(sampled), sampled))
        return self.noise_multiplier * math.sqrt(k / self.shares), k

    def refuses(self, round_idx: int, sampled: int | None = None) -> str | None:
        """Why round `round_idx` would pass the target ε (then the run ends before it), or None: planned for
        the fewest of the `sampled` silos (None: m) that still form an aggregate."""
        if self.budget.target_epsilon is None:
            return None
        n = self.shares if sampled is None else sampled
        sigma, k = self.worst_case(n)
        planned = Budget(sigma, 1.0, self.budget.delta, history=list(self.budget.history))
        after = planned.epsilon(1)
        if after > self.budget.target_epsilon * (1 + 1e-9):
            fewest = "" if k is None else (f" if only {k} of the {n} sampled silos answer, the fewest that still form "
                                           f"an aggregate (σ = {self.noise_multiplier:g}·√({k}/{self.shares}))")
            return (f"silo-level privacy budget: round {round_idx} would take the federation to ε = {after:.3f} > "
                    f"target ε = {self.budget.target_epsilon:g} (δ = {self.budget.delta:.3g}){fewest}; "
                    "the run ends here")
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
        if self.central:
            std = self.noise_multiplier * self.clip * max(sampled.values()) / total
            g = noise_source(None if self.seed is None else (self.seed * 1_000_003 + round_idx) % 2**63)
            for k, t in out.items():
                out[k] = (t.double() + g.normal(std, t.shape, t.device)).to(t.dtype)
            effective = self.noise_multiplier
        else:  # the silos added it, each σ·C/√m; fewer answers carry less of it
            effective = self.noise_multiplier * math.sqrt(len(accepted) / self.shares)
        self.budget.noise_multiplier = effective
        self.budget.spend(1)
        return out, {"mode": "central" if self.central else "distributed", "clip": self.clip, "noise_multiplier": effective, **self.budget.record(),
                     "silos": sorted(accepted)}


def silo_noise(delta: Tensors, clip: float, std: float, g: SecretNormal | SeededNormal | torch.Generator | None
               ) -> Tensors:
    """A silo's side: Δ clipped to `clip` (L2 over all tensors), plus N(0, std²) per coordinate when std > 0
    (drawn from `g`: a torch.Generator is seeded noise)."""
    if isinstance(g, torch.Generator):
        g = SeededNormal(g)
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in delta.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {}
    for k, t in delta.items():
        x = t.double() * scale
        if std > 0:
            x = x + g.normal(std, t.shape, t.device)
        out[k] = x.to(t.dtype)
    return out


@dataclass(frozen=True)
class SiloRelease:
    """The silo's side (the release position of its round): Δ clipped to C and, in distributed mode, its
    share of the noise added, before the update leaves."""
    clip: float
    std: float      # the noise std this silo adds (0: central mode, the server adds it)
    seeded: bool    # reproducible from the run seed (and removable by whoever knows it)

    def accounted(self) -> list[dict]:
        """What the silo's privacy ledger records of each release (fedsilo.privacy.ledger): its own share of
        the noise, σ_own = std / C at q = 1, one step (in central mode it adds none: nothing)."""
        return [{"level": "silo", "noise_multiplier": self.std / self.clip, "sample_rate": 1.0, "steps": 1}] \
            if self.std > 0 else []

    def __call__(self, values: Tensors, received: Tensors, run_seed: int) -> Tensors:
        g = noise_source(run_seed if self.seeded else None)
        noisy = silo_noise({k: v - received[k] for k, v in values.items()}, self.clip, self.std, g)
        return {k: received[k] + d for k, d in noisy.items()}


def public_denominator(total, layout: Layout, weight: float):
    """A secure sum [Σ w_i·Δ_i, Σ w_i] (fedsilo.core.masking.Layout) whose weight part is replaced by the public
    weight of the silos in it: each w_i inside the mask is the silo's own claim, and one that claims less
    would raise the others' shares."""
    if layout.fallback:
        raise ValueError("silo-level DP: a weighting with a fallback part has no public weight")
    total = total.copy()
    total[layout.width] = weight
    return total


class SiloDPRound:
    """Silo-level DP as a wrapper around any round aggregation (as Flower's DP strategies wrap a
    strategy): the inner stage's aggregate, over the fixed denominator of the sampled silos' public
    weights, with the central noise; the accountant's record at the round record's end. Whatever else
    the inner stage offers passes through. Every weight in the mean is public: the plain mean weighs each
    update by the size its silo registered (not the one it reports), and a secure sum is divided by the
    public weight of the silos in it (not by the weights inside the mask)."""

    def __init__(self, inner, dp: SiloDP, public_weight, registered: dict[str, int], sampled: list[str],
                 round_idx: int) -> None:
        self.inner, self.dp, self.public_weight = inner, dp, public_weight  # public_weight(silo) -> w
        self.registered, self.sampled, self.round = registered, sampled, round_idx

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def add(self, pending, entry: dict) -> None:
        """The update weighed by the size its silo registered (the server takes no unregistered silo once
        sizes are registered; a Server used without a registry has no public size to weigh by)."""
        if self.registered:
            pending = dataclasses.replace(pending, n_examples=self.registered[pending.client])
        self.inner.add(pending, entry)

    def take_sum(self, total, layout: Layout, silos: list[str], protocol: dict) -> str | None:
        return self.inner.take_sum(public_denominator(total, layout, sum(self.public_weight(s) for s in silos)),
                                   layout, silos, protocol)

    def finish(self, records: dict[str, dict]):
        out = self.inner.finish(records)
        if out.delta is not None and out.contributors:
            weights = {c: self.public_weight(c) for c in out.contributors}
            sampled = {c: self.public_weight(c) for c in (self.sampled or out.contributors)}
            out.delta, out.tail["silo_dp"] = self.dp.privatise(out.delta, weights, sampled, self.round)
        return out


@dataclass
class SiloDPStage:
    """The server's silo-level DP stage (fedsilo.server.RoundStage): wraps each round's aggregation; its
    accountant is kept in the server's checkpoint."""
    dp: SiloDP
    public_weight: Callable[[int], float]  # the weighting's weight from a registered size
    state_key = "silo_dp"

    def wrap(self, inner, round_idx: int, sampled: list[str], registered: dict[str, int]) -> SiloDPRound:
        return SiloDPRound(inner, self.dp, lambda c: self.public_weight(registered.get(c, 0)), registered, sampled,
                           round_idx)

    def refuses(self, round_idx: int, sampled: list[str] | None = None) -> str | None:
        return self.dp.refuses(round_idx, None if sampled is None else len(sampled))

    def limits(self, limits):
        """The sensitivity bound covers one clipped update each, nothing set by the others' updates: the
        plain path's per-update limits are off (central mode clips on arrival to C)."""
        return dataclasses.replace(limits, max_client_weight=None, max_weight_ratio=None, max_update_ratio=None,
                                   clip_norm=self.dp.clip if self.dp.central else None)

    def state_dict(self) -> str:
        return json.dumps(self.dp.budget.to_meta())

    def load_state_dict(self, state: str | None) -> None:
        """The checkpoint's history of releases (checked against rounds.jsonl by `state_problem`); σ's plan,
        δ and the target are the config's, never a checkpoint's."""
        dp = self.dp
        history = Budget.from_meta(json.loads(state)).history if state is not None else []
        dp.budget = Budget(dp.noise_multiplier, 1.0, dp.budget.delta, dp.budget.target_epsilon, history)

    def state_problem(self, state: str | None, recorded: list[dict | None]) -> str | None:
        """What is wrong with a checkpoint's accountant (`state`), given this stage's record of each round
        it has done (rounds.jsonl's `silo_dp`, None where a round released nothing), or None. The records
        are the authority: the accountant they compose is rebuilt, and one that differs (an emptied or
        shortened history, another σ, δ or target) is refused, never trusted to spend less."""
        rebuilt = Budget(self.dp.noise_multiplier, 1.0, self.dp.budget.delta, self.dp.budget.target_epsilon)
        for r, record in enumerate(recorded, 1):
            if record is None:
                continue
            try:
                sigma, steps = float(record["noise_multiplier"]), int(record["steps"])
            except (KeyError, TypeError, ValueError):
                return f"rounds.jsonl's silo_dp record of round {r} is unreadable"
            if steps != rebuilt.steps + 1:
                return (f"rounds.jsonl's silo_dp record of round {r} says {steps} releases where its earlier "
                        f"rounds record {rebuilt.steps}")
            rebuilt.noise_multiplier = sigma
            rebuilt.spend(1)
        try:
            held = Budget.from_meta(json.loads(state)) if state is not None else None
        except (TypeError, ValueError, KeyError, json.JSONDecodeError):
            return "its silo-level DP accountant (server silo_dp) is unreadable"
        if held is None:
            return (f"it holds no silo-level DP accountant, where rounds.jsonl records {rebuilt.steps} releases"
                    if rebuilt.steps else None)
        same = ([tuple(h) for h in held.history] == [tuple(h) for h in rebuilt.history]
                and (held.delta, held.sample_rate, held.target_epsilon) == (rebuilt.delta, 1.0, rebuilt.target_epsilon))
        if same:
            return None
        return (f"its silo-level DP accountant (server silo_dp: {held.steps} releases, ε = {held.epsilon():.3f}, "
                f"δ = {held.delta:.3g}, target {held.target_epsilon}) disagrees with rounds.jsonl and the config "
                f"({rebuilt.steps} releases, ε = {rebuilt.epsilon():.3f}, δ = {rebuilt.delta:.3g}, target "
                f"{rebuilt.target_epsilon}): edited or another run's, it would spend the privacy budget again")
