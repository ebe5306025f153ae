"""`fedsilo data check CONFIG`: every silo checked as a run checks it at its start
(fedsilo/rundir/datacheck.py), and more, which needs the task built with the run's tokenizer: how many
examples of each split a run uses (after max_train, max_eval and the task's own selection, counted
from the task a run builds, not recomputed here), each silo's token lengths against the model's limits,
and a task without its own `inspect` (a user's plug-in) counted from its examples. Above the recipe for that.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsilo.config import RunConfig
from fedsilo.errors import DataError
from fedsilo.fileio import writable_file
from fedsilo.models.settings import reads_task_tokenizer
from fedsilo.settings import toml_value
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.tasks import TASKS, TaskSettings
from fedsilo.tasks.base import LengthChecks
from fedsilo.tasks.tokenizer_source import model_kind_name, saved_tokenizer

SPLITS = ("train", "dev", "test")
# The task settings that select a split's examples from a silo's files, each with its value that selects
# nothing (None: it always shapes them, e.g. matching's triples per training question).
SELECTING = {"train": {"max_train": 0, "train_fraction": 1.0, "min_train": 0, "pairs_per_question": None},
             "dev": {"max_eval": 0}, "test": {"max_eval": 0}}


def run_tokenizer(cfg: RunConfig):
    """The tokenizer a run of `cfg` reads, from its model kind as `build_model` gets it, without
    `model.init_from`'s tensors or the surgeries (neither changes it): checking data needs no trained
    model, so a study's stage-1 checkpoint need not exist yet."""
    from fedsilo.models import MODEL_KINDS
    from fedsilo.recipe import model_config, task_tokenizer

    mcfg = model_config(cfg)
    return MODEL_KINDS.get(mcfg.kind)(mcfg, cfg.seed, task_tokenizer(cfg))[1]


def tokenizer_note(cfg: RunConfig) -> str | None:
    """Why the tokens counted may not be a run's: `model.init_from` has no tokenizer saved beside it
    (a stage-1 run not done yet), so the task's own is counted, which a run from it reads only if that
    checkpoint was trained with it."""
    init = cfg.model.init_from
    if not init or saved_tokenizer(init) is not None or not reads_task_tokenizer(*model_kind_name(cfg)):
        return None
    return (f"tokens counted with the task's own tokenizer: model.init_from = {init} holds no saved tokenizer/ "
            "yet, and a run from it reads the one saved there")


def inspect_silos(cfg: RunConfig, silos: list[str] | None = None, build: bool = True) -> list[SiloCheck]:
    """One `SiloCheck` per silo of the run (or `silos`), from the task's `inspect`; a task without
    one (a user's plug-in) is built and its examples counted (unless not `build`: then none)."""
    plugin = TASKS.get(cfg.task.name)
    silos = silos if silos is not None else cfg.task.client_names()
    if plugin.inspect is not None:
        data_dir = plugin.data_dir(cfg.task)  # the config's benchmark data, fetched once: its error is the config's
        return [_inspected(cfg, plugin.inspect, silo, data_dir) for silo in silos]
    if not build:
        return []
    from fedsilo.recipe import build_task

    task = build_task(cfg, run_tokenizer(cfg), silos)
    return [inspect_items(silo, "plug-in", "examples",
                          {s: [Item("", repr(x), (repr(x),)) for x in task.examples(silo, s)] for s in SPLITS},
                          "example") for silo in silos]


def _inspected(cfg: RunConfig, inspect, silo: str, data_dir) -> SiloCheck:
    """One silo's check (as a run's start checks it, fedsilo.rundir.datacheck); a data error of its own
    (too few groups to split, an unreadable file) is its blocking row, as the exit code says, not an
    error that hides the other silos."""
    try:
        return inspect(cfg.task, silo, data_dir)
    except DataError as err:
        source = cfg.task.own_source(silo)
        return SiloCheck.failed(silo, source.format_name if source is not None else "benchmark", str(err))


def selecting(settings: TaskSettings, split: str) -> str:
    """The settings that select `split`'s examples from the files', as the config would write them."""
    fields = type(settings).model_fields
    named = [f"{key} = {toml_value(getattr(settings, key))}" for key, idle in SELECTING[split].items()
             if key in fields and getattr(settings, key) != idle]
    return ", ".join(named) or "as the task selects them"


@dataclass(frozen=True)
class Use:
    """What a run uses of one silo: its examples per split, and where that is not the files' count,
    the settings that select them."""
    counts: dict[str, int]
    why: dict[str, str]

    def line(self, files: Mapping[str, int]) -> str:
        if all(self.counts[s] == files.get(s, 0) for s in SPLITS):
            return "a run uses all of them"
        return "a run uses: " + "; ".join(
            f"{s} {n} (all)" if n == files.get(s, 0) else f"{s} {n} from these {files.get(s, 0)} ({self.why[s]})"
            for s, n in self.counts.items())


@dataclass
class DataCheck:
    """One config's silos checked; `uses` once the task is built with the run's tokenizer (else None)."""
    checks: list[SiloCheck]
    uses: dict[str, Use] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def blocking(self) -> bool:
        return any(c.blocking for c in self.checks)

    def text(self) -> str:
        return report(self.checks, self.uses, self.notes)

    def to_json(self) -> list[dict[str, Any]]:
        return [{**c.to_json(), **({"used": self.uses[c.name].counts} if self.uses else {})} for c in self.checks]


def check_config(cfg: RunConfig, build: bool = True) -> DataCheck:
    """Every silo of `cfg` inspected and, with `build` and nothing blocking, measured as a run builds it."""
    out = DataCheck(inspect_silos(cfg))
    if build and not out.blocking:
        measure(cfg, out)
    return out


def measure(cfg: RunConfig, out: DataCheck) -> None:
    """The task built as a run builds it, with the run's tokenizer: the examples of each split a run
    uses, and each silo's token lengths where the task measures them (`LengthChecks`)."""
    from fedsilo.recipe import build_task

    task = build_task(cfg, run_tokenizer(cfg), [c.name for c in out.checks])
    note = tokenizer_note(cfg)
    if note:
        out.notes.append(note)
    out.uses = {}
    for c in out.checks:
        counts = {s: len(task.examples(c.name, s)) for s in SPLITS}
        out.uses[c.name] = Use(counts, {s: selecting(cfg.task, s) for s in SPLITS if counts[s] != c.counts.get(s, 0)})
        if isinstance(task, LengthChecks):
            c.lengths = task.length_checks(c.name)


def report(checks: list[SiloCheck], uses: Mapping[str, Use] | None = None, notes: Sequence[str] = ()) -> str:
    lines = []
    for c in checks:
        head, *rest = c.lines()
        lines += [head, *([f"  {uses[c.name].line(c.counts)}"] if uses else []), *rest]
    blocking = [c.name for c in checks if c.blocking]
    if uses is None and not blocking:
        lines.append("(the files' counts: what a run uses of them, after max_train and max_eval, is counted with "
                     "the task built, which --no-lengths skips)")
    lines += notes
    lines.append(f"{len(checks)} silo(s) checked: " + (f"{len(blocking)} cannot be run ({', '.join(blocking)})"
                                                        if blocking else "ready to run"))
    return "\n".join(lines)


def write_json(data: Any, path: Path) -> None:
    writable_file(path, "--json").write_text(json.dumps(data, indent=1) + "\n")
