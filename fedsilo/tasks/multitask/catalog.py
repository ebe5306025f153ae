"""The catalogue of few-shot tasks: one converter per CrossFit task, from a raw public source to
text-to-text records.

A converter reads files under the multitask data folder (paths relative to it, as the sources
manifest lists them) and returns `Pools`: the records few-shot train and dev are drawn from, and
the disjoint records the few-shot test is drawn from. Records carry the task's input without the
task-name prefix (the task adds `<task name>: ` when it encodes) and one or more reference outputs.
Inputs and outputs never hold tabs or newlines (`clean`), and outputs never hold "[SEP]": BERT-family
tokenizers read it as their end-of-sequence token.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedsilo.registry import Registry

Group = Literal["classification", "qa", "generation", "other"]
"""The FewFedWeight paper's four groups (its Table 6); "generation" is its conditional generation."""

Metric = Literal["acc", "em", "qa_f1", "macro_f1", "rouge_l", "mcc"]
"""CrossFit's METRICS (dataloader/metrics.py): ACC, EM, QA-F1, Classification-F1, Rouge-L,
Matthew-Correlation."""


@dataclass(frozen=True)
class Record:
    input: str
    outputs: tuple[str, ...]  # references; outputs[0] is the training target (and the class label)


@dataclass(frozen=True)
class Pools:
    train: list[Record]  # few-shot train and dev are drawn from here
    test: list[Record]   # the few-shot test is drawn from here
    note: str = ""       # how the pools were made where the source's own splits are not used as is


@dataclass(frozen=True)
class TaskInfo:
    name: str                      # CrossFit's task name
    group: Group
    metric: Metric
    per_class: bool                # True: k examples per class (CrossFit's classification builders)
    files: tuple[str, ...]         # what the converter reads, relative to the multitask data folder
    license: str
    convert: Callable[[Path], Pools] = field(repr=False)
    in_paper: bool = True          # among the FewFedWeight paper's 117 tasks (its Table 5)


CATALOG: Registry[TaskInfo] = Registry("multitask task")


def register(name: str, *, group: Group, metric: Metric, per_class: bool, files: tuple[str, ...] | list[str],
             license: str, in_paper: bool = True) -> Callable[[Callable[[Path], Pools]], Callable[[Path], Pools]]:
    """Decorator: `convert(root) -> Pools` becomes the catalogue's task `name`."""
    def wrap(convert: Callable[[Path], Pools]) -> Callable[[Path], Pools]:
        CATALOG.add(name, TaskInfo(name, group, metric, per_class, tuple(files), license, convert, in_paper))
        return convert
    return wrap


_SPACE = re.compile(r"\s+")


def clean(text: str) -> str:
    """CrossFit's `clean` (tasks/utils.py): literal "\\n" and every whitespace run become one space."""
    return _SPACE.sub(" ", text.replace("\\n", " ")).strip()


def split_80_20(records: list[Record], seed: int = 42) -> tuple[list[Record], list[Record]]:
    """CrossFit's split of a source with one split only: shuffle with numpy's legacy seed, first 80%
    train, the rest test (`np.random.seed(42); np.random.shuffle(lines)`)."""
    import numpy as np

    order = list(range(len(records)))
    np.random.seed(seed)
    np.random.shuffle(order)
    cut = int(len(order) * 0.8)
    return [records[i] for i in order[:cut]], [records[i] for i in order[cut:]]
