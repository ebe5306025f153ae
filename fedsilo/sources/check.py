"""What `fedsilo data check` says about one silo: malformed rows by file:line, examples per split,
exact duplicates within a split (of rows as read, where a task gathers rows into one example),
keys (sources, questions) shared between splits, how many texts fit the model's length limits, and
each file's fingerprint. Blocking: a malformed row the source does not skip, or an empty split; the
rest are warnings a user should read before training.

A key is shared only when it is the same text: keys equal once case and spacing are folded are
listed apart, since case can carry meaning (German "Sie", formal you, against "sie", her/them).
Every key is shown as written, with its file:line, so it can be searched for in the file.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .fingerprint import fingerprints
from .load import group_key
from .read import Problem, Row
from .settings import SPLITS

SHOWN = 20  # problems, duplicates, overlaps listed per silo


@dataclass(frozen=True)
class Item:
    """One example as the check sees it: where it comes from, the text that groups it (the source,
    the question), and its whole content (equal contents are duplicates)."""
    where: str
    key: str
    content: tuple


@dataclass(frozen=True)
class Shared:
    """A key of a later split also in an earlier one: as written in the later split, where each is."""
    text: str
    where: str   # file:line in the later split ("" for a benchmark's prepared example)
    first: str   # file:line in the earlier split

    def shown(self) -> str:
        places = " and ".join(p for p in (self.where, self.first) if p)
        return f"{self.text[:60]!r}" + (f" ({places})" if places else "")


@dataclass(frozen=True)
class Lengths:
    """Token lengths of one kind of text against the setting that cuts it."""
    what: str        # e.g. "target tokens (+ EOS)"
    setting: str     # e.g. "task.max_target_length"
    limit: int
    values: tuple[int, ...]

    @property
    def fit(self) -> int:
        return sum(v <= self.limit for v in self.values)

    def line(self) -> str:
        v = sorted(self.values)
        if not v:
            return f"{self.what}: none"
        p95 = v[min(len(v) - 1, int(0.95 * len(v)))]
        cut = len(v) - self.fit
        return (f"{self.what}: median {statistics.median(v):g}, p95 {p95}, max {v[-1]}; {self.fit}/{len(v)} "
                f"({100 * self.fit / len(v):.1f}%) of the run's texts fit {self.setting} = {self.limit}"
                + (f"; {cut} longer would be cut to it" if cut else ""))


@dataclass
class SiloCheck:
    name: str
    kind: str                                   # "benchmark" or the own files' format
    unit: str                                   # what a count counts ("pairs", "questions")
    counts: dict[str, int]
    problems: list[Problem] = field(default_factory=list)
    skip_bad: bool = False                      # bad_rows = "skip": problems leave rows out, not the run
    duplicates: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # split → (where, first seen)
    overlap: dict[str, list[Shared]] = field(default_factory=dict)               # "train/test" → shared keys
    folded: dict[str, list[Shared]] = field(default_factory=dict)                # equal up to case/spacing only
    key_name: str = "key"
    files: dict[str, dict] = field(default_factory=dict)
    lengths: list[Lengths] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None                    # why the silo's rows could not be read or split at all

    @classmethod
    def failed(cls, name: str, kind: str, error: str) -> "SiloCheck":
        """A silo whose data error (a split without enough groups, an unreadable file) stops it: one
        blocking row of the report, so the other silos are still checked."""
        return cls(name, kind, "", {}, error=error.removeprefix(f"silo {name}: "))

    @property
    def empty_splits(self) -> list[str]:
        return [s for s in SPLITS if not self.counts.get(s)]

    @property
    def blocking(self) -> bool:
        return bool((self.problems and not self.skip_bad) or self.empty_splits or self.error)

    def lines(self) -> list[str]:
        if self.error:
            return [f"silo {self.name} ({self.kind}): cannot be run: {self.error}"]
        out = [f"silo {self.name} ({self.kind}): " + ", ".join(f"{self.counts.get(s, 0)} {s}" for s in SPLITS)
               + f" {self.unit}"]
        if self.problems:
            verb = "left out (bad_rows = \"skip\")" if self.skip_bad else "stop a run"
            out.append(f"  {len(self.problems)} malformed row(s), which {verb}:")
            out += [f"    {p}" for p in self.problems[:SHOWN]]
            if len(self.problems) > SHOWN:
                out.append(f"    ... and {len(self.problems) - SHOWN} more")
        for s in self.empty_splits:
            out.append(f"  no {s} {self.unit}: a run needs every split")
        for split, dups in self.duplicates.items():
            out.append(f"  {len(dups)} exact duplicate(s) in {split} (kept as they are):")
            out += [f"    {where} repeats {first}" if where != first else f"    {where} again"  # no file:line: the text
                    for where, first in dups[:SHOWN // 4]]
        for pair, keys in self.overlap.items():
            out.append(f"  {len(keys)} {self.key_name}(s) in both {pair} (evaluation sees them in training): "
                       + "; ".join(k.shown() for k in keys[:3]))
        for pair, keys in self.folded.items():
            out.append(f"  {len(keys)} {self.key_name}(s) of {pair.split('/')[1]} equal to a {pair.split('/')[0]} "
                       "one only up to case or spacing (not counted as seen: case can change the meaning): "
                       + "; ".join(k.shown() for k in keys[:3]))
        out += [f"  {length.line()}" for length in self.lengths]
        out += [f"  {note}" for note in self.notes]
        for path, fp in self.files.items():
            out.append(f"  file {path}: {fp['bytes']} bytes, sha256 {fp['sha256'][:16]}")
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "unit": self.unit, "counts": self.counts,
                "problems": [str(p) for p in self.problems], "skip_bad": self.skip_bad,
                "duplicates": {s: len(d) for s, d in self.duplicates.items()},
                "overlap": {p: len(k) for p, k in self.overlap.items()},
                "overlap_up_to_case": {p: len(k) for p, k in self.folded.items()}, "blocking": self.blocking,
                "error": self.error,
                "lengths": [{"what": x.what, "setting": x.setting, "limit": x.limit, "n": len(x.values),
                             "fit": x.fit, "max": max(x.values, default=0)} for x in self.lengths],
                "files": self.files}


def inspect_items(name: str, kind: str, unit: str, splits: Mapping[str, Sequence[Item]], key_name: str,
                  problems: Sequence[Problem] = (), skip_bad: bool = False,
                  files: Sequence[Path] = (), rows: Mapping[str, Sequence[Row]] | None = None) -> SiloCheck:
    """Counts, duplicates and overlap of one silo's items per split, with its files' fingerprints.
    With `rows` (an own source's rows as read), duplicates are repeated rows: a task that gathers
    rows into one example (a question's judged answers) would otherwise hide a repeated one."""
    out = SiloCheck(name, kind, unit, {s: len(splits.get(s, ())) for s in SPLITS}, list(problems), skip_bad,
                    key_name=key_name, files=fingerprints(files))
    for split in SPLITS:
        entries = ([(r.where, _row_content(r)) for r in rows.get(split, ())] if rows is not None else
                   [(item.where or repr(item.key[:60]), item.content) for item in splits.get(split, ())])
        dups = _repeats(entries)  # a benchmark's prepared example has no file:line: its text says where
        if dups:
            out.duplicates[split] = dups
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        exact, folded = {}, {}  # key → where first seen in split a
        for item in splits.get(a, ()):
            exact.setdefault(item.key, item.where)
            folded.setdefault(group_key(item.key), item.where)
        same, near, done = [], [], set()
        for item in splits.get(b, ()):
            if item.key in done:
                continue
            done.add(item.key)
            if item.key in exact:
                same.append(Shared(item.key, item.where, exact[item.key]))
            elif group_key(item.key) in folded:
                near.append(Shared(item.key, item.where, folded[group_key(item.key)]))
        if same:
            out.overlap[f"{a}/{b}"] = same
        if near:
            out.folded[f"{a}/{b}"] = near
    return out


def _repeats(entries: Sequence[tuple[str, tuple]]) -> list[tuple[str, str]]:
    """(where, where first seen) of every entry whose content came before."""
    seen: dict[tuple, str] = {}
    out = []
    for where, content in entries:
        if content in seen:
            out.append((where, seen[content]))
        else:
            seen[content] = where
    return out


def _row_content(row: Row) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in row.values.items()))
