"""The `[tracking]` section: which experiment trackers mirror a run, and where MLflow keeps it."""
from __future__ import annotations

import importlib.util

from pydantic import Field, field_validator

from fedsilo.errors import ConfigError
from fedsilo.settings import Strict

from . import BOTH, TRACKERS

PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard"}  # what each built-in tracker imports
ALIASES = {"off": (), "both": BOTH}  # backend names that stand for no tracker, or for several


class TrackingConfig(Strict):
    backend: str = Field(
        "off", description="off, mlflow, tensorboard, both (mlflow and tensorboard), or a tracker a plug-in "
                           "registered; the CLI's --tracking sets it")
    uri: str | None = Field(
        None, description="MLflow's tracking URI (a team's server, http://host:5000, or sqlite:///path.db); default: "
                          "$MLFLOW_TRACKING_URI, else the local store mlflow.db beside the run directory")
    experiment: str | None = Field(
        None, description="the MLflow experiment; default: the study's name, or the run's `name`")
    export: bool = Field(
        False, description="also log the run's exported model (fedsilo export: a LoRA run's adapters, else the "
                           "whole model) under the artifact folder model/")

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ALIASES and v not in TRACKERS:
            raise ValueError(f"{v!r} is not a choice: " + ", ".join(map(repr, [*ALIASES, *TRACKERS])))
        return v

    @field_validator("uri", "experiment")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave the key out for the default)")
        return v

    @property
    def backends(self) -> tuple[str, ...]:
        """The trackers this section names, in order."""
        return ALIASES.get(self.backend, (self.backend,))


def missing_packages(settings: TrackingConfig) -> list[str]:
    """The built-in trackers' packages this Python lacks (a run says so before it starts)."""
    return [PACKAGES[b] for b in settings.backends if b in PACKAGES and importlib.util.find_spec(PACKAGES[b]) is None]


def require_packages(settings: TrackingConfig) -> None:
    """Refuse, before a run starts, trackers whose package this Python lacks."""
    missing = missing_packages(settings)
    if missing:
        raise ConfigError(f"tracking.backend = {settings.backend!r} needs the {' and '.join(missing)} package"
                          f"{'s' if len(missing) > 1 else ''}, which this Python lacks: pip install 'fedsilo[tracking]' "
                          "(or --tracking off)")
