"""Run configuration: TOML → validated pydantic models. Unknown keys and impossible values fail
with one message that names them.

Every policy axis is a registry (fedsilo.registry); its config field is checked against the registry
when the config is validated, so a policy registered by the user before the run is a valid choice.
The `[task]` section is validated by the settings class of the task it names.
"""
from __future__ import annotations

import os
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, ValidationError, ValidationInfo, create_model, field_validator
from pydantic import model_validator

from fedsilo import builtins  # noqa: F401  (fills every registry a config names from)
from fedsilo.client.batching import BATCH_ORDERS, shuffled
from fedsilo.client.schedule import LR_SCHEDULES, constant
from fedsilo.client.settings import ClientConfig
from fedsilo.federation_settings import ExchangeConfig, FederationConfig, ServerConfig
from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.fileio import regular_file
from fedsilo.models.settings import ModelConfig, reads_task_tokenizer, unread_sizes
from fedsilo.paradigms import PARADIGMS, Paradigm
from fedsilo.privacy.settings import SecureAggregationConfig, SiloDPConfig
from fedsilo.settings import SectionError, Strict, choice, toml_key, toml_value, where_what
from fedsilo.tasks import TASKS, TaskSettings
from fedsilo.tracking.settings import TrackingConfig
from fedsilo.tasks.tokenizer_source import (TOKENIZER_DIR, model_kind_name, saved_tokenizer, tokenizer_fill,
                                            tokenizer_keys)

__all__ = ["ClientConfig", "ConfigError", "EngineConfig", "ExchangeConfig", "FederationConfig", "FlowerConfig",
           "ModelConfig", "RunConfig", "SecureAggregationConfig", "ServerConfig", "SiloDPConfig", "TOKENIZER_DIR",
           "TrackingConfig",
           "apply_overrides", "load_config", "locate_files", "saved_tokenizer", "to_toml", "validate"]

# Every [client] key may be overridden per silo: the override model is derived, never hand-kept.
ClientOverride = create_model(
    "ClientOverride", __base__=Strict,
    **{name: (f.annotation | None, None) for name, f in ClientConfig.model_fields.items()},
)


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
            raise ValueError(f"engine.{info.field_name} must be a positive count or \"auto\", got {toml_value(v)}")
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
    tracking: TrackingConfig = TrackingConfig()

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
                raise SectionError(f"client.{key} = {toml_value(value)}: nothing reads it ({why}); remove it")
        for silo, override in self.clients.items():
            unread = unread_client_keys(self.client_config(silo))
            for key, value in override.model_dump(exclude_none=True).items():
                if key in unread:
                    raise SectionError(f"clients.{silo}.{key} = {toml_value(value)}: nothing reads it ({unread[key]}); "
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
                out.append(f"task.{key} = {toml_value(value)} has no effect: model {name!r} ({kind}) does not use the "
                           f"{cfg.task.name} task's own tokenizer")
    unread, why = unread_sizes(kind, name)
    for key in unread:
        value = getattr(cfg.model, key)
        if value != ModelConfig.model_fields[key].default:
            out.append(f"model.{key} = {toml_value(value)} has no effect: model {name!r} ({kind}): {why}")
    p = cfg.participation
    if not p.federates:
        f = cfg.federation
        for key in ("weighting", "weighting_stat", "sample_count", "sample_fraction", "aggregation"):
            value = getattr(f, key)
            if value != FederationConfig.model_fields[key].default:
                alone = "each silo trains alone" if p.per_silo_runs else "one pooled client trains"
                out.append(f"federation.{key} = {toml_value(value)} has no effect: paradigm = {cfg.paradigm!r} does not "
                           f"federate ({alone})")
    if not p.trains:
        changed = [f"{section}.{key}" for section, part, default in (("client", cfg.client, ClientConfig()),
                                                                   ("federation", cfg.federation, FederationConfig()))
                   for key in type(part).model_fields if getattr(part, key) != getattr(default, key)]
        if changed:
            out.append(f"{', '.join(changed[:3])}{' …' if len(changed) > 3 else ''} has no effect: paradigm = "
                       f"{cfg.paradigm!r} trains nothing (the starting model is evaluated)")
    if p.per_silo_runs and (cfg.server.optimizer != ServerConfig.model_fields["optimizer"].default
                            or cfg.server.lr not in (None, 1.0)):
        out.append(f"server.optimizer = {cfg.server.optimizer!r}, lr = {cfg.server.lr}: not used, paradigm = "
                   f"{cfg.paradigm!r} takes each silo's own update as it is (fedavg, lr 1.0)")
    t = cfg.tracking
    for key in ("uri", "experiment", "export"):
        value = getattr(t, key)
        if value != TrackingConfig.model_fields[key].default and "mlflow" not in t.backends:
            out.append(f"tracking.{key} = {toml_value(value)} has no effect: tracking.backend = {t.backend!r} does not "
                       "log to MLflow")
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
    if not os.path.lexists(path):
        raise ConfigError(f"config file not found: {path}")
    regular_file(path, "config file", ConfigError)  # a FIFO would block the reader for ever
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


# Sections whose values are free-form tables (written inline, not as [sub.sections]).
_INLINE = {"regularizers", "upload_options", "options", "hook_options"}


def _dump(d: dict, prefix: str = "") -> str:
    scalars = [f"{toml_key(k)} = {toml_value(v)}" for k, v in d.items() if not isinstance(v, dict) or k in _INLINE]
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for k, v in d.items():
        if isinstance(v, dict) and k not in _INLINE:
            name = f"{prefix}{toml_key(k)}"
            body = _dump(v, name + ".")
            if any(not isinstance(x, dict) or kk in _INLINE for kk, x in v.items()) or not v:
                out += f"\n[{name}]\n"
            out += body
    return out
