"""Reading the eight text-to-SQL silos (Finegan-Dollak et al. 2018 format).

Each ``NAME.json`` holds query records: ``sql`` (variants; the first is used),
``variables`` (name/example/...) and ``sentences`` (text, split, values).
Every sentence becomes one :class:`Example` whose question and SQL have their
placeholders (``state_name0``) replaced by the sentence's values.
"""
from __future__ import annotations

import csv
import json
import re
import sqlite3
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fedsilo.datafetch import DataError, require_files, warn_if_unpinned
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.sources.load import Loaded, load_accepted, load_rows
from fedsilo.tasks.text2sql.plugin import DISPLAY, SILOS, SQLSource, Text2SQLSettings

__all__ = [
    "SILOS", "DISPLAY", "SPLITS", "EXEC_DB", "DataError", "Example", "substitute",
    "serialize_schema", "normalise_text", "normalise_sql", "load_silo", "silo_examples", "silo_database",
    "inspect_silo", "verify_data_dir",
]

SPLITS = ("train", "dev", "test")

EXEC_DB = {"geography": "geography-db.added-in-2020.sqlite"}
"""Silo -> SQLite file (in the text2sql data folder) usable for execution match.

Only GeoQuery: Restaurants also ships ``restaurants-db.added-in-2020.sqlite``,
but its RESTAURANT table names the key column ``RESTAURANT_ID`` where the
dataset's SQL says ``RESTAURANTalias0.ID``, so most gold queries fail there.
The other silos ship no database contents.
"""

# Large silos carry a named question split; small ones a cross-validation fold.
_NAMED_SPLIT = {"advising", "atis", "geography", "scholar"}
_FOLD_SPLIT = {**{str(f): "train" for f in range(6)}, "6": "dev", "7": "dev", "8": "test", "9": "test"}

# Canonical tokens: alphanumeric runs, and every other non-space character on its own.
_TOKEN = re.compile(r"[^\W_]+|[^\w\s]|_")


@dataclass(frozen=True)
class Example:
    """One question/SQL pair; ``source`` is the model input (question | schema)."""

    silo: str
    question: str
    sql: str
    source: str
    where: str = field(default="", compare=False)  # an own silo's file:line ("" for the benchmark's)


def silo_examples(settings: Text2SQLSettings, silo: str, data_dir: Path | None) -> dict[str, list[Example]]:
    """A silo's examples per split: its own source's (malformed rows refused or skipped as the
    source says), else the benchmark silo's from `data_dir`."""
    source = settings.own_source(silo)
    if source is None:
        return load_silo(data_dir, silo)
    return load_accepted(silo, source, lambda loaded: (own_examples(loaded, source), []))


def silo_database(settings: Text2SQLSettings, silo: str, data_dir: Path | None) -> Path | None:
    """The SQLite file execution match runs on, if the silo has one and it can serve (see
    `exec_notes`: warned about, then None)."""
    source = settings.own_source(silo)
    if source is not None:
        if not source.database:
            return None
        usable, notes = exec_notes(load_rows(silo, source), source)
        if not usable:
            warnings.warn(f"text2sql silo {silo}: {notes[-1]}", stacklevel=2)
            return None
        return Path(source.database)
    return Path(data_dir) / EXEC_DB[silo] if silo in EXEC_DB and data_dir is not None else None


def own_examples(loaded: Loaded, source: SQLSource) -> dict[str, list[Example]]:
    """Rows as examples: the question as written, the SQL in its canonical form, the schema after
    the question as the benchmark's inputs have it."""
    schema = own_schema(source)
    if source.database and source.schema_file:  # execution match runs on it: refused now, not after training
        _check_database(Path(source.database))
    return {split: [Example(loaded.name, r.values["question"], normalise_sql(r.values["sql"]),
                            f"{r.values['question']} | {schema}", r.where) for r in rows]
            for split, rows in loaded.splits.items()}


def own_schema(source: SQLSource) -> str:
    """The serialised schema: from the schema file (a benchmark-style CSV, or CREATE TABLE
    statements in a .sql file), else from the database."""
    if source.schema_file and Path(source.schema_file).suffix.lower() != ".sql":
        return serialize_schema(source.schema_file)
    conn = sqlite3.connect(":memory:")
    try:
        if source.schema_file:
            path = Path(source.schema_file)
            try:
                conn.executescript(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"cannot read schema file {path}: {e}") from None
            except sqlite3.Error as e:
                raise DataError(f"{path}: not SQL that SQLite can run ({e}); give CREATE TABLE statements") from None
            return _schema_of(conn, path)
    finally:
        conn.close()
    path = Path(source.database)
    _check_database(path)
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return _schema_of(conn, path)
    finally:
        conn.close()


def _schema_of(conn: sqlite3.Connection, where: Path) -> str:
    """'table: col, col | ...' (lower-case, the database's order) of every table."""
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                         "AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    if not tables:
        raise DataError(f"{where}: no tables in the schema")
    parts = []
    for table in tables:
        cols = [r[1].lower() for r in conn.execute(f"PRAGMA table_info({_quote(table)})")]
        parts.append(f"{table.lower()}: {', '.join(cols)}")
    return " | ".join(parts)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def example_items(examples) -> list[Item]:
    """Examples as `fedsilo data check` compares them: grouped by question."""
    return [Item(e.where, e.question, (e.question, e.sql)) for e in examples]


def inspect_silo(settings: Text2SQLSettings, silo: str, data_dir: Path | None) -> SiloCheck:
    """`fedsilo data check`'s view of one silo (every malformed row listed, none refused here)."""
    source = settings.own_source(silo)
    if source is None:
        splits = load_silo(data_dir, silo)
        names = [f"{silo}.json", f"{silo}-schema.csv"] + ([EXEC_DB[silo]] if silo in EXEC_DB else [])
        return inspect_items(silo, "benchmark", "examples", {s: example_items(v) for s, v in splits.items()},
                             "question", files=[Path(data_dir) / n for n in names])
    loaded = load_rows(silo, source)
    extra = [Path(p) for p in (source.schema_file, source.database) if p]
    check = inspect_items(silo, source.format_name, "examples",
                          {s: example_items(v) for s, v in own_examples(loaded, source).items()}, "question",
                          loaded.problems, source.bad_rows == "skip", loaded.files + extra)
    check.notes += exec_notes(loaded, source)[1]
    return check


def exec_notes(loaded: Loaded, source: SQLSource) -> tuple[bool, list[str]]:
    """(whether execution match can serve on the silo's database, what `fedsilo data check` says
    about its gold queries there)."""
    if not source.database:
        return False, []
    from .metrics import gold_results

    tried, empty, lost = gold_results(source.database, [r.values["sql"] for rows in loaded.splits.values()
                                                        for r in rows])
    notes = []
    if empty:
        notes.append(f"{empty} of {tried} gold queries tried return no rows on {source.database}: any prediction "
                     "that finds nothing matches them in execution")
    if lost:
        notes.append(f"execution match is off: {lost} of {tried} gold queries tried return rows as written but none "
                     f"in the lower-case form the model writes ({source.database} stores values with capitals, and "
                     "SQLite compares them case-sensitively); store the values in lower case, or declare the columns "
                     "COLLATE NOCASE")
    return not lost, notes


def normalise_text(text: str) -> str:
    """Canonical, tokenizer-independent form: lower-case, punctuation split off.

    Every non-alphanumeric, non-space character (underscore included) becomes
    its own token, as BERT's BasicTokenizer does, so a WordPiece decode whose
    tokens are joined by spaces reproduces this string exactly.
    """
    return " ".join(_TOKEN.findall(text.lower()))


normalise_sql = normalise_text
"""SQL targets and predictions share the text canonical form (exact match compares these)."""


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace placeholder names by values, longest names first.

    One regex pass with the alternatives ordered by length, so ``state_name10``
    wins over ``state_name1`` and an inserted value is never rescanned.
    """
    if not values:
        return text
    names = sorted(values, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, names)))
    return pattern.sub(lambda m: values[m.group(0)], text)


def serialize_schema(csv_path: str | Path) -> str:
    """``"table1: col1, col2 | table2: ..."`` (lower-case, file order) from ``NAME-schema.csv``.

    Only the first two columns are used: the column order after them differs
    between silos (Advising puts the type third, Yelp adds one).
    """
    path = Path(csv_path)
    tables: dict[str, list[str]] = {}
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, skipinitialspace=True))
    except OSError as e:
        raise DataError(f"cannot read schema file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a CSV text file ({e})") from None
    header = [c.strip().lower() for c in rows[0][:2]] if rows else []
    if header != ["table name", "field name"]:
        raise DataError(f"{path}: line 1: expected the header 'Table Name, Field Name, ...', "
                        f"got {rows[0] if rows else 'an empty file'!r}")
    for line_no, row in enumerate(rows[1:], start=2):
        cells = [c.strip() for c in row]
        if not any(cells) or cells[0] == "-":
            continue
        if len(cells) < 2 or not cells[0] or not cells[1]:
            raise DataError(f"{path}: line {line_no}: expected 'Table Name, Field Name, ...', got {row!r}")
        tables.setdefault(cells[0].lower(), []).append(cells[1].lower())
    if not tables:
        raise DataError(f"{path}: no schema rows found")
    return " | ".join(f"{t}: {', '.join(cols)}" for t, cols in tables.items())


def load_silo(data_dir: str | Path, name: str) -> dict[str, list[Example]]:
    """All examples of one silo, keyed "train"/"dev"/"test" (Advising's ``exclude`` dropped)."""
    if name not in SILOS:
        raise DataError(f"unknown text2sql silo {name!r}; expected one of {', '.join(SILOS)}")
    data_dir = Path(data_dir)
    schema = serialize_schema(data_dir / f"{name}-schema.csv")
    path = data_dir / f"{name}.json"
    out: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for i, record in enumerate(_read_records(path)):
        for split, example in _record_examples(path, i, record, name, schema):
            out[split].append(example)
    return out


def verify_data_dir(settings: Text2SQLSettings, data_dir: Path) -> None:
    """An explicit ``task.data_dir``, checked as the cache is (the plug-in's ``verify``): the files the
    selected silos need exist, a database for execution match opens and has tables, and files that
    differ from the pinned benchmark are warned about. Records and schema columns are checked as
    they load."""
    data_dir = Path(data_dir)
    names = [f"{s}{suffix}" for s in settings.silos for suffix in (".json", "-schema.csv")]
    databases = [EXEC_DB[s] for s in settings.silos if s in EXEC_DB] if settings.exec_accuracy else []
    require_files("text2sql", data_dir, names)
    for name in databases:
        if not (data_dir / name).is_file():
            raise DataError(f"text2sql database not found: {data_dir / name} (for execution match; "
                            "task.exec_accuracy = false goes without)")
        _check_database(data_dir / name)
    warn_if_unpinned("text2sql", data_dir, names + databases)


def _check_database(path: Path) -> None:
    """Opens read-only and holds tables: what execution match will query."""
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise DataError(f"{path}: not a readable SQLite database ({e})") from None
    if not tables:
        raise DataError(f"{path}: the SQLite database has no tables")


def _read_records(path: Path) -> list:
    """The JSON list of query records; unreadable or non-list files are a DataError."""
    try:
        with path.open(encoding="utf-8") as f:
            records = json.load(f)
    except FileNotFoundError:
        raise DataError(f"text2sql data file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of query records, got {type(records).__name__}")
    return records


def _record_examples(path: Path, i: int, record, silo: str, schema: str):
    """Yield (split, Example) for each kept sentence of record ``i``."""
    where = f"{path}: record {i}"
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    sql = _field(record, "sql", list, where)
    if not sql or not isinstance(sql[0], str):
        raise DataError(f"{where}: 'sql' must be a non-empty list of strings")
    examples = _examples_by_name(record, where)
    for j, sentence in enumerate(_field(record, "sentences", list, where)):
        s_where = f"{where}, sentence {j}"
        if not isinstance(sentence, dict):
            raise DataError(f"{s_where}: expected an object, got {type(sentence).__name__}")
        split = _split_of(silo, _field(sentence, "question-split", str, s_where), s_where)
        if split is None:
            continue
        values = _sentence_values(sentence, examples, s_where)
        question = substitute(_field(sentence, "text", str, s_where), values)
        target = normalise_sql(substitute(sql[0], values))
        yield split, Example(silo, question, target, f"{question} | {schema}")


def _field(obj: dict, key: str, kind: type, where: str):
    """``obj[key]`` checked for presence and type, so bad records fail with a pointed message."""
    if key not in obj:
        raise DataError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise DataError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _examples_by_name(record: dict, where: str) -> dict[str, str]:
    """Example value per declared variable: the fallback for empty or absent sentence values."""
    out = {}
    variables = record.get("variables", [])
    if not isinstance(variables, list):
        raise DataError(f"{where}: 'variables' must be a list, got {type(variables).__name__}")
    for k, var in enumerate(variables):
        if not isinstance(var, dict) or not isinstance(var.get("name"), str):
            raise DataError(f"{where}: variables[{k}] must be an object with a string 'name'")
        out[var["name"]] = str(var.get("example", ""))
    return out


def _sentence_values(sentence: dict, examples: dict[str, str], where: str) -> dict[str, str]:
    """The sentence's values; empty or missing ones take the variable's example.

    Missing ones matter: some Advising/ATIS/Scholar sentences omit a
    ``sql-only`` variable (e.g. ``department0``) that their SQL still uses.
    """
    given = _field(sentence, "variables", dict, where)
    values = {k: v for k, v in examples.items() if v}
    values.update({k: str(v) for k, v in given.items() if v != ""})
    return values


def _split_of(silo: str, raw: str, where: str) -> str | None:
    """Map a record's split label to train/dev/test; None means drop (``exclude``)."""
    if silo in _NAMED_SPLIT:
        if raw in SPLITS:
            return raw
        if raw == "exclude":
            return None
    elif raw in _FOLD_SPLIT:
        return _FOLD_SPLIT[raw]
    raise DataError(f"{where}: unexpected question-split {raw!r} for silo {silo!r}")
