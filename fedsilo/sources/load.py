"""One source's rows per split: its files read (`read`), and the splits it does not give cut from
train by a seeded draw of whole groups (rows sharing the `split.by` text), so no key crosses splits.
"""
from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fedsilo.errors import DataError

from .read import Problem, QuotingDataError, Row, lines_file, place_of, places, read_rows
from .settings import SPLITS, SourceSettings

SHOWN_PROBLEMS = 5  # in a run's error; `fedsilo data check` lists them all


@dataclass
class Loaded:
    name: str
    splits: dict[str, list[Row]]
    problems: list[Problem] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    folder: Path | None = None  # the silo's folder, which `place` tells a row's file relative to

    def place(self, where: str) -> str:
        """`where` (file:line) with the file relative to the silo's folder: the same wherever the
        folder lives, so an id made of it (a question's, which seeds its pair draw) does not change
        the results when the folder is copied or mounted elsewhere."""
        if self.folder is None:
            return where
        path, _, line = where.rpartition(":")
        return f"{Path(os.path.relpath(path, self.folder)).as_posix()}:{line}"


def group_key(text: str) -> str:
    """Texts that differ only in case or spacing are one group (one question asked twice)."""
    return " ".join(text.split()).casefold()


def source_files(source: SourceSettings) -> list[Path]:
    """Every file the source reads, in split order (for `lines`: one per role)."""
    base = Path(source.path)
    stems = [base / source.files[s] for s in SPLITS if s in source.files] if source.files else [base]
    if source.format_name != "lines":
        return stems
    roles = [r for r in source.ROLES.all if r in source.ROLES.required or r in source.fields]
    return [lines_file(stem, source.column(r)) for stem in stems for r in roles
            if r in source.ROLES.required or os.path.lexists(lines_file(stem, source.column(r)))]


def load_rows(name: str, source: SourceSettings) -> Loaded:
    """Rows per split, and every malformed row as a problem (see `accept`)."""
    base = Path(source.path)
    if source.files and not base.is_dir():
        raise DataError(f"silo {name}: path {base} is not a folder (its files {', '.join(source.files.values())} "
                        "are read from it)")
    out = Loaded(name, {}, files=source_files(source), folder=base if source.files else base.parent)
    wanted = {s: base / source.files[s] for s in SPLITS if s in source.files} if source.files else {"train": base}
    for split, path in wanted.items():
        rows, problems = _read(name, source, path)
        out.splits[split] = rows
        out.problems += problems
    cut = [s for s in ("dev", "test") if s not in out.splits]
    if cut and not out.splits["train"] and out.problems:
        _nothing_read(name, wanted["train"], out.problems)
    if cut:
        out.splits.update(split_by_fraction(name, out.splits.pop("train"), source, cut))
    out.splits = {s: out.splits[s] for s in SPLITS}
    return out


def _read(name: str, source: SourceSettings, path: Path) -> tuple[list[Row], list[Problem]]:
    """`read_rows`, a file's error naming the silo too: a run reads several silos' files."""
    try:
        return read_rows(source, path)
    except QuotingDataError as err:
        raise QuotingDataError(f"silo {name}: {err}", f"silo {name}: {err.public}") from None
    except DataError as err:
        raise DataError(f"silo {name}: {err}") from None


def _nothing_read(name: str, path: Path, problems: list[Problem]) -> None:
    """A file to split of malformed rows only (another layout: a JSON array, chat rows read as Alpaca
    ones) is named by its problems, not as too few rows to split."""
    raise QuotingDataError(f"silo {name}: no row read from {path}: {len(problems)} malformed row(s): {shown(problems)}",
                           f"silo {name}: no row read from {path}: {len(problems)} malformed row(s) at "
                           f"{places(problems, SHOWN_PROBLEMS)}")


def split_by_fraction(name: str, rows: list[Row], source: SourceSettings, cut: list[str]) -> dict[str, list[Row]]:
    """train plus the `cut` splits: each of those gets its share of the groups (rounded half up, at
    least one), drawn with `split.seed`; file order is kept within a split."""
    by = source.split_by()
    keys = groups(rows, by)
    sizes = _sizes(len(keys), source.split, cut)
    if sum(sizes.values()) >= len(keys):
        raise DataError(f"silo {name}: {len(keys)} distinct {by} value(s) in {source.path} cannot be split into "
                        f"train and {' and '.join(cut)}: the split groups rows by {by} (split.by: no {by} in two "
                        f"splits){_regroup_fix(name, rows, source, cut)}")
    drawn = random.Random(source.split.seed).sample(keys, len(keys))
    split_of, i = {}, 0
    for s in ("test", "dev"):
        for key in drawn[i:i + sizes.get(s, 0)]:
            split_of[key] = s
        i += sizes.get(s, 0)
    out: dict[str, list[Row]] = {"train": [], **{s: [] for s in cut}}
    for r in rows:
        out[split_of.get(group_key(_text(r.values.get(by, ""))), "train")].append(r)
    return out


def groups(rows: list[Row], by: str) -> list[str]:
    """The distinct `by` texts of `rows` (case and spacing folded), in file order: a split's groups."""
    return list(dict.fromkeys(group_key(_text(r.values.get(by, ""))) for r in rows))


def _sizes(n_groups: int, split, cut: list[str]) -> dict[str, int]:
    """Groups drawn for each `cut` split: its share, rounded half up, at least one."""
    return {s: max(1, int(n_groups * getattr(split, s) + 0.5)) for s in cut}


def splittable(n_groups: int, split, cut: list[str]) -> bool:
    """Whether `n_groups` groups give each `cut` split its share and leave train some."""
    return sum(_sizes(n_groups, split, cut).values()) < n_groups


def _regroup_fix(name: str, rows: list[Row], source: SourceSettings, cut: list[str]) -> str:
    """The fix of a split with too few groups: another role to group by where its values would split
    (an instruction silo's input, `Roles.regroup`), else more distinct rows or files per split."""
    by = source.split_by()
    for role in source.ROLES.regroup:
        n = len(groups(rows, role))
        if role != by and splittable(n, source.split, cut):
            return (f", and the rows' {role} differs ({n} distinct values): set split.by = \"{role}\" in "
                    f"[task.sources.{name}], or give files per split")
    return f": give rows with more distinct {by} values, or files per split"


def _text(value) -> str:
    return value if isinstance(value, str) else " ".join(value)


def shown(problems: list[Problem]) -> str:
    """The first problems, each with why (for the silo's own operator), and how many more."""
    more = f" (and {len(problems) - SHOWN_PROBLEMS} more)" if len(problems) > SHOWN_PROBLEMS else ""
    return "; ".join(str(p) for p in problems[:SHOWN_PROBLEMS]) + more


def all_problems(loaded: Loaded, more: list[Problem]) -> list[Problem]:
    """The reader's problems and a family's own (a label not 0/1) together, by file (in split order)
    and line: a run's error shows the first ones, also where a split cut from one file interleaves
    its lines."""
    files = {str(f): i for i, f in enumerate(loaded.files)}

    def key(p: Problem) -> tuple[int, int, int]:
        path, line, item = place_of(p.where)
        return files.get(path, len(files)), line, item
    return sorted(loaded.problems + more, key=key)


def load_accepted(name: str, source: SourceSettings, convert):
    """A source's examples as a run takes them: its rows read, `convert(loaded) -> (examples,
    the family's own problems)`, then every problem refused or skipped as the source says."""
    loaded = load_rows(name, source)
    out, problems = convert(loaded)
    accept(loaded, source, all_problems(loaded, problems))
    return out


def accept(loaded: Loaded, source: SourceSettings, problems: list[Problem] | None = None) -> None:
    """Malformed rows (`problems`, default the loaded ones) stop a run unless the source says
    bad_rows = "skip" (then they are left out, and a warning counts them)."""
    problems = loaded.problems if problems is None else problems
    if not problems:
        return
    if source.bad_rows == "skip":
        warnings.warn(f"silo {loaded.name}: {len(problems)} malformed row(s) left out (bad_rows = \"skip\"): "
                      f"{shown(problems)}", stacklevel=2)
        return
    fix = (f"`fedsilo data check CONFIG` lists every one; fix them, or set bad_rows = \"skip\" in "
           f"[task.sources.{loaded.name}] to leave them out")
    raise QuotingDataError(f"silo {loaded.name}: {len(problems)} malformed row(s): {shown(problems)}. {fix}",
                           f"silo {loaded.name}: {len(problems)} malformed row(s) at "
                           f"{places(problems, SHOWN_PROBLEMS)}. {fix}")
