"""Experiment trackers: a run's config, rounds, results and files where ML teams already look
(MLflow, TensorBoard), mirrored from the run directory, which stays the record.

A tracker is one run in one backend. `TRACKERS` maps a `[tracking] backend` name to an opener
`(settings, run, parent) -> Tracker`; `parent` is the same backend's tracker of the enclosing run (a
study, a finetune run) or None. A user's own backend (Weights & Biases, Aim …) is one more entry,
registered by a plug-in module. Openers import their package when called, never at import: a config
naming a tracker validates on a silo that has none installed (on Flower only the server side logs).

Replay, not bookkeeping: a tracker says how far its rounds go (`logged_through`); whoever drives it
(fedsilo.runs.tracked) logs each round of rounds.jsonl past that point, so a resume, or a run tracked
after the fact, gives every round once.
"""
from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fedsilo.fileio import atomic_write_bytes
from fedsilo.registry import Registry

STATE_FILE = "tracking.json"  # in a run directory: each backend's handle on its run (e.g. MLflow's run id)
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"  # how a tracked run ended (MLflow's statuses)


@dataclass(frozen=True)
class TrackedRun:
    """What a backend is told about one run."""
    path: Path                      # the run (or study) directory; its tracking.json is the backend's memory
    name: str                       # shown in the tracker: the run's name, or "variant seed S" in a study
    experiment: str                 # where a top-level run goes (a nested run goes where its parent is)
    params: Mapping[str, str] = field(default_factory=dict)  # the flattened config
    tags: Mapping[str, str] = field(default_factory=dict)    # version, commit, config hash, run directory …


class Tracker(Protocol):
    """One run in one backend. Every method may raise: the caller turns the first failure into one warning."""

    def logged_through(self) -> int:
        """The last round whose metrics this run holds (-1: none)."""

    def has_step(self, key: str, step: int) -> bool:
        """Whether metric `key` is logged at `step` (the final results are logged once)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_files(self, files: Mapping[str, Path]) -> None:
        """Each local file or folder under its name among the run's artifacts."""

    def log_text(self, text: str, name: str) -> None:
        """`text` (markdown) as the artifact `name`."""

    def close(self, status: str) -> None: ...


Opener = Callable[..., Tracker]  # (settings: TrackingConfig, run: TrackedRun, parent: Tracker | None) -> Tracker
TRACKERS: Registry[Opener] = Registry("tracker")
BOTH = ("mlflow", "tensorboard")  # what `backend = "both"` names


def read_state(folder: Path, backend: str) -> dict:
    """The backend's own entry of folder/tracking.json ({} when there is none or it is unreadable)."""
    try:
        state = json.loads((Path(folder) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    entry = state.get(backend) if isinstance(state, dict) else None
    return entry if isinstance(entry, dict) else {}


def write_state(folder: Path, backend: str, entry: dict) -> None:
    path = Path(folder) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state = state if isinstance(state, dict) else {}
    state[backend] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(state, indent=1) + "\n").encode())


@functools.cache
def source_commit() -> str | None:
    """The git commit of the fedsilo source a run used, where it is a git checkout (else None)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


# The built-in backends: each opener imports its package only when a run is tracked with it.
def _open_mlflow(settings, run: TrackedRun, parent: Tracker | None) -> Tracker:
    from .mlflow_tracker import open_mlflow
    return open_mlflow(settings, run, parent)


def _open_tensorboard(settings, run: TrackedRun, parent: Tracker | None) -> Tracker:
    from .tensorboard_tracker import open_tensorboard
    return open_tensorboard(settings, run, parent)


TRACKERS.add("mlflow", _open_mlflow)
TRACKERS.add("tensorboard", _open_tensorboard)
