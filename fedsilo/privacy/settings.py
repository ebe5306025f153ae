"""The privacy sections of a run's config, beside the mechanisms they set: `[federation.secure_aggregation]`
(fedsilo.privacy.secagg) and `[federation.silo_dp]` (fedsilo.privacy.silo_dp)."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from fedsilo.settings import FiniteFloat, Limit, Strict

from .accountant import unreachable


class SecureAggregationConfig(Strict):
    """`[federation.secure_aggregation]`: the server learns only the round's weighted sum (fedsilo.privacy.secagg)."""
    threshold: int | None = Field(None, ge=2, description="Shamir threshold t: the round needs t silos to finish, "
                                                          "tolerates n − t dropping; None: a majority, n//2 + 1")
    step: FiniteFloat = Field(2.0 ** -32, gt=0, lt=1, description="fixed-point step: each coordinate of the sum is "
                                                                   "exact to (silos) × step / 2")
    roster_fingerprint: str | None = Field(
        None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="the federation roster every silo must hold (`fedsilo keys roster` prints it); a silo whose "
                    "roster differs, or that has none, refuses the round. On Flower only: in-process every silo "
                    "gets fresh keys per round")
    # the server sees only the sum, so no silo's own update can be bounded, only the round's mean update
    # (fedsilo.privacy.secure_stages.SumGuard)
    max_mean_ratio: Limit = Field(
        10.0, description="skip a round whose mean update is longer than this many times the global tensors' norm "
                          "(at least 1) (\"off\": no limit)")
    max_mean_growth: Limit = Field(
        10.0, description="skip a round whose mean update is longer than this many times the median of the applied "
                          "rounds' before it (\"off\": no limit)")

    @field_validator("max_mean_ratio", "max_mean_growth", mode="before")
    @classmethod
    def _limit(cls, v: object, info: ValidationInfo) -> object:
        growth = info.field_name == "max_mean_growth"  # below 1 an unchanged step would be skipped
        if isinstance(v, bool) or (isinstance(v, (int, float)) and not (
                math.isfinite(v) and (v >= 1 if growth else v > 0))):
            raise ValueError(f"must be a finite number {'≥ 1' if growth else '> 0'}, or \"off\"")
        return v


_ADDS_NOISE_ON_SERVER = {"central": True, "distributed": False}


class SiloDPConfig(Strict):
    """`[federation.silo_dp]`: each silo is one user of a DP guarantee on the global model (fedsilo.privacy.silo_dp)."""
    mode: Literal["central", "distributed"] = Field(
        "central", description="central: the server adds the noise to the aggregate; distributed: each silo adds "
                               "its share (with secure aggregation the server sees only the noisy sum)")
    clip: FiniteFloat = Field(gt=0, description="C: every silo's update is clipped to this L2 norm")
    noise_multiplier: FiniteFloat | None = Field(None, gt=0, description="σ; None: derived from target_epsilon")
    target_epsilon: FiniteFloat | None = Field(None, gt=0, description="ε over federation.rounds rounds; a round "
                                                                        "that would pass it ends the run")
    delta: FiniteFloat = Field(1e-5, gt=0, lt=1, description="δ (a few silos: 1/(10·silos) would be far too large)")
    noise: Literal["secret", "seeded"] = Field("secret", description="seeded: reproducible from the run seed, and "
                                                                     "removable by anyone who knows it")

    @property
    def central(self) -> bool:
        """Whether the server adds the noise (the mode's ability, declared here once)."""
        return _ADDS_NOISE_ON_SERVER[self.mode]

    @property
    def seeded(self) -> bool:
        return self.noise == "seeded"

    @model_validator(mode="after")
    def _one_of(self) -> "SiloDPConfig":
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ValueError("set target_epsilon (σ is derived from it) or noise_multiplier")
        why = unreachable(self.target_epsilon, self.delta) if self.target_epsilon is not None else None
        if why is not None:
            raise ValueError(why)
        return self
