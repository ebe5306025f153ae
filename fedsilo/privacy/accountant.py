"""The accountant both privacy levels use: Opacus's RDP accountant of the (subsampled) Gaussian
mechanism over a history of (σ, q, steps): a silo's DP-SGD history comes from its privacy ledger
(fedsilo.privacy.ledger), silo-level DP's from the server's checkpoint, checked on resume against
rounds.jsonl's records of it (fedsilo.privacy.silo_dp.SiloDPStage.state_problem)."""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedsilo.errors import ConfigError


ORDERS = tuple(range(2, 257))
"""The Rényi orders the accountant composes over: integers, where Opacus's RDP of the subsampled Gaussian is
the exact closed form (ε equals Google's dp-accounting's over the same orders: the tests check 1e-3 relative). At Opacus's default fractional orders
below 2 its truncated series gives less than dp-accounting's converged value for σ < 1 (order 1.9, σ = 0.657,
q = 0.25: 0.3953 against 0.3975), so an ε from them can be too small. Integer orders are conservative: for
σ = 0.657, q = 0.25, 24 steps, δ = 1/320, ε = 15.23 here against 13.99 from dp-accounting's fine orders."""


@dataclass
class Budget:
    """A silo's accountant: σ and q fixed at its first round, and the steps it has taken with them."""
    noise_multiplier: float
    sample_rate: float
    delta: float
    target_epsilon: float | None = None
    history: list[tuple[float, float, int]] = field(default_factory=list)

    def epsilon(self, more_steps: int = 0) -> float:
        """ε at this δ after the steps taken (and `more_steps` more); 0 before any. Never below 0: where δ
        is large (δ > 1/256) and the noise too, the RDP conversion's bound goes negative, which only says
        (0, δ)-DP holds (fedsilo.privacy.accountant.smallest_epsilon)."""
        history = list(self.history) + ([(self.noise_multiplier, self.sample_rate, more_steps)] if more_steps else [])
        if not history:
            return 0.0
        from opacus.accountants.analysis.rdp import get_privacy_spent  # here: Opacus costs ~2.5 s of imports

        # Opacus's RDPAccountant.get_privacy_spent, with each (σ, q)'s per-step RDP computed once: the same
        # floats in the same order (its compute_rdp is the per-step RDP times the steps), so the same ε.
        rdp = sum([rdp_per_step(float(sigma), float(q)) * int(steps) for sigma, q, steps in history])
        with warnings.catch_warnings():  # "optimal order is the smallest alpha": 2, by the choice above
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps, _ = get_privacy_spent(orders=ORDERS, rdp=rdp, delta=self.delta)
            return max(0.0, float(eps))

    def spend(self, steps: int) -> None:
        if not steps:
            return
        step = (self.noise_multiplier, self.sample_rate)
        if self.history and tuple(self.history[-1][:2]) == step:
            self.history[-1] = (*step, int(self.history[-1][2]) + steps)
        else:
            self.history.append((*step, steps))

    @property
    def steps(self) -> int:
        return sum(int(h[2]) for h in self.history)

    def to_meta(self) -> dict:
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "delta": self.delta,
                "target_epsilon": self.target_epsilon, "history": [list(h) for h in self.history]}

    @classmethod
    def from_meta(cls, meta: Mapping) -> "Budget":
        return cls(float(meta["noise_multiplier"]), float(meta["sample_rate"]), float(meta["delta"]),
                   meta.get("target_epsilon"), [(float(s), float(q), int(n)) for s, q, n in meta["history"]])

    def record(self) -> dict:
        """What rounds.jsonl and the server see: ε so far and how it was reached."""
        return {"epsilon": self.epsilon(), "delta": self.delta, "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "steps": self.steps,
                **({"target_epsilon": self.target_epsilon} if self.target_epsilon is not None else {})}


@functools.lru_cache(maxsize=4096)
def rdp_per_step(noise_multiplier: float, sample_rate: float):
    """The RDP of one step of the subsampled Gaussian mechanism at each of ORDERS (Opacus's exact closed
    form), kept per (σ, q), read-only: a silo's history repeats them every round, and the search for σ over
    a ledger's history recomputes the history at each trial σ. Computing it is ~33,000 Python log-adds."""
    from opacus.accountants.analysis.rdp import compute_rdp
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=ORDERS)
    rdp.flags.writeable = False
    return rdp


def smallest_epsilon(delta: float) -> float:
    """The least ε this accountant can reach at δ, whatever the noise: the limit of the RDP → (ε, δ)
    conversion (Balle et al. 2020, Thm 21, Opacus's) as the RDP of every order goes to 0, over ORDERS;
    never below 0. A target at or below it cannot be met by any σ, so it is refused, not searched for."""
    return max(0.0, min(-(math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a) for a in ORDERS))


def unreachable(target_epsilon: float, delta: float) -> str | None:
    """Why `target_epsilon` cannot be reached at δ (naming the smallest ε that can), or None."""
    floor = smallest_epsilon(delta)
    if target_epsilon > floor:
        return None
    return (f"target_epsilon = {target_epsilon:g} cannot be reached at δ = {delta:.3g}: even unbounded noise leaves "
            f"ε = {floor:.4g} (the accountant's Rényi orders {ORDERS[0]}-{ORDERS[-1]}); set target_epsilon above "
            f"{floor:.4g}, or a larger delta")


def noise_for(target_epsilon: float, delta: float, sample_rate: float, steps: int,
              spent: list[tuple[float, float, int]] | tuple = ()) -> float:
    """The smallest σ (within 0.01 below the target) whose ε after `steps` steps at rate q, on top of the
    steps already `spent` (a silo's privacy ledger: earlier runs on the same data), stays within
    `target_epsilon`, over the same orders as `Budget`. Nothing spent: Opacus's own search. Where even
    σ = 10⁴ cannot fit the steps under what is left, that σ (the round check then refuses). A target no σ
    reaches (`unreachable`) is a ConfigError naming the smallest reachable ε."""
    why = unreachable(target_epsilon, delta)
    if why is not None:
        raise ConfigError(why)
    if not spent:
        from opacus.accountants.utils import get_noise_multiplier

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            try:
                return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                                  sample_rate=sample_rate, steps=steps, accountant="rdp",
                                                  epsilon_tolerance=0.01, alphas=ORDERS))
            except ValueError:  # "The privacy budget is too low": σ would pass Opacus's 10⁶
                raise ConfigError(f"target_epsilon = {target_epsilon:g} at δ = {delta:.3g} over {steps} steps "
                                  f"needs σ > 10⁶ (the smallest reachable ε is {smallest_epsilon(delta):.4g}); "
                                  "set a larger target_epsilon") from None

    def eps(sigma: float) -> float:
        return Budget(sigma, sample_rate, delta, history=list(spent)).epsilon(steps)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return hi
    for _ in range(60):  # ε falls as σ grows: bisect until ε(hi) is within 0.01 below the target
        if target_epsilon - eps(hi) <= 0.01:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi
