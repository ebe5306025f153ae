"""Run configuration: TOML → validated pydantic models. Unknown keys and impossible values fail
with one message that names them.

Every policy axis is a registry (fedsilo.registry); its config field is checked against the registry
when the config is validated, so a policy registered by the user before the run is a valid choice.
The `[task]` section is validated by the settings class of the task it names.
"""
from __future__ import annotations

import math
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import SerializeAsAny, ValidationError, ValidationInfo, create_model, field_validator, model_validator
from pydantic import Field

from fedsilo import builtins  # noqa: F401  (fills every registry a config names from)
from fedsilo.client.batching import BATCH_ORDERS, shuffled
from fedsilo.client.schedule import LR_SCHEDULES, constant
from fedsilo.client.settings import ClientConfig
from fedsilo.core.aggregate import AGGREGATIONS
from fedsilo.core.compression import DOWNLOAD_CODECS
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS
from fedsilo.core.messages import STATISTICS, is_statistic
from fedsilo.core.server_opt import BIAS_CORRECTIONS, SERVER_OPTIMIZERS, unread_correction, unread_hyperparameters
from fedsilo.core.transforms import UPLOAD_TRANSFORMS
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.models.settings import ModelConfig, default_name, reads_task_tokenizer, unread_sizes
from fedsilo.paradigms import PARADIGMS, Paradigm
from fedsilo.settings import FiniteFloat, Limit, SectionError, Strict, choice, where_what
from fedsilo.tasks import TASKS, TaskSettings


# Every [client] key may be overridden per silo: the override model is derived, never hand-kept.
ClientOverride = create_model(
    "ClientOverride", __base__=Strict,
    **{name: (f.annotation | None, None) for name, f in ClientConfig.model_fields.items()},
)


class SecureAggregationConfig(Strict):
    """`[federation.secure_aggregation]`: the server learns only the round's weighted sum (fedsilo.privacy.secagg)."""
    threshold: int | None = Field(None, ge=2, description="Shamir threshold t: the round needs t silos to finish, "
                                                          "tolerates n − t dropping; None: a majority, n//2 + 1")
    step: FiniteFloat = Field(2.0 ** -32, gt=0, lt=1, description="fixed-point step: each coordinate of the sum is "
                                                                   "exact to (silos) × step / 2")


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
        return self.mode == "central"

    @property
    def seeded(self) -> bool:
        return self.noise == "seeded"

    @model_validator(mode="after")
    def _one_of(self) -> "SiloDPConfig":
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ValueError("set target_epsilon (σ is derived from it) or noise_multiplier")
        return self


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
    plugin_dir: str | None = Field(None, description="the folder `plugins` are imported from first; default: the "
                                   "config file's folder, recorded absolute (Flower's processes run elsewhere)")
    name: str = "run"
    seed: int = Field(0, ge=0, lt=2**63)
    paradigm: choice(PARADIGMS) = Field("federated", description="how the silos take part: federated, finetune "
                                        "(each alone) or centralized (their data pooled); fedsilo.paradigms")
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

    @field_validator("plugin_dir")
    @classmethod
    def _absolute_plugin_dir(cls, v: str | None) -> str | None:
        return v if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="wrap")
    @classmethod
    def _tokenizer_as_used(cls, data: Any, handler) -> "RunConfig":
        """With `model.init_from` over a saved tokenizer, the task's tokenizer keys are what that
        tokenizer was fitted with: one set otherwise is refused, one left out is taken from the
        source's config.toml (so this run's config.toml records what it uses)."""
        cfg = handler(data)
        fill = tokenizer_fill(cfg)
        if not fill:
            return cfg
        try:
            task = type(cfg.task).model_validate({**cfg.task.model_dump(), **fill})
        except ValidationError as err:
            raise SectionError(f"model.init_from: {saved_tokenizer(cfg.model.init_from).parent / 'config.toml'}: "
                               f"{where_what(err, prefix='task')}") from None
        return cfg.model_copy(update={"task": task})

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
                raise SectionError(where_what(err, prefix=f"clients.{name}")) from None
        return self

    @model_validator(mode="after")
    def _client_settings_are_read(self) -> "RunConfig":
        # A [client] key refused where no participant reads it; a [clients.<silo>] key where that silo does not.
        participants = ["pooled"] if self.participation.pools_silos else self.task.client_names()
        for key, why in unread_client_keys(self.client).items():
            value = getattr(self.client, key)
            if value != ClientConfig.model_fields[key].default and all(
                    key in unread_client_keys(self.client_config(c)) for c in participants):
                raise SectionError(f"client.{key} = {_fmt(value)}: nothing reads it ({why}); remove it")
        for silo, override in self.clients.items():
            unread = unread_client_keys(self.client_config(silo))
            for key, value in override.model_dump(exclude_none=True).items():
                if key in unread:
                    raise SectionError(f"clients.{silo}.{key} = {_fmt(value)}: nothing reads it ({unread[key]}); "
                                       "remove it")
        return self

    @model_validator(mode="after")
    def _private_lr_has_tensors(self) -> "RunConfig":
        # A rate for kept tensors when nothing is kept would silently change nothing.
        rates = [self.client.private_lr, *(o.private_lr for o in self.clients.values())]
        if any(r is not None for r in rates) and not (self.participation.federates and self.exchange.private):
            raise ValueError("client.private_lr: set for the tensors a client keeps, but this run keeps none "
                             "(it needs paradigm = \"federated\" and exchange.private patterns)")
        return self

    @property
    def silos_per_round(self) -> int:
        """How many silos each round samples (sample_clients' k)."""
        f, silos = self.federation, len(self.task.client_names())
        return min(silos, f.sample_count or max(1, round(f.sample_fraction * silos)))

    @property
    def persist_optimizer(self) -> bool:
        if self.client.persist_optimizer is not None:
            return self.client.persist_optimizer
        return not self.participation.federates

    @property
    def participation(self) -> Paradigm:
        """The paradigm's entry: what the engine does differently for it."""
        return PARADIGMS.get(self.paradigm)

    def client_config(self, client: str) -> ClientConfig:
        override = self.clients.get(client)
        if override is None:
            return self.client
        # validated, so a table ([clients.<silo>.dp], .personal) becomes its settings class again
        return ClientConfig.model_validate({**self.client.model_dump(), **override.model_dump(exclude_none=True)})


def task_settings(raw: Any) -> TaskSettings:
    if not isinstance(raw, dict):
        raise ValueError("must be a table, e.g. [task] name = \"text2sql\"")
    name = raw.get("name", "text2sql")
    if name not in TASKS:
        raise SectionError(f"task.name: {name!r} is not a choice: {', '.join(map(repr, TASKS))}")
    try:
        return TASKS.entry(name).settings.model_validate({**raw, "name": name})
    except ValidationError as err:
        raise SectionError(where_what(err, prefix="task")) from None


def unread_client_keys(c: ClientConfig) -> dict[str, str]:
    """The keys of one silo's [client] section that nothing reads, each with the setting that makes it so
    (fedsilo/client/silo.py, train.py, schedule.py, batching.py, hooks.py). A user's own after-training
    pass is given the whole section, so nothing is said then."""
    if c.after_training is not None:
        return {}
    unread = {}
    if c.steps is not None:
        unread["epochs"] = f"steps = {c.steps} is set: a round is that many optimiser steps"
    if LR_SCHEDULES.get(c.lr_schedule) is constant:
        unread["schedule_span"] = "lr_schedule = \"constant\" has no schedule to span"
    if c.before_training is None:
        unread["pseudo_source"] = "there is no before_training hook to label with it"
    if BATCH_ORDERS.get(c.batching) is shuffled:
        unread["length_window"] = "batching = \"shuffle\" has no length windows"
    return unread


# ---- settings another setting makes meaningless: the task's tokenizer keys, model sizes, paradigms

TOKENIZER_DIR = "tokenizer"  # in a run directory: the task tokenizer its model was trained with

# The [task] keys that only shape a task's own tokenizer (TaskPlugin.tokenizer): a settings class may say
# so itself (`tokenizer_keys`, a ClassVar); these are the built-in tasks'.
_TOKENIZER_KEYS = {"translation": ("vocab_size", "tokenizer_model", "tokenizer_domain")}


def tokenizer_keys(task: TaskSettings) -> tuple[str, ...]:
    """The task's keys that only say how its own tokenizer is fitted (none when it has no tokenizer)."""
    if TASKS.get(task.name).tokenizer is None:
        return ()
    keys = getattr(type(task), "tokenizer_keys", None)
    keys = _TOKENIZER_KEYS.get(task.name, ()) if keys is None else keys
    return tuple(k for k in keys if k in type(task).model_fields)


def saved_tokenizer(init_from: str | None) -> Path | None:
    """The tokenizer folder beside `model.init_from`'s checkpoint (a run directory's `tokenizer/`), if any:
    a run that starts from that checkpoint uses it, not the task's own."""
    if not init_from:
        return None
    source = Path(init_from).expanduser()
    saved = (source if source.is_dir() else source.parent) / TOKENIZER_DIR
    return saved if saved.is_dir() else None


def model_kind_name(cfg: "RunConfig") -> tuple[str | None, str | None]:
    """The model kind and name a run builds: the config's, else the task's defaults, else the kind's."""
    defaults = TASKS.get(cfg.task.name).default_model
    kind = cfg.model.kind if cfg.model.kind is not None else defaults.get("kind")
    name = cfg.model.name if cfg.model.name is not None else defaults.get("name")
    return kind, name if name is not None else default_name(kind)


def _recorded_task(folder: Path, task: str) -> dict | None:
    """The [task] section of `folder`/config.toml when it is a `task` run's, else None."""
    try:
        recorded = tomllib.loads((folder / "config.toml").read_text()).get("task")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return recorded if isinstance(recorded, dict) and recorded.get("name", "text2sql") == task else None


def tokenizer_fill(cfg: "RunConfig") -> dict:
    """The tokenizer keys `cfg` takes from `model.init_from`'s source run (what its saved tokenizer was
    fitted with); a key the config sets to another value raises SectionError naming both keys."""
    keys = tokenizer_keys(cfg.task)
    saved = saved_tokenizer(cfg.model.init_from) if keys else None
    if saved is None or not reads_task_tokenizer(*model_kind_name(cfg)):
        return {}
    fields = type(cfg.task).model_fields
    recorded = _recorded_task(saved.parent, cfg.task.name)
    if recorded is None:  # nothing says what it was fitted with: a value set here cannot be honoured
        for key in keys:
            value = getattr(cfg.task, key)
            if value != fields[key].default:
                raise SectionError(f"task.{key} = {_fmt(value)}: not read, model.init_from = "
                                   f"{_fmt(cfg.model.init_from)} starts from the tokenizer saved in {saved}, and "
                                   f"{saved.parent} holds no config.toml saying what it was fitted with; "
                                   f"remove task.{key}")
        return {}
    used = {key: recorded.get(key, fields[key].default) for key in keys}
    for key in keys:
        value = getattr(cfg.task, key)
        if key in cfg.task.model_fields_set and value != used[key]:
            raise SectionError(f"task.{key} = {_fmt(value)}: not read, model.init_from = {_fmt(cfg.model.init_from)} "
                               f"starts from the tokenizer saved in {saved}, fitted with {key} = {_fmt(used[key])} "
                               f"({saved.parent / 'config.toml'}); remove task.{key} or set it to {_fmt(used[key])}")
    return {key: v for key, v in used.items() if getattr(cfg.task, key) != v}


def config_warnings(cfg: "RunConfig") -> list[str]:
    """Settings `cfg` gives a value other than the default that another setting makes meaningless, where a
    refusal would break a common use (a study's base config under a finetune variant, a task config with
    another model): each named, with the setting that overrides it."""
    out = []
    kind, name = model_kind_name(cfg)
    task_fields = type(cfg.task).model_fields
    if not reads_task_tokenizer(kind, name):
        for key in tokenizer_keys(cfg.task):
            value = getattr(cfg.task, key)
            if value != task_fields[key].default:
                out.append(f"task.{key} = {_fmt(value)} has no effect: model {name!r} ({kind}) does not use the "
                           f"{cfg.task.name} task's own tokenizer")
    unread, why = unread_sizes(kind, name)
    for key in unread:
        value = getattr(cfg.model, key)
        if value != ModelConfig.model_fields[key].default:
            out.append(f"model.{key} = {_fmt(value)} has no effect: model {name!r} ({kind}): {why}")
    p = cfg.participation
    if not p.federates:
        f = cfg.federation
        for key in ("weighting", "weighting_stat", "sample_count", "sample_fraction", "aggregation"):
            value = getattr(f, key)
            if value != FederationConfig.model_fields[key].default:
                alone = "each silo trains alone" if p.per_silo_runs else "one pooled client trains"
                out.append(f"federation.{key} = {_fmt(value)} has no effect: paradigm = {cfg.paradigm!r} does not "
                           f"federate ({alone})")
    if p.per_silo_runs and (cfg.server.optimizer != ServerConfig.model_fields["optimizer"].default
                            or cfg.server.lr not in (None, 1.0)):
        out.append(f"server.optimizer = {cfg.server.optimizer!r}, lr = {cfg.server.lr}: not used, paradigm = "
                   f"{cfg.paradigm!r} takes each silo's own update as it is (fedavg, lr 1.0)")
    if p.pools_silos and cfg.clients:
        out.append(f"[clients.{next(iter(cfg.clients))}] has no effect: paradigm = {cfg.paradigm!r} trains one "
                   "pooled client with [client]'s settings")
    return out


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
    return f"{source}: {where_what(err)}"


def locate_files(raw: dict, folder: Path) -> dict:
    """`raw` with the paths it names made absolute, relative to `folder` (the config file's): its
    `plugin_dir` (`folder` itself when the config names plugins and no plugin_dir) and each own
    silo's files (`[task.sources.NAME]` path, schema_file, database)."""
    from fedsilo.sources.settings import resolve_paths

    task = raw.get("task")
    if isinstance(task, dict):
        resolve_paths(task.get("sources"), folder)
    where = raw.get("plugin_dir")
    if isinstance(where, str):
        raw["plugin_dir"] = str((folder / Path(where).expanduser()).resolve())
    elif where is None and raw.get("plugins"):
        raw["plugin_dir"] = str(folder.resolve())
    return raw


def import_plugins(raw: dict, source: str) -> None:
    """Import `plugins` (module names) so that what they register is a valid choice: from `plugin_dir`
    first (put at the front of sys.path, as Python does with a script's folder), then the Python path."""
    import importlib

    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{source}: plugins: expected a list of module names")
    where = raw.get("plugin_dir")
    if where is not None and not isinstance(where, str):
        raise ConfigError(f"{source}: plugin_dir: expected a folder")
    folder = str(Path(where).expanduser().resolve()) if where and plugins else None
    if folder is not None and folder not in sys.path:
        sys.path.insert(0, folder)
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as err:
            searched = f"{folder}, then the Python path" if folder else "the Python path"
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"{source}: plugins: cannot import {module!r} (searched {searched}): {reason}") from None


def validate(raw: dict, source: str = "config", warn: bool = False) -> RunConfig:
    """`raw` as a RunConfig (its plugins imported first); `warn`: also warn (ConfigWarning) about each
    setting another makes meaningless, as a user's own file is loaded (not each process re-reading it)."""
    import_plugins(raw, source)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None
    except SectionError as err:
        raise ConfigError(f"{source}: {err}") from None
    if warn:
        for message in config_warnings(cfg):
            warnings.warn(f"{source}: {message}", ConfigWarning, stacklevel=2)
    return cfg


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
    raw = locate_files(apply_overrides(raw, list(assignments)), path.parent)
    return validate(raw, str(path), warn=True)


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
