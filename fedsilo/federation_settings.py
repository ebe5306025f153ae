"""The federation's sections of a run's config, beside the policies they choose: `[federation]` (weighting,
aggregation, safeguards), `[server]` (the server optimiser) and `[exchange]` (what crosses the wire).
What a choice needs from the rest of the run is checked on the built recipe (fedsilo.features).

It lives above fedsilo.core and fedsilo.privacy, not in core: `[federation]` holds the privacy sections,
and core imports nothing from the layers above it (tests/test_layers.py)."""
from __future__ import annotations

import math
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from fedsilo.core.aggregate import AGGREGATIONS
from fedsilo.core.compression import DOWNLOAD_CODECS
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS
from fedsilo.core.messages import STATISTICS, is_statistic
from fedsilo.core.server_opt import BIAS_CORRECTIONS, SERVER_OPTIMIZERS, unread_correction, unread_hyperparameters
from fedsilo.core.transforms import UPLOAD_TRANSFORMS
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.privacy.settings import SecureAggregationConfig, SiloDPConfig
from fedsilo.settings import FiniteFloat, Limit, SectionError, Strict, choice


class FederationConfig(Strict):
    rounds: int = Field(3, gt=0, strict=True)
    sample_fraction: float = Field(1.0, gt=0, le=1)
    sample_count: int | None = Field(None, gt=0)
    weighting: choice(WEIGHTINGS) = "size"
    weighting_stat: str | None = Field(
        None, description="the client statistic the policy reads (delta_loss, mean_loss, loss/<term>); "
                          "None: the policy's default")
    eval_every: int = Field(1, gt=0)
    aggregation: choice(AGGREGATIONS) = Field(
        "mean", description="mean (weighted by the weighting policy), median or trimmed_mean (robust, "
                            "unweighted: Yin et al. 2018)")
    aggregation_options: dict[str, Any] = Field(default_factory=dict, description="e.g. {trim = 0.2}")
    clip_norm: FiniteFloat | None = Field(None, gt=0, description="clip each client's update to this L2 norm")
    max_client_weight: float | None = Field(
        None, gt=0, le=1, description="cap on any client's weight p_i; the excess goes to the others")
    max_weight_ratio: Limit = Field(
        10.0, description="no client's weight above this many times the median of the others' weights (sizes "
                          "and statistics are self-reported); \"off\": the weighting policy's weights as they are")
    max_update_ratio: Limit = Field(
        100.0, description="reject a client update whose RMS exceeds this many times the median RMS of the other "
                           "updates in the same round (\"off\": no limit)")
    max_step_ratio: Limit = Field(
        1000.0, description="skip a server step longer than this many times the global tensors' norm "
                            "(\"off\": no limit)")
    max_failed_rounds: int = Field(
        3, gt=0, strict=True, description="stop the run after this many rounds in a row applied no update")
    silo_dp: SiloDPConfig | None = Field(
        None, description="silo-level differential privacy: clipped updates, Gaussian noise, an accountant on the "
                          "server (docs/privacy.md)")
    secure_aggregation: SecureAggregationConfig | None = Field(
        None, description="mask each silo's weighted update so the server learns only their sum (docs/privacy.md)")

    @field_validator("max_weight_ratio", "max_update_ratio", "max_step_ratio", mode="before")
    @classmethod
    def _limit(cls, v: object, info: ValidationInfo) -> object:
        if v is None:  # TOML cannot write None, and config.toml leaves None out: "off" survives a resume
            return "off"
        step = info.field_name == "max_step_ratio"  # a peer ratio below 1 would reject everyone
        if isinstance(v, bool) or (isinstance(v, (int, float)) and not (
                math.isfinite(v) and (v > 0 if step else v >= 1))):
            raise ValueError(f"federation.{info.field_name} must be a finite number {'> 0' if step else '≥ 1'}, "
                             "or \"off\"")
        return v

    @field_validator("weighting_stat")
    @classmethod
    def _statistic(cls, v: str | None) -> str | None:
        if v is not None and not is_statistic(v):
            raise ValueError(f"{v!r} is not a statistic clients report: {', '.join(STATISTICS)}")
        return v

    @model_validator(mode="after")
    def _one_sample_size(self) -> "FederationConfig":
        # sample_clients takes sample_count when it is set: a fraction beside it would change nothing.
        if self.sample_count is not None and self.sample_fraction != 1.0:
            raise SectionError(f"federation.sample_fraction = {self.sample_fraction}: not read, "
                               f"federation.sample_count = {self.sample_count} is set and says how many clients "
                               "train each round; set one")
        return self

    @model_validator(mode="after")
    def _aggregation(self) -> "FederationConfig":
        AGGREGATIONS.resolve(self.aggregation, self.aggregation_options, "federation.aggregation_options")
        unweighted = not AGGREGATIONS.get(self.aggregation).weighted
        if unweighted and (self.weighting != type(self).model_fields["weighting"].default or self.weighting_stat
                           or self.max_client_weight):
            raise ValueError(f"aggregation {self.aggregation!r} counts every client once: "
                             "federation.weighting / weighting_stat / max_client_weight do not apply")
        return self


class ServerConfig(Strict):
    optimizer: choice(SERVER_OPTIMIZERS) = "fedavg"
    lr: FiniteFloat | None = Field(None, gt=0, description="default 1.0 for fedavg/sgdm, 0.01 for adaptive")
    momentum: float = Field(0.9, ge=0, lt=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: FiniteFloat = Field(1e-3, gt=0)
    v0: FiniteFloat | None = Field(None, ge=0, description="initial second moment; None: tau² (Reddi et al.)")
    bias_correction: choice(BIAS_CORRECTIONS) = Field(
        "none", description="Adam's step size: none (Reddi et al.), adam (Kingma & Ba: t = server step), "
                            "flower (Flower 1.41's FedAdam: t = round + 1)")

    @model_validator(mode="after")
    def _correction_is_read(self) -> "ServerConfig":
        # A correction the optimiser never reads would silently change nothing.
        unread = unread_correction(self.optimizer, self.bias_correction)
        if unread:
            raise ValueError(unread)
        return self

    @model_validator(mode="after")
    def _hyperparameters_are_read(self) -> "ServerConfig":
        # e.g. momentum for fedavg or adam, beta2 for adagrad: a value there would silently change nothing.
        for key in unread_hyperparameters(self.optimizer):
            value = getattr(self, key)
            if value != type(self).model_fields[key].default:
                raise SectionError(f"server.{key} = {value}: the {self.optimizer!r} server optimizer does not read it "
                                   f"(see docs/server-optimizers.md); remove it or choose an optimizer that does")
        return self

    @property
    def effective_lr(self) -> float:
        """The configured lr, else the optimiser's own default (1.0 for fedavg/sgdm, 0.01 adaptive)."""
        return self.lr if self.lr is not None else SERVER_OPTIMIZERS.get(self.optimizer).default_lr


class ExchangeConfig(Strict):
    shared: list[str] = Field(default_factory=lambda: ["*"])
    private: list[str] = Field(default_factory=list)
    upload: choice(SELECTORS) = Field("all", description="per-round upload policy (a registered selector)")
    upload_options: dict[str, Any] = Field(default_factory=dict)
    download: choice(DOWNLOADS) = Field("all", description="what the server sends each client")
    overwrite: choice(OVERWRITES) = Field("received", description="which received tensors a client takes")
    upload_transforms: list[dict[str, Any]] = Field(
        default_factory=list, description="what a client's upload goes through before it leaves the silo, in "
                                          "order, e.g. [{name = \"clip\", max_norm = 1.0}] (fedsilo.core.transforms)")
    download_transforms: list[dict[str, Any]] = Field(
        default_factory=list, description="how the server's values are coded on the way down: at most one codec, "
                                          "e.g. [{name = \"fp16\"}] (fedsilo.core.compression)")

    @model_validator(mode="after")
    def _options(self) -> "ExchangeConfig":
        # each option validated here; what the chain needs from the rest: fedsilo.features.codecs
        SELECTORS.resolve(self.upload, self.upload_options, "exchange.upload_options")
        UPLOAD_TRANSFORMS.resolve_chain(self.upload_transforms, "exchange.upload_transforms")
        DOWNLOAD_CODECS.resolve_chain(self.download_transforms, "exchange.download_transforms")
        return self
