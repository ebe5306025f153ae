"""Text-to-SQL scores: exact match on the canonical form, and execution match on SQLite.

Exact match compares :func:`normalise_sql` strings, so it is independent of the
tokenizer that produced a prediction.  Execution match first turns the canonical
form back into runnable SQL (:func:`sql_for_execution`), then compares result
multisets on a read-only database.
"""
from __future__ import annotations

from collections.abc import Sequence

import re
import sqlite3
import time
from collections import Counter
from pathlib import Path

from fedsilo.tasks.text2sql.data import EXEC_DB, DataError, normalise_sql

__all__ = ["EXEC_DB", "exact_match", "sql_for_execution", "execution_match"]

_LITERAL = re.compile(r'"([^"]*)"|\'([^\']*)\'')
_CODE_JOINS = (
    (re.compile(r"(?<=\w) ([._]) (?=\w)"), r"\1"),      # alias0 . col, state _ name, 1 . 5
    (re.compile(r"([<>!]) (=)|(<) (>)"), r"\1\2\3\4"),  # < =, > =, ! =, < >
)
_VALUE_JOINS = (
    (re.compile(r"(?<=\w) ([_'-]) (?=\w)"), r"\1"),     # o ' brien, wilkes - barre
    (re.compile(r" ([.,])"), r"\1"),                    # st . elias -> st. elias
    (re.compile(r"^% | %$"), "%"),                      # LIKE " % topic % "
)
_PROGRESS_STEPS = 1000
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                    sqlite3.SQLITE_RECURSIVE}


def exact_match(pred: str, gold: str) -> bool:
    """Equality of the canonical forms (case, spacing around punctuation ignored)."""
    return normalise_sql(pred) == normalise_sql(gold)


def sql_for_execution(normalised_sql: str) -> str:
    """Undo the canonical form's extra spaces well enough for SQLite to run it.

    Quoted values become single-quoted literals (SQLite may read a
    double-quoted word as a column name); the values stay lower-case, which is
    what the GeoQuery database stores.
    """
    parts, last = [], 0
    for m in _LITERAL.finditer(normalised_sql):
        parts.append(_apply(_CODE_JOINS, normalised_sql[last:m.start()]))
        value = m.group(1) if m.group(1) is not None else m.group(2)
        parts.append("'" + _apply(_VALUE_JOINS, value.strip()).replace("'", "''") + "'")
        last = m.end()
    parts.append(_apply(_CODE_JOINS, normalised_sql[last:]))
    return "".join(parts)


def execution_match(pred_norm: str, gold_norm: str, db_path: str | Path, timeout: float = 2.0,
                    max_rows: int = 100_000) -> bool:
    """Whether pred and gold return the same rows on ``db_path``.

    Rows are compared as multisets unless the gold query has ORDER BY.  A pred
    that fails, writes, runs past ``timeout`` seconds or returns more than
    ``max_rows`` rows scores False; so does everything if gold itself fails.
    """
    pred_norm, gold_norm = normalise_sql(pred_norm), normalise_sql(gold_norm)
    path = Path(db_path)
    if not path.is_file():
        raise DataError(f"SQLite database not found: {path}")
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS
                            else sqlite3.SQLITE_DENY)
        gold = _rows(conn, sql_for_execution(gold_norm), timeout, max_rows)
        pred = _rows(conn, sql_for_execution(pred_norm), timeout, max_rows)
    finally:
        conn.close()
    if gold is None or pred is None:
        return False
    if "order by" in gold_norm:
        return pred == gold
    return Counter(pred) == Counter(gold)


def gold_results(db_path: str | Path, golds: Sequence[str], timeout: float = 2.0,
                 limit: int = 200) -> tuple[int, int, int]:
    """(golds tried, golds that return no rows as written, golds that return rows as written but none
    in their canonical, lower-case form: the form predictions come in). An empty gold result is
    matched by any prediction that finds nothing; a lost one makes execution match meaningless."""
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    empty = lost = 0
    try:
        conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS
                            else sqlite3.SQLITE_DENY)
        tried = list(golds)[:limit]
        for sql in tried:
            written = _rows(conn, sql, timeout, 100_000)
            if not written:
                empty += 1
            elif not _rows(conn, sql_for_execution(normalise_sql(sql)), timeout, 100_000):
                lost += 1
    finally:
        conn.close()
    return len(tried), empty, lost


def _rows(conn: sqlite3.Connection, sql: str, timeout: float, max_rows: int) -> list | None:
    """Result rows, or None when the query errors, times out or returns too many rows."""
    deadline = time.monotonic() + timeout
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    try:
        rows = conn.execute(sql).fetchmany(max_rows + 1)
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError):
        return None
    return rows if len(rows) <= max_rows else None


def _apply(rules, text: str) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text
