"""Every silo's data checked at the start of every run, on any engine (`check_at_start`): blocking
findings stop the run before it trains, each file's fingerprint goes to the run directory and, on a
resume, a file changed since the run began is named. Only what the task's own `inspect` reads: it
builds no model (`fedsilo data check`'s fuller check, a plug-in built through the recipe and token
lengths, is fedsilo/runs/datareport.py, above the recipe).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedsilo.config import RunConfig
from fedsilo.errors import DataError
from fedsilo.sources.check import SiloCheck
from fedsilo.sources.fingerprint import record
from fedsilo.sources.read import QuotingDataError, places
from fedsilo.tasks import TASKS


def task_inspections(cfg: RunConfig, silos: list[str] | None = None) -> list[SiloCheck]:
    """One `SiloCheck` per silo of the run (or `silos`), from the task's `inspect`; none for a task
    without one (a user's plug-in)."""
    plugin = TASKS.get(cfg.task.name)
    silos = silos if silos is not None else cfg.task.client_names()
    if plugin.inspect is None:
        return []
    data_dir = plugin.data_dir(cfg.task)
    return [plugin.inspect(cfg.task, silo, data_dir) for silo in silos]


def warnings_of(check: SiloCheck) -> list[str]:
    """What a run says before it trains about an own silo (a check's blocking findings are its error
    instead). A benchmark silo's duplicates and overlaps are the benchmark's, as the papers used it:
    `fedsilo data check` lists them, a run does not repeat them each time."""
    out = []  # rows left out by bad_rows = "skip" are warned about by the loader, on every engine
    if check.kind.startswith("benchmark"):
        return out
    for split, dups in check.duplicates.items():
        out.append(f"silo {check.name}: {len(dups)} exact duplicate example(s) in {split}, first {dups[0][0]} "
                   f"(repeats {dups[0][1]})")
    for pair, keys in check.overlap.items():  # keys equal only up to case: `fedsilo data check` lists them
        out.append(f"silo {check.name}: {len(keys)} {check.key_name}(s) in both {pair}, e.g. {keys[0].shown()}: "
                   "evaluation sees them in training")
    return out


def blocking_error(checks: list[SiloCheck], empty: bool = True) -> DataError | None:
    """One error for every silo that cannot run: malformed rows it does not skip and (with `empty`)
    empty splits. Without `empty` those are left to the task, whose error names the file and why
    (every label 0, no dev fold)."""
    bad = [c for c in checks if (c.problems and not c.skip_bad) or (empty and c.empty_splits)]
    if not bad:
        return None
    parts, public = [], []  # public: the same without the reasons, which may quote a row (what may travel)
    for c in bad:
        if c.problems and not c.skip_bad:
            shown = "; ".join(str(p) for p in c.problems[:3])
            more = f" (and {len(c.problems) - 3} more)" if len(c.problems) > 3 else ""
            parts.append(f"silo {c.name}: {len(c.problems)} malformed row(s): {shown}{more}")
            public.append(f"silo {c.name}: {len(c.problems)} malformed row(s) at {places(c.problems, 3)}")
        if empty and c.empty_splits:
            parts.append(f"silo {c.name}: no {' / '.join(c.empty_splits)} {c.unit}")
            public.append(parts[-1])
    fix = (". `fedsilo data check CONFIG` lists every finding; fix the files, or set bad_rows = \"skip\" in the "
           "silo's [task.sources.NAME] to leave malformed rows out")
    return QuotingDataError("; ".join(parts) + fix, "; ".join(public) + fix)


def check_at_start(cfg: RunConfig, run_dir: Path, resume: bool, warn: Callable[[str], None],
                   silos: list[str] | None = None) -> list[SiloCheck]:
    """The check of `fedsilo data check` (lengths aside): blocking findings stop the run before it
    trains, the rest are warned about; fingerprints go to the run directory, and on a resume a file
    changed since the run began is warned about by name. Without `silos`: every silo the run reads,
    its test matrix's and its tokenizer's too (a resume refits the tokenizer on that silo's files)."""
    checks = task_inspections(cfg, silos if silos is not None else cfg.task.needed_silos())
    error = blocking_error(checks, empty=False)  # the task's build names an empty split's file and cause
    if error is not None:
        raise error
    for check in checks:
        for line in warnings_of(check):
            warn(line)
    for line in record(run_dir, {c.name: c.files for c in checks}, resume):
        warn(line)
    return checks

