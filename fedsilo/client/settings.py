"""`[client]`: how a silo trains each round (the client layer's own settings; fedsilo.config
composes them into the run's config, with per-silo overrides)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedsilo.core.transforms import SILO_CHECKS
from fedsilo.privacy.accountant import unreachable
from fedsilo.settings import FiniteFloat, SectionError, Strict, choice

from .batching import BATCH_ORDERS
from .hooks import AFTER_TRAINING, PSEUDO_SOURCES, ROUND_HOOKS
from .objective import CLIENT_OBJECTIVES, REGULARIZERS, TASK_LOSS
from .optim import CLIENT_OPTIMIZERS
from .schedule import LR_SCHEDULES, Span, constant


class PersonalConfig(Strict):
    """Ditto (Li et al. 2021): a personal model v per client, trained after the federated update on
    the same data with λ/2·‖v − w_global‖² added."""
    coef: FiniteFloat = Field(0.1, ge=0, description="λ of the personal regulariser")
    epochs: int = Field(1, gt=0, description="passes over the client's data per round")
    lr: FiniteFloat | None = Field(None, gt=0, description="None: client.lr")


class DPSettings(Strict):
    """`[client.dp]` (or `[clients.<silo>.dp]`): DP-SGD for this silo's local training."""
    target_epsilon: FiniteFloat | None = Field(
        None, gt=0, description="the silo's ε over all its rounds: σ is chosen so that federation.rounds rounds "
                                "end at most here, and a round that would pass it is refused")
    noise_multiplier: FiniteFloat | None = Field(
        None, gt=0, description="σ (noise std / C) instead of deriving it from target_epsilon; with both, "
                                "target_epsilon is only the cap")
    delta: FiniteFloat | None = Field(None, gt=0, lt=1, description="δ; None: the δ the silo's data already spends "
                                                                     "its budget at (its ledger's first release), "
                                                                     "else 1/(10·n) for a silo of n examples")
    max_grad_norm: FiniteFloat = Field(1.0, gt=0, description="C: each example's gradient is clipped to it")
    clipping: Literal["auto", "ghost", "per_example", "loop"] = Field(
        "auto", description="ghost: per-example norms without per-example gradients (memory as plain training); "
                            "per_example: Opacus's per-example gradients; loop: one forward and backward per example "
                            "(any model, slower); auto: ghost unless the model ties parameters, else per_example, "
                            "and loop for a model Opacus's batched rules cannot take")
    noise: Literal["secret", "seeded"] = Field(
        "secret", description="secret: noise from a cryptographically secure generator (AES-CTR keyed by os.urandom), "
                              "sampling seeded from os.urandom (what the guarantee assumes); seeded: "
                              "from the run seed, to reproduce numbers exactly. Anyone who knows the seed can "
                              "remove the noise")

    @property
    def falls_back(self) -> bool:
        """`clipping = "auto"`: batched per-example gradients, one example at a time where Opacus cannot."""
        return self.clipping == "auto"

    @property
    def seeded(self) -> bool:
        """Whether whoever knows the run seed can remove the noise (a silo policy's require_dp refuses it)."""
        return self.noise == "seeded"

    @model_validator(mode="after")
    def _one_of(self) -> "DPSettings":
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ValueError("set target_epsilon (σ is derived from it) or noise_multiplier")
        why = unreachable(self.target_epsilon, self.delta) if None not in (self.target_epsilon, self.delta) else None
        if why is not None:  # with δ unset (1/(10·n)) the silo's trainer refuses it, naming the silo
            raise ValueError(why)
        return self


class ClientConfig(Strict):
    epochs: int = Field(1, gt=0)
    steps: int | None = Field(None, gt=0, description="optimiser steps per round, passes over the data "
                                                      "repeated as needed (the paper's 10K-step rounds); "
                                                      "None: `epochs` full passes")
    lr: FiniteFloat = Field(1e-3, gt=0)
    private_lr: FiniteFloat | None = Field(
        None, gt=0, description="learning rate of the tensors the client keeps (exchange.private: FedMatch's "
                                "patches, FedPer's head); None: `lr`")
    lr_schedule: choice(LR_SCHEDULES) = Field(
        "constant", description="constant, linear (warm-up, then linear decay to 0: Hugging Face's "
                                "get_linear_schedule_with_warmup) or cosine (warm-up, then cosine decay to 0); "
                                "it scales each group's rate (private_lr too), per optimiser step")
    warmup: FiniteFloat = Field(0.0, description="warm-up, a fraction of the schedule's steps in [0, 1) "
                                                 "(the Trainer's warmup_ratio: ceil(fraction × steps))")
    # `run` by default: a paper's "warm up, then decay over training" is over all of training, which a
    # federation splits into rounds; restarting per round would re-warm and re-decay every round.
    schedule_span: Span = Field(
        "run", description="run: one schedule over the client's rounds × its steps per round, at its own "
                           "steps done (warm-up once, decay to 0 by the last round); round: restart each round; "
                           "server_rounds: one schedule over the run's rounds at the server's round (FlowerTune's "
                           "cosine over rounds, whichever rounds a sampled client trains in). "
                           "A personal model (Ditto) restarts its schedule every round")
    batch_size: int = Field(8, gt=0)
    grad_accum: int = Field(1, gt=0, lt=2**63, description="batches per optimiser step (the Lorar authors: 16)")
    optimizer: choice(CLIENT_OPTIMIZERS) = "adafactor"
    weight_decay: FiniteFloat = Field(0.0, ge=0)
    logging_steps: int = Field(4, gt=0, description="ΔL windows, in optimiser steps")
    batching: choice(BATCH_ORDERS) = Field(
        "length_grouped", description="batch order: length_grouped (similar lengths batched together inside "
                                      "shuffled windows: less padding) or shuffle (a plain random permutation, "
                                      "the Hugging Face Trainer's sampler)")
    length_window: int | None = Field(None, gt=0, description="batches per length-sorted window; None: the "
                                                              "Trainer's rule, n/(4·batch_size) capped at 50")
    max_grad_norm: FiniteFloat = Field(1.0, ge=0, description="0 disables clipping")
    regularizers: dict[str, FiniteFloat] = Field(
        default_factory=dict, description="name → coefficient, e.g. {prox = 1e-4} (FedProx μ)")
    tracked_terms: list[str] | None = Field(
        None, description="objective terms summed into the logged loss (ΔL, mean loss); None: all")
    before_training: choice(ROUND_HOOKS) | None = Field(None, description="a round hook run before local training")
    hook_options: dict[str, Any] = Field(default_factory=dict, description="the hook's settings, e.g. "
                                         "{weighting = \"energy\", top_k = 7} for pseudo_labels")
    pseudo_source: choice(PSEUDO_SOURCES) = Field(
        "global", description="which model a hook labels with: global (received) or own (its last own model)")
    objective: choice(CLIENT_OBJECTIVES) = Field(
        "task", description="task: the task's loss terms; meta_weighting: pseudo examples weighted by a "
                            "meta-gradient on the annotated batch (Ren et al. 2018)")
    personal: PersonalConfig | None = Field(
        None, description="Ditto: after its federated update, the client trains a personal model of its own, "
                          "regularised toward the received global model; evaluation uses it")
    after_training: choice(AFTER_TRAINING) | None = Field(
        None, description="a registered after-training pass other than Ditto's (which `personal` asks for)")
    after_training_options: dict[str, Any] = Field(default_factory=dict, description="that pass's settings")
    upload_checks: list[dict[str, Any]] = Field(
        default_factory=list, description="the silo's own checks of each round's instructions before it trains, e.g. "
                                          "[{name = \"require_clip\", max_norm = 1.0}]: a check that fails refuses the "
                                          "round, and nothing leaves the silo (fedsilo.core.transforms)")
    dp: DPSettings | None = Field(
        None, description="record-level differential privacy: DP-SGD with an accountant per silo "
                          "(fedsilo.client.private, docs/privacy.md)")
    persist_optimizer: bool | None = Field(
        None, description="keep optimiser state across rounds; None: yes unless federated")

    def after_pass(self) -> tuple[str, Any] | None:
        """(name, options) of the after-training pass this section asks for, if any: `personal` is
        Ditto's (fedsilo.client.ditto) with its own table; any other is `after_training`."""
        if self.personal is not None:
            return "ditto", self.personal
        return (self.after_training, self.after_training_options) if self.after_training else None

    @field_validator("warmup")
    @classmethod
    def _warmup_fraction(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"must be a fraction of the schedule's steps in [0, 1), e.g. 0.1; got {v}")
        return v

    @model_validator(mode="after")
    def _warmup_needs_schedule(self) -> "ClientConfig":
        if self.warmup and LR_SCHEDULES.get(self.lr_schedule) is constant:  # it would silently change nothing
            raise ValueError("warmup: set, but lr_schedule = \"constant\" has no warm-up "
                             "(choose lr_schedule = \"linear\" or \"cosine\")")
        return self

    @field_validator("regularizers")
    @classmethod
    def _known_regularizers(cls, v: dict[str, float]) -> dict[str, float]:
        for name, coef in v.items():
            REGULARIZERS.check(name)
            if coef < 0:
                raise ValueError(f"regularizer {name!r}: coefficient must be ≥ 0")
        return v

    @model_validator(mode="after")
    def _hook_options(self) -> "ClientConfig":
        if not self.before_training:
            if self.hook_options:
                raise ValueError("hook_options: set, but there is no before_training hook")
            return self
        try:
            ROUND_HOOKS.resolve(self.before_training, self.hook_options, "hook_options")
        except SectionError as err:  # a plain ValueError: the outer validation prefixes client. or clients.<silo>.
            raise ValueError(str(err)) from None
        return self

    @model_validator(mode="after")
    def _after_training_options(self) -> "ClientConfig":
        if self.personal is not None and self.after_training is not None:
            raise ValueError(f"after_training = {self.after_training!r}: a client runs one after-training pass, "
                             "and `personal` already asks for Ditto's")
        if self.after_training_options and not self.after_training:
            raise ValueError("after_training_options: set, but there is no after_training pass")
        if self.after_training:
            try:
                AFTER_TRAINING.resolve(self.after_training, self.after_training_options, "after_training_options")
            except SectionError as err:
                raise ValueError(str(err)) from None
        return self

    @model_validator(mode="after")
    def _dp_covers_training(self) -> "ClientConfig":
        # DP-SGD's accountant covers Poisson samples of the silo's own examples, one step each.
        if self.dp is None:
            return self
        if self.grad_accum > 1:
            raise ValueError(f"dp: DP-SGD takes one Poisson sample per step, grad_accum = {self.grad_accum} is not "
                             "supported; set batch_size to the expected sample size you want")
        if self.before_training:
            raise ValueError(f"dp: the round hook {self.before_training!r} trains on examples it makes from the "
                             "silo's data (pseudo labels), which DP-SGD's accountant does not cover; remove one")
        if CLIENT_OBJECTIVES.get(self.objective) is not TASK_LOSS:
            raise ValueError(f"dp: objective {self.objective!r} weighs examples by a gradient on other examples, "
                             "which per-example clipping does not bound; use objective = \"task\"")
        if self.after_pass() is not None:
            raise ValueError(f"dp: the after-training pass {self.after_pass()[0]!r} (a personal model) trains on the "
                             "silo's records without DP-SGD, and its evaluation statistics leave the silo; remove one")
        return self

    @field_validator("upload_checks")
    @classmethod
    def _checks(cls, v: list) -> list:
        try:
            SILO_CHECKS.resolve_chain(v, "upload_checks")
        except SectionError as err:  # a plain ValueError: the outer validation prefixes client. or clients.<silo>.
            raise ValueError(str(err)) from None
        return v
