"""Run configuration: TOML → validated pydantic models. Unknown keys and impossible values fail
with one message that names them.

Every policy axis is a registry (fedsilo.registry); its config field is checked against the registry
when the config is validated, so a policy registered by the user before the run is a valid choice.
The `[task]` section is validated by the settings class of the task it names.
"""
from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, ValidationInfo,
                      create_model, field_validator, model_validator)

from fedsilo.client import pseudo as _pseudo  # noqa: F401  (registers the pseudo_labels hook)
from fedsilo.client.batching import BATCH_ORDERS
from fedsilo.client.hooks import ROUND_HOOKS
from fedsilo.client.objective import CLIENT_OBJECTIVES, REGULARIZERS
from fedsilo.client.optim import CLIENT_OPTIMIZERS
from fedsilo.client.schedule import LR_SCHEDULES, Span
from fedsilo.core.aggregate import AGGREGATIONS, ROBUST_MIN_CLIENTS
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS
from fedsilo.core.server_opt import SERVER_OPTIMIZERS
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.models import MODEL_KINDS, SURGERIES
from fedsilo.registry import Registry
from fedsilo.tasks import TASKS, TaskSettings


class ConfigError(ValueError):
    """A config the user wrote cannot be run; the message names the culprit."""


def choice(registry: Registry) -> Any:
    """A str field whose value must name an entry of `registry` (checked at validation time)."""
    return Annotated[str, AfterValidator(registry.check)]


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Limit = FiniteFloat | Literal["off"]  # a safeguard's limit, or "off"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SurgeryConfig(Strict):
    """`[model.surgery]`: a registered model surgery and its options (validated by the surgery)."""
    name: choice(SURGERIES)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _options(self) -> "SurgeryConfig":
        settings = SURGERIES.entry(self.name).settings
        if settings is not None:
            try:
                settings.model_validate(self.options)
            except ValidationError as err:  # name the option as the user wrote it
                raise _TaskSectionError(_where_what(err, prefix="model.surgery.options")) from None
        elif self.options:
            raise ValueError(f"surgery {self.name!r} takes no options")
        return self

    def settings(self):
        cls = SURGERIES.entry(self.name).settings
        return cls.model_validate(self.options) if cls is not None else None


class ModelConfig(Strict):
    kind: choice(MODEL_KINDS) | None = Field(None, description="seq2seq | encoder; default: the task's")
    name: str | None = Field(None, description="a built-in model name or a local HF checkpoint folder; "
                                               "default: the task's")
    # Upper bounds above any published model's (GPT-3: 12288, T5-11B d_ff 65536): beyond them a value is
    # a typo, and torch overflows or the machine runs out of memory.
    d_model: int = Field(128, gt=0, le=2**14)
    d_ff: int = Field(256, gt=0, le=2**18)
    num_layers: int = Field(2, gt=0, le=1024)
    num_decoder_layers: int = Field(2, gt=0, le=1024)
    num_heads: int = Field(4, gt=0, le=1024)
    dropout: float = Field(0.1, ge=0, lt=1)
    device: str = Field("auto", description="auto: cuda when available, else cpu; or any torch device")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="client training and evaluation under autocast (bf16, or fp16 with a grad scaler); "
                            "weights, server aggregation and the server optimiser stay fp32")
    tf32: bool = Field(True, description="TF32 matmuls on CUDA (Ampere or newer): fp32 weights, faster matmuls")
    surgery: SurgeryConfig | None = None
    init_from: str | None = Field(None, description="start from this run directory's best.pt (the global "
                                                    "model) or a checkpoint file, e.g. a generic engine")

    @model_validator(mode="after")
    def _surgery_fits_model(self) -> "ModelConfig":
        # A surgery may refuse a model by kind and name before it is built (patches: no seq2seq model).
        check = getattr(SURGERIES.entry(self.surgery.name).settings, "check_model", None) if self.surgery else None
        if check is not None:
            try:
                check(self.kind, self.name)
            except ValueError as err:
                raise _TaskSectionError(f"model.surgery: {err}") from None
        return self


class PersonalConfig(Strict):
    """Ditto (Li et al. 2021): a personal model v per client, trained after the federated update on
    the same data with λ/2·‖v − w_global‖² added."""
    coef: FiniteFloat = Field(0.1, ge=0, description="λ of the personal regulariser")
    epochs: int = Field(1, gt=0, description="passes over the client's data per round")
    lr: FiniteFloat | None = Field(None, gt=0, description="None: client.lr")


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
                           "steps done (warm-up once, decay to 0 by the last round); round: restart each round. "
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
    pseudo_source: Literal["global", "own"] = Field("global", description="which model a hook labels with")
    objective: choice(CLIENT_OBJECTIVES) = Field(
        "task", description="task: the task's loss terms; meta_weighting: pseudo examples weighted by a "
                            "meta-gradient on the annotated batch (Ren et al. 2018)")
    personal: PersonalConfig | None = Field(
        None, description="Ditto: after its federated update, the client trains a personal model of its own, "
                          "regularised toward the received global model; evaluation uses it")
    persist_optimizer: bool | None = Field(
        None, description="keep optimiser state across rounds; None: yes unless federated")

    @field_validator("warmup")
    @classmethod
    def _warmup_fraction(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"must be a fraction of the schedule's steps in [0, 1), e.g. 0.1; got {v}")
        return v

    @model_validator(mode="after")
    def _warmup_needs_schedule(self) -> "ClientConfig":
        if self.warmup and self.lr_schedule == "constant":  # it would silently change nothing
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
        settings = ROUND_HOOKS.entry(self.before_training).settings if self.before_training else None
        if settings is not None:
            settings.model_validate(self.hook_options)
        elif self.hook_options:
            raise ValueError(f"hook_options: the round hook {self.before_training!r} takes no options"
                             if self.before_training else "hook_options: set, but there is no before_training hook")
        return self

    def hook_settings(self):
        """The validated options of the round hook (None: it has no settings class)."""
        settings = ROUND_HOOKS.entry(self.before_training).settings if self.before_training else None
        return settings.model_validate(self.hook_options) if settings is not None else None


# Every [client] key may be overridden per silo: the override model is derived, never hand-kept.
ClientOverride = create_model(
    "ClientOverride", __base__=Strict,
    **{name: (f.annotation | None, None) for name, f in ClientConfig.model_fields.items()},
)


class FederationConfig(Strict):
    rounds: int = Field(3, gt=0, strict=True)
    sample_fraction: float = Field(1.0, gt=0, le=1)
    sample_count: int | None = Field(None, gt=0)
    weighting: choice(WEIGHTINGS) = "size"
    weighting_stat: str | None = Field(
        None, description="the client statistic the policy reads (delta_loss, mean_loss, loss/<term>, "
                          "metric/<name>); None: the policy's default")
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

    @model_validator(mode="after")
    def _aggregation(self) -> "FederationConfig":
        entry = AGGREGATIONS.entry(self.aggregation)
        if entry.settings is not None:
            entry.settings.model_validate(self.aggregation_options)
        elif self.aggregation_options:
            raise ValueError(f"aggregation {self.aggregation!r} takes no options")
        if not entry.value.weighted and (self.weighting != "size" or self.weighting_stat or self.max_client_weight):
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
    bias_correction: Literal["none", "adam", "flower"] = Field(
        "none", description="Adam's step size: none (Reddi et al.), adam (Kingma & Ba: t = server step), "
                            "flower (Flower 1.41's FedAdam: t = round + 1)")

    @property
    def effective_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1.0 if self.optimizer in ("fedavg", "sgdm") else 0.01


class ExchangeConfig(Strict):
    shared: list[str] = Field(default_factory=lambda: ["*"])
    private: list[str] = Field(default_factory=list)
    upload: choice(SELECTORS) = Field("all", description="per-round upload policy (a registered selector)")
    upload_options: dict[str, Any] = Field(default_factory=dict)
    download: choice(DOWNLOADS) = Field("all", description="what the server sends each client")
    overwrite: choice(OVERWRITES) = Field("received", description="which received tensors a client takes")

    @model_validator(mode="after")
    def _options(self) -> "ExchangeConfig":
        settings = SELECTORS.entry(self.upload).settings
        if settings is not None:
            try:
                settings.model_validate(self.upload_options)
            except ValidationError as err:  # named in full: exchange.upload_options.<key>
                raise _TaskSectionError(_where_what(err, prefix="exchange.upload_options")) from None
        elif self.upload_options:
            raise _TaskSectionError(f"exchange.upload_options: selector {self.upload!r} takes no options")
        return self


class EngineConfig(Strict):
    store: Literal["disk", "memory"] = Field(
        "disk", description="where clients keep state between rounds: disk (safetensors in the run "
                            "directory, RAM stays one model) or memory")
    workers: int | Literal["auto"] = Field(
        "auto", description="worker processes training a round's clients at once, each with its own working "
                            "model and a share of the threads; 1: one after another in this process; auto: "
                            "one per CPU core (at most 4), or one per GPU; may change on resume (results equal "
                            "across worker counts at equal threads per client)")
    threads: int | Literal["auto"] = Field(
        "auto", description="CPU threads torch uses for training and evaluation, in all: one process uses them "
                            "all, each of `workers` worker processes gets threads // workers (at least 1); "
                            "auto: torch's own choice, the cores this process may use (OMP_NUM_THREADS if set)")
    token_cache: bool = Field(True, description="keep each silo's tokenised examples on disk ($FEDSILO_CACHE_DIR, "
                                                "else ~/.cache/fedsilo), keyed by tokenizer, settings and text")

    @field_validator("workers", "threads", mode="before")  # before: pydantic would take true, 1.0, "2" as counts
    @classmethod
    def _positive_count(cls, v: Any, info: ValidationInfo) -> int | str:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"engine.{info.field_name} must be a positive count or \"auto\", got {_fmt(v)}")
        return v


class FlowerConfig(Strict):
    """Only for the Flower engines; the in-process engine ignores it."""
    connect_timeout: float = Field(300.0, gt=0, description="seconds to wait for every silo's SuperNode")
    round_timeout: float | None = Field(None, gt=0, description="seconds to wait for replies (None: forever)")
    retries: int = Field(0, ge=0, description="re-sends to silos that did not answer within a round")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per ClientApp in simulation")


class RunConfig(Strict):
    plugins: list[str] = Field(default_factory=list, description="modules imported before the config is "
                               "validated: they register the user's own tasks, policies, hooks")
    name: str = "run"
    seed: int = Field(0, ge=0, lt=2**63)
    paradigm: Literal["federated", "finetune", "centralized"] = "federated"
    out_dir: str = "runs"
    task: SerializeAsAny[TaskSettings] = Field(default_factory=lambda: task_settings({}))
    model: ModelConfig = ModelConfig()
    client: ClientConfig = ClientConfig()
    clients: dict[str, ClientOverride] = Field(default_factory=dict)
    federation: FederationConfig = FederationConfig()
    server: ServerConfig = ServerConfig()
    exchange: ExchangeConfig = ExchangeConfig()
    engine: EngineConfig = EngineConfig()
    flower: FlowerConfig = FlowerConfig()

    @field_validator("task", mode="before")
    @classmethod
    def _task_section(cls, v: Any) -> TaskSettings:
        return v if isinstance(v, TaskSettings) else task_settings(v)

    @model_validator(mode="after")
    def _overrides_name_clients(self) -> "RunConfig":
        # Overrides may name silos left out of this run (one file, several subsets), not unknown ones.
        unknown = sorted(set(self.clients) - set(self.task.known_clients()))
        if unknown:
            raise ValueError(f"[clients.{unknown[0]}] names no {self.task.name} client")
        return self

    @model_validator(mode="after")
    def _overrides_valid(self) -> "RunConfig":
        # The override model keeps the types, not the bounds or checks: validate each silo's merged section.
        for name, override in self.clients.items():
            try:
                ClientConfig.model_validate({**self.client.model_dump(), **override.model_dump(exclude_none=True)})
            except ValidationError as err:
                raise _TaskSectionError(_where_what(err, prefix=f"clients.{name}")) from None
        return self

    @model_validator(mode="after")
    def _robust_rule_has_clients(self) -> "RunConfig":
        # The median of 2 is their mean and a trimmed mean of 2 trims nothing: refuse, do not pretend.
        f = self.federation
        if self.paradigm != "federated" or AGGREGATIONS.get(f.aggregation).weighted:
            return self
        silos = len(self.task.client_names())
        per_round = min(silos, f.sample_count or max(1, round(f.sample_fraction * silos)))
        if per_round < ROBUST_MIN_CLIENTS:
            raise ValueError(f"federation.aggregation = {f.aggregation!r} cannot be robust with {per_round} "
                             f"client(s) per round (it needs at least {ROBUST_MIN_CLIENTS}: the median of two is "
                             "their mean); use more silos, or aggregation = \"mean\" with the update and weight "
                             "limits (max_update_ratio, max_weight_ratio)")
        return self

    @model_validator(mode="after")
    def _private_lr_has_tensors(self) -> "RunConfig":
        # A rate for kept tensors when nothing is kept would silently change nothing.
        rates = [self.client.private_lr, *(o.private_lr for o in self.clients.values())]
        if any(r is not None for r in rates) and not (self.paradigm == "federated" and self.exchange.private):
            raise ValueError("client.private_lr: set for the tensors a client keeps, but this run keeps none "
                             "(it needs paradigm = \"federated\" and exchange.private patterns)")
        return self

    @property
    def persist_optimizer(self) -> bool:
        if self.client.persist_optimizer is not None:
            return self.client.persist_optimizer
        return self.paradigm != "federated"

    def client_config(self, client: str) -> ClientConfig:
        override = self.clients.get(client)
        if override is None:
            return self.client
        return self.client.model_copy(update=override.model_dump(exclude_none=True))


class _TaskSectionError(ValueError):
    """Raised inside validation; carries the inner location so the message names `task.<key>` (or
    `clients.<silo>.<key>`)."""


def task_settings(raw: Any) -> TaskSettings:
    if not isinstance(raw, dict):
        raise ValueError("must be a table, e.g. [task] name = \"text2sql\"")
    name = raw.get("name", "text2sql")
    if name not in TASKS:
        raise _TaskSectionError(f"task.name: {name!r} is not a choice: {', '.join(map(repr, TASKS))}")
    try:
        return TASKS.entry(name).settings.model_validate({**raw, "name": name})
    except ValidationError as err:
        raise _TaskSectionError(_where_what(err, prefix="task")) from None


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def apply_overrides(raw: dict, assignments: list[str]) -> dict:
    """`--set a.b=value`: the value is read as TOML (numbers, booleans, lists), else as a string."""
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. federation.rounds=5")
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = _parse_value(value.strip())
    return raw


def _describe(err: ValidationError, source: str) -> str:
    return f"{source}: {_where_what(err)}"


def _where_what(err: ValidationError, prefix: str = "") -> str:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    msg = first["msg"]
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _TaskSectionError):  # already names task.<key>
        return str(ctx_err)
    where = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "literal_error":
        msg = f"{first['input']!r} is not a choice: {msg[len('Input should be '):]}"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {msg}{more}"


def import_plugins(raw: dict, source: str) -> None:
    """Import `plugins` (module names) so that what they register is a valid choice."""
    import importlib

    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{source}: plugins: expected a list of module names")
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"{source}: plugins: cannot import {module!r}: {err}") from None


def validate(raw: dict, source: str = "config") -> RunConfig:
    import_plugins(raw, source)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None
    except _TaskSectionError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_config(path: str | Path, assignments: list[str] = ()) -> RunConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a config file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (TOML) file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None
    return validate(apply_overrides(raw, list(assignments)), str(path))


def to_toml(cfg: RunConfig) -> str:
    """The resolved config, as TOML, for the run directory (None values are left out)."""
    return _dump(cfg.model_dump(exclude_none=True))


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_fmt(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _fmt(k)


# Sections whose values are free-form tables (written inline, not as [sub.sections]).
_INLINE = {"regularizers", "upload_options", "options", "hook_options"}


def _dump(d: dict, prefix: str = "") -> str:
    scalars = [f"{_key(k)} = {_fmt(v)}" for k, v in d.items() if not isinstance(v, dict) or k in _INLINE]
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for k, v in d.items():
        if isinstance(v, dict) and k not in _INLINE:
            name = f"{prefix}{_key(k)}"
            body = _dump(v, name + ".")
            if any(not isinstance(x, dict) or kk in _INLINE for kk, x in v.items()) or not v:
                out += f"\n[{name}]\n"
            out += body
    return out
