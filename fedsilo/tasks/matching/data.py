"""A matching silo's questions, wherever they come from: an own source's rows (gathered by
question; labelled, or given BM25-mined negatives), else a benchmark silo (benchmark.py); and
`fedsilo data check`'s view of one silo.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.sources.load import Loaded, all_problems, group_key, load_accepted, load_rows
from fedsilo.sources.read import Problem

from .benchmark import load_silo, required_files
from .plugin import MatchingSettings
from .questions import SPLITS, Question, judged_question, mine_negatives

__all__ = ["silo_questions", "own_questions", "question_items", "inspect_silo"]


def silo_questions(settings: MatchingSettings, silo: str, data_dir: Path | None) -> dict[str, list[Question]]:
    """A silo's questions per split: its own source's (malformed rows refused or skipped as the
    source says), else the benchmark silo's from `data_dir`."""
    source = settings.own_source(silo)
    if source is None:
        return load_silo(data_dir, silo, settings.negatives)
    return load_accepted(silo, source, lambda loaded: own_questions(loaded, settings.negatives))


def own_questions(loaded: Loaded, negatives: int) -> tuple[dict[str, list[Question]], list[Problem]]:
    """Rows as questions (gathered by question text, case and spacing aside; a row with lists is a
    question of its own) and the rows that cannot be one (a label not 0/1, lists of unequal
    length, a label missing where others have one). A source with no label at all holds correct
    answers only: each question gets the `negatives` answers of the silo BM25 ranks highest for it."""
    labelled = any("label" in r.values for rows in loaded.splits.values() for r in rows)
    problems: list[Problem] = []
    out: dict[str, list[Question]] = {}
    for split, rows in loaded.splits.items():
        asked: dict[str, tuple[str, str, list[tuple[str, int]]]] = {}  # key → (qid, text, judged)
        for r in rows:
            judged = _judged(r, labelled, problems)
            if judged is None:
                continue
            key = group_key(r.values["question"]) if not isinstance(r.values["candidate"], list) else r.where
            asked.setdefault(key, (loaded.place(r.where), r.values["question"], []))[2].extend(judged)
        out[split] = [judged_question(qid, text, judged) for qid, text, judged in asked.values()]
    if not labelled:
        pool = list(dict.fromkeys(c for qs in out.values() for q in qs for c in q.candidates))
        out = {split: mine_negatives([(q.qid, q.text, list(q.candidates)) for q in qs], pool, negatives)
               for split, qs in out.items()}
    return out, problems


def _judged(row, labelled: bool, problems: list[Problem]) -> list[tuple[str, int]] | None:
    """A row's (candidate, label) pairs, or None (and a problem) when it is malformed."""
    candidates, label = row.values["candidate"], row.values.get("label")
    many = isinstance(candidates, list)
    if not labelled:
        return [(c, 1) for c in (candidates if many else [candidates])]
    if label is None:
        problems.append(Problem(row.where, "no label (other rows of the source have one: label every row, or none)"))
        return None
    labels = label if isinstance(label, list) else [label]
    if not many:
        candidates = [candidates]
    if len(labels) != len(candidates):
        problems.append(Problem(row.where, f"{len(candidates)} candidates but {len(labels)} labels"))
        return None
    values = [_label_value(x) for x in labels]
    bad = next((x for x, v in zip(labels, values) if v is None), None)
    if bad is not None:
        problems.append(Problem(row.where, f"label {bad!r} is not 0 or 1 (nor true/false, yes/no)"))
        return None
    return list(zip(candidates, values))


_LABELS = {"1": 1, "0": 0, "true": 1, "false": 0, "yes": 1, "no": 0, "1.0": 1, "0.0": 0}


def _label_value(text: str) -> int | None:
    return _LABELS.get(text.strip().lower())


def question_items(questions: Iterable[Question], folder: Path | None = None) -> list[Item]:
    """Questions as `fedsilo data check` compares them: grouped by question text; an own question's
    id (its file:line within the silo's `folder`) is shown as the full path, to be found."""
    return [Item(str(folder / q.qid) if folder else q.qid, q.text, (q.text, q.candidates, q.labels)) for q in questions]


def inspect_silo(settings: MatchingSettings, silo: str, data_dir: Path | None) -> SiloCheck:
    """`fedsilo data check`'s view of one silo (every malformed row listed, none refused here)."""
    source = settings.own_source(silo)
    if source is None:
        splits = load_silo(data_dir, silo, settings.negatives)
        check = inspect_items(silo, "benchmark", "questions", {s: question_items(v) for s, v in splits.items()},
                              "question", files=[Path(data_dir) / f for f in required_files([silo])])
    else:
        loaded = load_rows(silo, source)
        splits, problems = own_questions(loaded, settings.negatives)
        check = inspect_items(silo, source.format_name, "questions",
                              {s: question_items(v, loaded.folder) for s, v in splits.items()}, "question",
                              all_problems(loaded, problems), source.bad_rows == "skip", loaded.files,
                              rows=loaded.splits)  # a repeated row vanishes in its gathered question
        if not any("label" in r.values for rows in loaded.splits.values() for r in rows):
            check.notes.append(f"no label in any row (column {source.column('label')!r}): every candidate is taken "
                               f"as correct, and {settings.negatives} BM25-mined answers per question as wrong; if "
                               "the file has a label column of another name, map it with fields.label")
    for split in SPLITS:
        qs = splits[split]
        rankable = sum(0 < sum(q.labels) < len(q.labels) for q in qs)
        if qs and rankable < len(qs):
            check.notes.append(f"{split}: {len(qs) - rankable} of {len(qs)} questions lack a relevant or an "
                               "irrelevant candidate (left out of training and of MAP/MRR)")
        if qs and not rankable:
            check.counts[split] = 0  # nothing the run can use: blocking, as the run would refuse it
    return check
