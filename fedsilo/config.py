"""Run configuration: TOML → validated pydantic models. Unknown keys and impossible values fail
with one message that names them."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedsilo.client.train import OPTIMIZERS as CLIENT_OPTIMIZERS
from fedsilo.core.server_opt import OPTIMIZERS as SERVER_OPTIMIZERS
from fedsilo.core.weighting import POLICIES

# Silo catalogue per task, kept here so a config is checked before any data is read.
TASK_SILOS = {"text2sql": ("advising", "atis", "geography", "restaurants", "scholar", "academic", "imdb", "yelp")}


# Choices come from the modules that implement them, so a new policy needs no edit here.
ClientOptimizer = Literal[CLIENT_OPTIMIZERS]
ServerOptimizerName = Literal[SERVER_OPTIMIZERS]
Weighting = Literal[POLICIES]


class ConfigError(ValueError):
    """A config the user wrote cannot be run; the message names the culprit."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(Strict):
    name: Literal["text2sql"] = "text2sql"
    data_dir: str | None = None  # None: fetch/verify into the data cache (see `fedsilo data`)
    silos: list[str] = Field(default_factory=lambda: list(TASK_SILOS["text2sql"]))
    train_fraction: float = Field(1.0, gt=0, le=1, description="keep this share of each silo's train set")
    min_train: int = Field(0, ge=0, description="but at least this many (a small-scale study keeps small silos)")
    max_train: int = Field(0, ge=0, description="cap on train examples per silo (0 = all)")
    max_eval: int = Field(0, ge=0, description="cap on dev/test examples per silo (0 = all)")
    max_source_length: int = Field(256, gt=0)
    max_target_length: int = Field(128, gt=0)
    eval_batch_size: int = Field(32, gt=0)
    exec_accuracy: bool = True

    @field_validator("silos")
    @classmethod
    def _known_silos(cls, v: list[str], info) -> list[str]:
        known = TASK_SILOS[info.data.get("name", "text2sql")]
        unknown = [s for s in v if s not in known]
        if unknown:
            raise ValueError(f"unknown silo {unknown[0]!r}; choose from {', '.join(known)}")
        if not v or len(set(v)) != len(v):
            raise ValueError("silos must be a non-empty list without repeats")
        return v


class ModelConfig(Strict):
    name: str = "tiny-t5"  # "tiny-t5", "minilm2bert", or a local Hugging Face seq2seq checkpoint path
    d_model: int = Field(128, gt=0)
    d_ff: int = Field(256, gt=0)
    num_layers: int = Field(2, gt=0)
    num_decoder_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    dropout: float = Field(0.1, ge=0, lt=1)
    device: str = Field("auto", description="auto: cuda when available, else cpu; or any torch device")


class ClientConfig(Strict):
    epochs: int = Field(1, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(8, gt=0)
    optimizer: ClientOptimizer = "adafactor"
    weight_decay: float = Field(0.0, ge=0)
    logging_steps: int = Field(4, gt=0)
    prox_mu: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")


class ClientOverride(Strict):
    """Per-silo hyper-parameters; unset fields keep the [client] defaults."""
    epochs: int | None = Field(None, gt=0)
    lr: float | None = Field(None, gt=0)
    batch_size: int | None = Field(None, gt=0)
    optimizer: ClientOptimizer | None = None
    weight_decay: float | None = Field(None, ge=0)
    logging_steps: int | None = Field(None, gt=0)
    prox_mu: float | None = Field(None, ge=0)


class FederationConfig(Strict):
    rounds: int = Field(3, gt=0)
    sample_fraction: float = Field(1.0, gt=0, le=1)
    sample_count: int | None = Field(None, gt=0)
    weighting: Weighting = "size"
    eval_every: int = Field(1, gt=0)


class ServerConfig(Strict):
    optimizer: ServerOptimizerName = "fedavg"
    lr: float | None = Field(None, gt=0, description="default 1.0 for fedavg/sgdm, 0.01 for adaptive")
    momentum: float = Field(0.9, ge=0, lt=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0)

    @property
    def effective_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1.0 if self.optimizer in ("fedavg", "sgdm") else 0.01


class ExchangeConfig(Strict):
    shared: list[str] = Field(default_factory=lambda: ["*"])
    private: list[str] = Field(default_factory=list)
    select: str | None = None


class FlowerConfig(Strict):
    """Only for the Flower engines; the in-process engine ignores it."""
    connect_timeout: float = Field(300.0, gt=0, description="seconds to wait for every silo's SuperNode")
    round_timeout: float | None = Field(None, gt=0, description="seconds to wait for replies (None: forever)")
    retries: int = Field(0, ge=0, description="re-sends to silos that did not answer within a round")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per ClientApp in simulation")


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    paradigm: Literal["federated", "finetune", "centralized"] = "federated"
    out_dir: str = "runs"
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    client: ClientConfig = ClientConfig()
    clients: dict[str, ClientOverride] = Field(default_factory=dict)
    federation: FederationConfig = FederationConfig()
    server: ServerConfig = ServerConfig()
    exchange: ExchangeConfig = ExchangeConfig()
    flower: FlowerConfig = FlowerConfig()

    @model_validator(mode="after")
    def _overrides_name_silos(self) -> "RunConfig":
        # Overrides may name silos left out of task.silos (one file, several subsets), not unknown ones.
        unknown = sorted(set(self.clients) - set(TASK_SILOS[self.task.name]))
        if unknown:
            raise ValueError(f"[clients.{unknown[0]}] names no {self.task.name} silo")
        return self

    def client_config(self, silo: str) -> ClientConfig:
        override = self.clients.get(silo)
        if override is None:
            return self.client
        return self.client.model_copy(update=override.model_dump(exclude_none=True))


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
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
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "literal_error":
        msg = f"{first['input']!r} is not a choice: {msg[len('Input should be '):]}"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{source}: {where}: {msg}{more}"


def validate(raw: dict, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def load_config(path: str | Path, assignments: list[str] = ()) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
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
    return repr(v)


def _dump(d: dict, prefix: str = "") -> str:
    scalars = [f"{k} = {_fmt(v)}" for k, v in d.items() if not isinstance(v, dict)]
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for k, v in d.items():
        if isinstance(v, dict):
            name = f"{prefix}{k}"
            body = _dump(v, name + ".")
            if any(not isinstance(x, dict) for x in v.values()) or not v:
                out += f"\n[{name}]\n"
            out += body
    return out
