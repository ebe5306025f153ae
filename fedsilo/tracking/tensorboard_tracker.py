"""TensorBoard: event files in RUN/tensorboard/ (`tensorboard --logdir runs` shows every run, a study's
as OUT/VARIANT/seed-S/tensorboard).

Each opening writes a new event file that purges every earlier event (TensorBoard's own `purge_step`)
and is given the run's whole record again, so a resume or a second look never shows a round twice.
TensorBoard has no artifacts: report.md and the study's comparison are shown as text.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import TrackedRun
from .metrics import ROUND

FOLDER = "tensorboard"
TEXTS = (".md", ".txt")  # files shown in TensorBoard's text tab; others are the other trackers' business


class TensorBoardTracker:
    def __init__(self, writer) -> None:
        self.writer = writer
        self.steps: dict[str, set[int]] = {}  # what this opening logged (it purged what earlier ones wrote)

    def logged_through(self) -> int:
        return max(self.steps.get(ROUND, ()), default=-1)

    def has_step(self, key: str, step: int) -> bool:
        return step in self.steps.get(key, ())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
            self.steps.setdefault(key, set()).add(step)
        self.writer.flush()  # a round is visible once it is logged

    def log_files(self, files: Mapping[str, Path]) -> None:
        for name, path in files.items():
            if path.is_file() and path.suffix in TEXTS:
                self.log_text(path.read_text(encoding="utf-8", errors="replace"), name)

    def log_text(self, text: str, name: str) -> None:
        self.writer.add_text(name, text, 0)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def open_tensorboard(settings, run: TrackedRun, parent: TensorBoardTracker | None) -> TensorBoardTracker:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(Path(run.path) / FOLDER), purge_step=0)
    rows = "\n".join(f"| {k} | {v} |" for k, v in run.params.items())
    if rows:
        writer.add_text("config", f"| key | value |\n|---|---|\n{rows}", 0)
    tags = "\n".join(f"- {k}: {v}" for k, v in run.tags.items())
    if tags:
        writer.add_text("run", tags, 0)
    writer.flush()
    return TensorBoardTracker(writer)
