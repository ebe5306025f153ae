"""`RUN/answers/<split>.jsonl`: the text a run's final evaluation produced, one line per item, so that a
score can be read against what the model said (LLM leaderboards keep every generation for the same reason).

A line is the item's client, split and hashed id (as in `items/<split>.jsonl`, so the two join), the
prompt's last turn and what the task kept (`fedsilo.tasks.base.KeepsAnswers`): for generation the
answer, the number read from it and the gold one; for multiple choice the option chosen, the gold one
and every option's log-likelihood. The text is the silos' own: it is written only where the task ran
in the run's process (the in-process engines, one operator); a Flower silo's answers never leave it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsilo.fileio import atomic_write_bytes, read_jsonl
from fedsilo.rundir.records import read_text

__all__ = ["ANSWERS_FOLDER", "answers_path", "task_answers", "write_answers", "read_answers"]

ANSWERS_FOLDER = "answers"


def answers_path(run_dir: str | Path, split: str = "test") -> Path:
    return Path(run_dir) / ANSWERS_FOLDER / f"{split}.jsonl"


def task_answers(task: Any, split: str = "test") -> list[dict]:
    """Every client's kept answers on `split`, clients in the task's order; [] for a task without any."""
    from fedsilo.tasks.base import KeepsAnswers

    if not isinstance(task, KeepsAnswers):
        return []
    return [{"client": client, "split": split, **answer} for client in task.clients
            for answer in task.answers(client, split)]


def write_answers(run_dir: str | Path, records: Sequence[Mapping[str, Any]], split: str = "test") -> Path | None:
    """The answers file, written atomically (before results.json, as the items are); nothing without answers."""
    if not records:
        return None
    path = answers_path(run_dir, split)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    return path


def read_answers(run_dir: str | Path, split: str = "test") -> list[dict] | None:
    """The answers file's records, or None when the run has none; ValueError naming the file and line
    of one that is not an object with a client."""
    path = answers_path(run_dir, split)
    if not os.path.lexists(path):
        return None
    parsed, partial = read_jsonl(read_text(path), str(path))
    if partial:  # written atomically: a cut line means the file was altered
        raise ValueError(partial.replace(" skipped", ""))
    records = []
    for lineno, record in parsed:
        if not isinstance(record, dict) or not isinstance(record.get("client"), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a client")
        records.append(record)
    return records
