"""Progress display for long work: live bars (rich), plain lines (`--no-progress`: logs, CI), or
silent (tests, benchmarks). Several runs (a study) may share what they have warned about (`Heard`),
so a warning every run gives (a silo's duplicates) is shown once, not once per run."""
from __future__ import annotations

from typing import Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


Display = bool | Literal["lines"]
"""True: live progress bars; "lines": one plain line per logged event (a finished round, a silo
started), no bars; False: nothing but warnings."""


class Heard:
    """The warnings shown so far over several runs, and which runs gave each: a study shows each
    distinct warning once, then says how many of its runs it concerned."""

    def __init__(self) -> None:
        self.runs = 0
        self._by: dict[str, set[int]] = {}

    def new_run(self) -> int:
        self.runs += 1
        return self.runs

    def first(self, message: str, run: int) -> bool:
        """Note that `run` gave `message`; whether no run had given it before."""
        runs = self._by.setdefault(message, set())
        new = not runs
        runs.add(run)
        return new

    def repeated(self) -> dict[str, int]:
        """Each warning given by more than one run → how many runs gave it."""
        return {m: len(r) for m, r in self._by.items() if len(r) > 1}


class Progress:
    def __init__(self, enabled: Display = True, console: Console | None = None, heard: Heard | None = None) -> None:
        self.console = console or Console(stderr=True, log_path=False)
        self._heard, self._run = heard, heard.new_run() if heard is not None else 0
        self._lines = enabled == "lines"
        enabled = enabled is True
        self._bar = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=self.console, transient=False,
        ) if enabled else None
        self._task = None

    def __enter__(self) -> "Progress":
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar:
            self._bar.stop()

    def begin(self, description: str, total: int) -> None:
        if self._bar:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._bar and self._task is not None:
            self._bar.advance(self._task, n)

    def log(self, message: str) -> None:
        if self._bar:
            self._bar.console.log(message)
        elif self._lines:
            self.console.print(f"fedsilo: {message}", markup=False, highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        """Shown also without progress display (rejections, fallbacks, capped metrics); with `heard`,
        only where no earlier run of the study showed it."""
        if self._heard is not None and not self._heard.first(message, self._run):
            return
        # one line as without bars, printed above them while they show (not a log line: no markup, no wrap)
        self.console.print(f"fedsilo: warning: {message}", style="yellow", markup=False, highlight=False,
                           soft_wrap=True)
