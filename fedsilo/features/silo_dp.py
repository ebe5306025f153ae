"""Silo-level DP: the sensitivity w_max·C / W holds for public, fixed weights and one mean over every
shared tensor (fedsilo.privacy.silo_dp)."""
from __future__ import annotations

import math

from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.errors import ConfigError
from fedsilo.privacy.accountant import Budget, noise_for
from fedsilo.privacy.secagg import SecAggSettings
from fedsilo.privacy.silo_dp import SiloDP, SiloDPStage, SiloRelease

from .common import changed_limits


def _accountable(policy, central: bool) -> bool:
    """Central mode: a weight from the registered size alone; distributed: the same weight for every silo
    (each silo's share of the noise is sized for equal weights)."""
    return policy.public_weight is not None and (central or policy.uniform)


def check(recipe) -> str | None:
    cfg = recipe.config
    dp = cfg.federation.silo_dp
    if dp is None:
        return None
    f, x, plan = cfg.federation, cfg.exchange, recipe.plan
    if not cfg.participation.federates:
        return f"federation.silo_dp: paradigm {cfg.paradigm!r} does not federate"
    weighting = recipe.server.weighting.value
    if not _accountable(weighting, dp.central) or f.weighting_stat:
        allowed = [name for name in WEIGHTINGS if _accountable(WEIGHTINGS.get(name), dp.central)]
        why = ("each silo's share of the noise would depend on every other silo's weight"
               if weighting.public_weight is not None and not f.weighting_stat else
               "a weight computed from a silo's data is itself a release no noise covers, and bounds no silo's share "
               "of the aggregate")
        return (f"federation.weighting = {f.weighting!r} cannot be accounted with federation.silo_dp (mode {dp.mode!r}):"
                f" {why}; use weighting = " + " or ".join(f'"{w}"' for w in allowed))
    if not recipe.server.aggregation.value.weighted:
        return f"federation.aggregation = {f.aggregation!r}: silo-level DP is accounted for the mean"
    if plan.download_transforms:
        return ("exchange.download_transforms cannot run with federation.silo_dp: a silo clips its update against the "
                "coded values it received, the server's sensitivity bound is for its own")
    if not plan.upload.value.sends_all or not plan.download.value.sends_all:
        key, value = ("upload", x.upload) if not plan.upload.value.sends_all else ("download", x.download)
        return (f"exchange.{key} = {value!r}: silo-level DP needs every silo to receive and send every shared tensor "
                "(an update clipped against what it received, one denominator for all)")
    return changed_limits(cfg, "federation.silo_dp", "it would change a silo's update or weight by the others', which "
                          "the sensitivity bound does not cover (federation.silo_dp.clip bounds each update)")


def fewest_answers(cfg):
    """n sampled silos -> the fewest answers that still form an aggregate: under secure aggregation its
    threshold t (fewer and no sum is formed, so nothing is released); otherwise 1 (the server applies a round
    from one accepted update)."""
    secure = cfg.federation.secure_aggregation
    if secure is None:
        return lambda n: 1
    settings = SecAggSettings(threshold=secure.threshold, step=secure.step)

    def fewest(n: int) -> int:
        try:
            return settings.threshold_for(n)
        except ValueError:  # too few silos for the protocol: no sum, no release
            return n
    return fewest


def mechanism(cfg) -> SiloDP | None:
    """The federation's silo-level DP: σ given, or derived from the target over federation.rounds — in
    distributed mode sized so that every round fits even when only the fewest silos that still form an
    aggregate answer (σ·√(k/m) is then what each round is accounted with)."""
    dp = cfg.federation.silo_dp
    if dp is None:
        return None
    m, fewest = cfg.silos_per_round, fewest_answers(cfg)
    sigma = dp.noise_multiplier
    if sigma is None:
        worst = 1.0 if dp.central else math.sqrt(m / max(1, min(fewest(m), m)))
        try:
            sigma = noise_for(dp.target_epsilon, dp.delta, 1.0, cfg.federation.rounds) * worst
        except ConfigError as err:
            raise ConfigError(f"federation.silo_dp.{err}") from None
    return SiloDP(dp.central, dp.clip, sigma, Budget(sigma, 1.0, dp.delta, dp.target_epsilon),
                  seed=cfg.seed if dp.seeded else None, shares=m, fewest=fewest)


def server_stage(cfg, weighting) -> SiloDPStage | None:
    """The stage around the server's aggregation (fixed denominator, central noise, the accountant)."""
    dp = mechanism(cfg)
    return SiloDPStage(dp, weighting.value.public_weight) if dp is not None else None


def release(cfg) -> SiloRelease | None:
    """A silo's side: its update clipped, and in distributed mode its share of the noise, σ·C/√m for the m
    silos a round samples (the m the server's accountant divides by)."""
    dp = mechanism(cfg)
    if dp is None:
        return None
    return SiloRelease(dp.clip, 0.0 if dp.central else dp.noise_multiplier * dp.clip / math.sqrt(dp.shares),
                       dp.seed is not None)
