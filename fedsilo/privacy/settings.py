"""The privacy sections of a run's config, beside the mechanisms they set: `[federation.secure_aggregation]`
(fedsilo.privacy.secagg) and `[federation.silo_dp]` (fedsilo.privacy.silo_dp)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedsilo.settings import FiniteFloat, Strict


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
        return self
