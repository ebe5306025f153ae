"""A run that stops before it records anything leaves its run directory as it found it.

A run refused at its start (a config value, the silos' data, a policy, a resume it cannot continue)
has written what a start writes (config.toml, data.json, the tokenizer) and nothing a resume or a
report can trust. Left there, those files make a fresh --out look like a run. `left_as_found` removes
what the run created, once it is refused: never what was there before it, and nothing at all once a
round, a checkpoint, results, a recorded failure or a privacy release is there (what a resume continues
from, and a silo's spent budget). The lock file and the folders the lock made are RunLock's to remove.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedsilo.rundir.layout import FAILED, LEDGER_FOLDER

RUN_RECORDS = {"rounds.jsonl", "checkpoint.pt", "best.pt", "results.json", FAILED}  # any run's, or a silo's sub-run's


@contextmanager
def left_as_found(out: str | Path) -> Iterator[None]:
    """Around a run into `out` (inside its RunLock): on any exception, what the run created there is removed
    unless it records a run."""
    out = Path(out)
    before = set(os.listdir(out)) if out.is_dir() else set()
    try:
        yield
    except BaseException:
        if out.is_dir() and not before & RUN_RECORDS:
            made = [out / name for name in set(os.listdir(out)) - before - {".lock"}]
            if not any(_records_a_run(path) for path in made):
                for path in made:
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        raise


def _records_a_run(path: Path) -> bool:
    for p in [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]:
        if p.name in RUN_RECORDS or (p.parent.name == LEDGER_FOLDER and p.is_file() and p.stat().st_size):
            return True
    return False
