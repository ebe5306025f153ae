"""The multitask clients' data: which tasks each client holds, and each task's few-shot splits.

Tasks are dealt to clients at random with a seed (the paper: "randomly selected and diversified",
as evenly as possible), or as the paper's Table 5 assigned them (`assignment = "paper"`, keeping
the tasks converted here). Few-shot splits are drawn once per (task, seeds, k) and cached by the
content of the source files (`fedsilo.tasks.prepared`).
"""
from __future__ import annotations

import dataclasses
import random
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from fedsilo.datafetch import DataError, require_files, warn_if_unpinned
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.sources.load import Loaded, all_problems, load_accepted, load_rows
from fedsilo.sources.read import Problem
from fedsilo.tasks.prepared import cache_path, ignored, package_version, read_cache, write_cache

from .catalog import CATALOG, PAPER_CLIENTS, Pools, Record, TaskInfo
from .converters import load_all
from .fewshot import FewShot, sample_seeds
from .metrics import rouge_l
from .reading import RECORD_ERRORS

load_all()  # fills the catalogue

PREPARATION = "fewshot-v1"  # bump when sampling or a converter changes what it returns
SPLITS = ("train", "dev", "test")

def client_name(i: int) -> str:
    return f"client_{i + 1}"


def paper_tasks() -> list[str]:
    """The catalogue's tasks that are among the paper's, in catalogue order."""
    return [name for name in CATALOG if CATALOG.get(name).in_paper]


def assign(tasks: Sequence[str], clients: int, seed: int, tasks_per_client: int | None = None,
           mode: str = "random") -> dict[str, list[str]]:
    """client name → its tasks. `random`: shuffle with `seed`, keep `clients × tasks_per_client` if
    given, deal round-robin (sizes differ by at most one). `paper`: Table 5's clients, restricted to
    `tasks` (and to `tasks_per_client` each, in Table 5's order)."""
    if mode == "paper":
        if clients != len(PAPER_CLIENTS):
            raise ValueError(f"assignment 'paper' has {len(PAPER_CLIENTS)} clients, not {clients}")
        wanted = set(tasks)
        out = {client_name(i): [t for t in listed if t in wanted][:tasks_per_client]
               for i, listed in enumerate(PAPER_CLIENTS)}
    else:
        order = list(tasks)
        random.Random(seed).shuffle(order)
        if tasks_per_client is not None:
            need = clients * tasks_per_client
            if need > len(order):
                raise ValueError(f"{clients} clients × {tasks_per_client} tasks need {need} tasks; "
                                 f"{len(order)} are selected")
            order = order[:need]
        out = {client_name(i): order[i::clients] for i in range(clients)}
    empty = [c for c, ts in out.items() if not ts]
    if empty:
        raise ValueError(f"{empty[0]} gets no task: {len(tasks)} tasks for {clients} clients")
    return out


def task_files(names: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(f for name in names for f in CATALOG.get(name).files))


def verify_data_dir(names: Sequence[str], data_dir: Path) -> None:
    require_files("multitask", data_dir, task_files(names))
    warn_if_unpinned("multitask", data_dir, task_files(names))


def load_fewshot(root: Path, name: str, seeds: Sequence[int], k_per_class: int, k_total: int) -> FewShot:
    """One task's few-shot splits (cached)."""
    info = CATALOG.get(name)
    k = k_per_class if info.per_class else k_total
    files = [Path(root) / f for f in info.files]
    path = cache_path("multitask", name, files,
                      [PREPARATION, f"seeds={list(seeds)}", f"k={k}", package_version("numpy")])
    cached = read_cache(path)
    if _well_formed(cached):
        return FewShot(*([Record(r[0], tuple(r[1])) for r in cached[s]] for s in SPLITS))
    if cached is not None:
        ignored(path, "not a few-shot splits file")
    shots = sample_seeds(_convert(info, Path(root)), info.per_class, k, seeds)
    _check(info, shots, root)
    write_cache(path, {s: [[r.input, list(r.outputs)] for r in getattr(shots, s)] for s in SPLITS})
    return shots


def own_records(loaded: Loaded) -> dict[str, list[Record]]:
    """An own silo's rows as records (outputs: the references, the first one the training target)."""
    def outputs(value) -> tuple[str, ...]:
        return tuple(value) if isinstance(value, list) else (value,)
    return {split: [Record(r.values["input"], outputs(r.values["output"])) for r in rows]
            for split, rows in loaded.splits.items()}


def unscorable(loaded: Loaded, source, rouge: str) -> list[Problem]:
    """Rows whose references cannot be scored, found before training rather than at the first
    evaluation: a dev or test reference the source's ROUGE-L cannot score at all (`rouge = "crossfit"`:
    one without a word). An empty reference is the reader's problem already (it would reward an empty
    prediction)."""
    out = []
    for split, rows in loaded.splits.items():
        for r in rows:
            refs = r.values["output"] if isinstance(r.values["output"], list) else [r.values["output"]]
            for ref in (refs if source.metric == "rouge_l" and split != "train" else ()):
                try:
                    rouge_l("x", ref, rouge)
                except ValueError:
                    out.append(Problem(r.where, f"reference {ref!r} has no word ROUGE-L ({rouge}) can score"))
                    break
    return out


def _without(loaded: Loaded, problems: list[Problem]) -> Loaded:
    bad = {p.where for p in problems}
    return dataclasses.replace(loaded, splits={s: [r for r in rows if r.where not in bad]
                                               for s, rows in loaded.splits.items()})


def own_shots(settings, silo: str) -> FewShot:
    """An own silo's splits as given (malformed rows refused or skipped as its source says)."""
    source = settings.own_source(silo)
    def convert(loaded: Loaded):
        problems = unscorable(loaded, source, settings.rouge)
        return own_records(_without(loaded, problems)), problems

    records = load_accepted(silo, source, convert)
    return FewShot(*(records[s] for s in SPLITS))


def inspect_silo(settings, silo: str, data_dir: Path | None) -> SiloCheck:
    """`fedsilo data check`'s view of one client: its tasks' examples (an own silo's rows, every
    malformed one listed), grouped by input."""
    def items(records, where=None) -> list[Item]:
        return [Item(w or "", r.input, (r.input, r.outputs)) for r, w in zip(records, where or [None] * len(records))]

    source = settings.own_source(silo)
    if source is None:
        names = settings.assignment_map()[silo]
        shots = {name: load_fewshot(Path(data_dir), name, settings.sample_seeds, settings.k_per_class,
                                    settings.k_total) for name in names}
        splits = {s: [it for name in names for it in items(getattr(shots[name], s))] for s in SPLITS}
        return inspect_items(silo, f"benchmark, {len(names)} tasks", "examples", splits, "input",
                             files=[Path(data_dir) / f for f in task_files(names)])
    loaded = load_rows(silo, source)
    problems = unscorable(loaded, source, settings.rouge)
    kept = _without(loaded, problems)
    records = own_records(kept)
    splits = {s: items(records[s], [r.where for r in kept.splits[s]]) for s in SPLITS}
    return inspect_items(silo, source.format_name, "examples", splits, "input", all_problems(loaded, problems),
                         source.bad_rows == "skip", loaded.files)


def _convert(info: TaskInfo, root: Path) -> Pools:
    """The task's pools. fedsilo's converters name the file and line of a malformed record; what
    another converter (a plug-in's) raises on one still names the task and its files, in one line."""
    try:
        return info.convert(root)
    except DataError:
        raise
    except (*RECORD_ERRORS, zipfile.BadZipFile, tarfile.TarError, EOFError) as err:
        raise DataError(f"multitask task {info.name}: cannot convert {', '.join(str(root / f) for f in info.files)} "
                        f"({type(err).__name__}: {' '.join(str(err).split())})") from None


def _well_formed(payload) -> bool:
    return (isinstance(payload, dict) and all(isinstance(payload.get(s), list) for s in SPLITS)
            and all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and isinstance(r[1], list)
                    for s in SPLITS for r in payload[s]))


def _check(info: TaskInfo, shots: FewShot, root: Path) -> None:
    empty = [s for s in SPLITS if not getattr(shots, s)]
    if empty:
        raise DataError(f"multitask task {info.name}: no {' / '.join(empty)} examples from "
                        f"{', '.join(str(Path(root) / f) for f in info.files)}")
