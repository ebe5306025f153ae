"""`fedsilo init DATA_DIR --task NAME`: a commented config for a folder holding one sub-folder (or
file) per silo. What can be told from the files is filled in (format from the suffix, files per
split from their names, fields from the header or the first JSON object, a schema or database
beside text-to-SQL rows); what cannot is written as a `DECIDE` line for the user, never guessed
silently. The config is validated before it is written.
"""
from __future__ import annotations

import csv
import datetime
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fedsilo.errors import UserError
from fedsilo.tasks import TASKS, SILO_NAME

DATA_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl"}
SPLIT_NAMES = {"train": "train", "training": "train", "dev": "dev", "valid": "dev", "validation": "dev",
               "val": "dev", "test": "test", "testing": "test"}
DECIDE = "??"  # a column nobody has: `fedsilo data check` names it until the user decides


@dataclass
class Guess:
    """One silo's entry as detected: config lines, and what the user must decide."""
    name: str
    entry: dict = field(default_factory=dict)
    comments: dict[str, str] = field(default_factory=dict)  # key → comment after it
    decide: list[str] = field(default_factory=list)


def init_config(data_dir: Path, task: str, out: Path) -> tuple[str, list[Guess]]:
    """The config text for `data_dir`'s silos (paths relative to `out`'s folder) and the guesses."""
    if task not in TASKS:
        raise UserError(f"--task {task!r} is not a task: {', '.join(TASKS)}")
    settings = TASKS.entry(task).settings
    if settings.SOURCE is None:
        raise UserError(f"task {task!r} takes no own silos (it has no [task.sources])")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"{data_dir} is not a folder (expected one sub-folder or file per silo)")
    entries = sorted(p for p in data_dir.iterdir() if not p.name.startswith(".") and p.suffix != ".toml")
    if not entries:
        raise UserError(f"{data_dir} is empty: put one sub-folder (or file) per silo in it")
    guesses = [guess_silo(p, settings.SOURCE.ROLES, task, out.parent.resolve()) for p in entries]
    taken = [g.name for g in guesses if g.name in settings.BENCHMARK]
    if taken:
        raise UserError(f"{', '.join(taken)}: the name of a benchmark silo; rename the folder or file")
    return render(task, data_dir, guesses), guesses


def _silo_name(path: Path) -> str:
    name = path.stem if path.is_file() else path.name
    clean = "".join(c if c.isalnum() or c in "_-." else "_" for c in name).strip("._-") or "silo"
    if not SILO_NAME.fullmatch(clean):
        clean = ("s" + clean)[:64]
    return clean


def guess_silo(path: Path, roles, task: str, base: Path) -> Guess:
    g = Guess(_silo_name(path))
    rel = lambda p: os.path.relpath(Path(p).resolve(), base)  # noqa: E731
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if task == "text2sql":
        files = _sql_extras(files, g, rel)
    tables = [p for p in files if p.suffix.lower() in DATA_SUFFIXES]
    by_split: dict[str, Path] = {}
    for p in tables:
        split = SPLIT_NAMES.get(p.stem.lower())
        if split and split not in by_split:
            by_split[split] = p
    lines = _aligned(files) if not tables else {}
    if lines:
        return _lines_guess(g, path, lines, roles, rel)
    if not tables:
        g.entry["path"] = rel(path)
        g.decide.append(f"no .csv, .tsv or .jsonl file found in {path}: set path, format and fields")
        g.entry["format"] = DECIDE
        return g
    if by_split and "train" in by_split:
        g.entry["path"] = rel(path)
        g.entry["format"] = DATA_SUFFIXES[by_split["train"].suffix.lower()]
        g.entry["files"] = {s: by_split[s].name for s in ("train", "dev", "test") if s in by_split}
        cut = [s for s in ("dev", "test") if s not in by_split]
        if cut:
            g.entry["split"] = {s: 0.1 for s in cut} | {"seed": 0}
            g.comments["split"] = f"{' and '.join(cut)} cut from train, grouped by {roles.key}"
        sample = by_split["train"]
    else:
        sample = tables[0]
        if len(tables) > 1:
            g.decide.append(f"{len(tables)} data files and none named train/dev/test: {sample.name} is used; "
                            "name them train/dev/test to use each as a split")
        g.entry["path"] = rel(sample)
        g.entry["format"] = DATA_SUFFIXES[sample.suffix.lower()]
        g.entry["split"] = {"dev": 0.1, "test": 0.1, "seed": 0}
        g.comments["split"] = f"one file: 10% dev, 10% test, grouped by {roles.key} (no {roles.key} in two splits)"
    columns = _columns(sample, g.entry["format"])
    _map_fields(g, roles, columns, sample)
    return g


def _sql_extras(files: list[Path], g: Guess, rel) -> list[Path]:
    """A text-to-SQL silo's database (.sqlite/.db) and schema (.sql, or a CSV named *schema*)."""
    rest = []
    for p in files:
        low = p.name.lower()
        if p.suffix.lower() in (".sqlite", ".sqlite3", ".db"):
            g.entry.setdefault("database", rel(p))
        elif p.suffix.lower() == ".sql" or (low.endswith(".csv") and "schema" in low):
            g.entry.setdefault("schema_file", rel(p))
        else:
            rest.append(p)
    if "database" not in g.entry and "schema_file" not in g.entry:
        g.entry["schema_file"] = DECIDE
        g.decide.append("no schema found: set schema_file (CREATE TABLE statements, .sql) or database (SQLite)")
    return rest


def _aligned(files: list[Path]) -> dict[str, list[Path]]:
    """stem → files sharing it with other suffixes (train.de, train.en): line-aligned files."""
    stems: dict[str, list[Path]] = {}
    for p in files:
        if p.suffix and p.suffix.lower() not in DATA_SUFFIXES:
            stems.setdefault(p.stem, []).append(p)
    return {s: ps for s, ps in stems.items() if len(ps) >= 2}


def _lines_guess(g: Guess, path: Path, stems: dict[str, list[Path]], roles, rel) -> Guess:
    g.entry["format"] = "lines"
    suffixes = sorted({p.suffix[1:] for ps in stems.values() for p in ps})
    fields = {}
    for role in roles.required:
        match = next((s for s in suffixes if s.lower() in roles.names_for(role)), None)
        fields[role] = match or DECIDE
        if match is None:
            g.decide.append(f"fields.{role}: which file suffix holds the {role} ({', '.join(suffixes)})")
    g.entry["fields"] = fields
    by_split = {SPLIT_NAMES[s.lower()]: s for s in stems if s.lower() in SPLIT_NAMES}
    if "train" in by_split:
        g.entry["path"] = rel(path)
        g.entry["files"] = {s: by_split[s] for s in ("train", "dev", "test") if s in by_split}
        cut = [s for s in ("dev", "test") if s not in by_split]
        if cut:
            g.entry["split"] = {s: 0.1 for s in cut} | {"seed": 0}
    else:
        stem = sorted(stems)[0]
        g.entry["path"] = rel(path / stem)
        g.entry["split"] = {"dev": 0.1, "test": 0.1, "seed": 0}
        g.comments["split"] = f"one corpus: 10% dev, 10% test, grouped by {roles.key}"
    g.comments["fields"] = "role = file suffix (PREFIX.SUFFIX, line i of each is one example)"
    return g


def _columns(path: Path, fmt: str) -> list[str]:
    """The header's columns (csv/tsv) or the first JSON object's keys (jsonl); [] when unreadable."""
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            head = f.read(1 << 16)
    except OSError:
        return []
    if fmt == "jsonl":
        for line in head.splitlines():
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return []
                return list(obj) if isinstance(obj, dict) else []
        return []
    first = next(csv.reader(io.StringIO(head), delimiter="\t" if fmt == "tsv" else ","), [])
    return [c.strip() for c in first]


def _map_fields(g: Guess, roles, columns: list[str], sample: Path) -> None:
    fields, lowered = {}, {c.lower(): c for c in columns}
    for role in roles.all:
        match = next((lowered[n] for n in roles.names_for(role) if n in lowered), None)
        if match is None:
            if role in roles.required:
                fields[role] = DECIDE
                g.decide.append(f"fields.{role}: which column of {sample.name} holds the {role} "
                                f"(columns: {', '.join(columns) or 'none found'})")
            elif role == "label":
                g.comments["fields"] = ("no label column found: every candidate is a correct answer, and "
                                        "task.negatives BM25-mined answers are the wrong ones")
        elif match != role:
            fields[role] = match
    if fields:
        g.entry["fields"] = fields


def _toml(value) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


_TASK_LINES = {
    "translation": ['tokenizer_domain = "news"  # DECIDE: the subword vocabulary is fitted on this silo\'s training text '
                    'only: "news" (public WMT text, fetched with `fedsilo data translation`), or one of your silos '
                    '(its vocabulary is then shared with every silo)'],
    "matching": ["# negatives = 5          # BM25-mined wrong answers per question, for silos without labels"],
    "text2sql": ["# max_target_length = 128  # SQL tokens (+ EOS); `fedsilo data check` says how many fit"],
    "multitask": [],
}


def render(task: str, data_dir: Path, guesses: list[Guess]) -> str:
    when = datetime.date.today().isoformat()
    out = [f"# Written by `fedsilo init {data_dir} --task {task}` on {when}: one silo per entry of {data_dir}.",
           "# Paths are relative to this file's folder. Lines marked DECIDE need your choice.",
           "# Next: `fedsilo data check THIS.toml` (every row checked), then `fedsilo run THIS.toml`.",
           "# docs/your-data.md explains every key.",
           f"name = {_toml(data_dir.resolve().name or 'mine')}", "",
           "[task]", f"name = {_toml(task)}",
           f"silos = {_toml([g.name for g in guesses])}  # add benchmark silos by name to mix them in",
           *_TASK_LINES.get(task, []), ""]
    for g in guesses:
        out.append(f"[task.sources.{g.name}]")
        for d in g.decide:
            out.append(f"# DECIDE: {d}")
        for key, value in g.entry.items():
            comment = f"  # {g.comments[key]}" if key in g.comments else ""
            out.append(f"{key} = {_toml(value)}{comment}")
        out += [f"# {text}" for key, text in g.comments.items() if key not in g.entry]
        if task == "multitask":
            out.append('metric = "em"  # DECIDE: acc or macro_f1 (labels), em or qa_f1 (short answers), '
                       'rouge_l (generation), mcc')
        out.append("# display = \"...\"  # the silo's name in tables")
        out.append("")
    out += ["[federation]", "rounds = 3", "", *_CLIENT.get(task, ["[client]"]), ""]
    return "\n".join(out)


# Each task's client settings as its CPU-scale study ran them (a start, not a tuned choice for your data).
_CLIENT = {
    "matching": ["[client]  # as docs/qa-study.md's runs (MiniLM cross-encoder); tune lr on your dev split",
                 'optimizer = "adamw"', "lr = 5e-4", 'lr_schedule = "linear"  # warm-up, then linear decay to 0 ...',
                 "warmup = 0.1", 'schedule_span = "run"  # ... over the whole run', "batch_size = 8", "epochs = 1"],
    "translation": ["[client]  # as docs/nmt-study.md's runs (a Transformer from scratch)", 'optimizer = "adamw"',
                    "lr = 1e-3", "batch_size = 32", "steps = 40  # optimiser steps per round"],
    "multitask": ["[client]  # as experiments/multitask/study.toml (minilm2bert)", 'optimizer = "adamw"',
                  "lr = 1e-4", "batch_size = 8", "epochs = 1"],
    "text2sql": ["[client]  # as experiments/lorar/small.toml (the Lorar paper: Adafactor)", 'optimizer = "adafactor"',
                 "lr = 3e-3", "epochs = 2", "batch_size = 8"],
}
