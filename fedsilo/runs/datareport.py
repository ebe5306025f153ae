"""`fedsilo data check CONFIG`: every silo checked as a run checks it at its start
(fedsilo/rundir/datacheck.py), and more, which needs the model: a task without its own `inspect` (a
user's plug-in) is built through the recipe and its examples counted, and each silo's token lengths
are measured against the model's limits with the run's own tokenizer. Above the recipe for that.
"""
from __future__ import annotations

import json
from pathlib import Path

from fedsilo.config import RunConfig
from fedsilo.rundir.datacheck import task_inspections
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import LengthChecks

SPLITS = ("train", "dev", "test")


def inspect_silos(cfg: RunConfig, silos: list[str] | None = None, build: bool = True) -> list[SiloCheck]:
    """One `SiloCheck` per silo of the run (or `silos`), from the task's `inspect`; a task without
    one (a user's plug-in) is built and its examples counted (unless not `build`: then none)."""
    plugin = TASKS.get(cfg.task.name)
    if plugin.inspect is not None or not build:
        return task_inspections(cfg, silos)
    silos = silos if silos is not None else cfg.task.client_names()
    from fedsilo.recipe import build_model, build_task

    task = build_task(cfg, build_model(cfg)[1], silos)
    return [inspect_items(silo, "plug-in", "examples",
                          {s: [Item("", repr(x), (repr(x),)) for x in task.examples(silo, s)] for s in SPLITS},
                          "example") for silo in silos]


def add_lengths(cfg: RunConfig, checks: list[SiloCheck]) -> None:
    """Each silo's token lengths against the model's limits, through the run's own tokenizer and task
    (a task without `length_checks` has none)."""
    from fedsilo.recipe import build_model, build_task

    _, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer, [c.name for c in checks])
    if not isinstance(task, LengthChecks):
        return
    for c in checks:
        c.lengths = task.length_checks(c.name)


def report(checks: list[SiloCheck]) -> str:
    lines = []
    for c in checks:
        lines += c.lines()
    blocking = [c.name for c in checks if c.blocking]
    lines.append(f"{len(checks)} silo(s) checked: " + (f"{len(blocking)} cannot be run ({', '.join(blocking)})"
                                                        if blocking else "ready to run"))
    return "\n".join(lines)


def write_json(checks: list[SiloCheck], path: Path) -> None:
    path.write_text(json.dumps([c.to_json() for c in checks], indent=1) + "\n")
