"""Files → rows: each row's role values with the file:line it starts at (an item of a JSON array:
file[i]:line, as several may start on one line). A malformed row (bad encoding, a missing or empty
field, a cell too many, a row of another kind than the source reads) becomes a `Problem` naming its
file:line and why, never a row with a gap filled in; a file that cannot be read at all (missing, not a
regular file, a symlink loop, no such column in its header, aligned files of different lengths, a
.jsonl holding one JSON array) is a `DataError`. A gzip-compressed file (by its magic bytes) is read
as its text.
"""
from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsilo.errors import DataError
from fedsilo.fileio import not_readable

from .settings import SourceSettings

Value = str | list[str]


@dataclass(frozen=True)
class Row:
    where: str                 # "file:line" of the row's first line
    values: dict[str, Value]   # role → stripped text (a list for a JSONL list role); optional roles may be absent


@dataclass(frozen=True)
class Problem:
    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class QuotingDataError(DataError):
    """A data error whose message may quote the data (a header's names, a cell's value), for the
    silo's own operator; `public` says the same with file:line and counts only, which is all a
    silo's error may tell the coordinator (docs/privacy.md, "What travels back to the coordinator")."""

    def __init__(self, message: str, public: str) -> None:
        super().__init__(message)
        self.public = public


def places(problems: list[Problem], shown: int) -> str:
    """Where the first `shown` problems are (file:line), without why: a reason may quote the row."""
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return ", ".join(p.where for p in problems[:shown]) + more


def read_rows(source: SourceSettings, file: Path) -> tuple[list[Row], list[Problem]]:
    """Every row of `file` (for `lines`: the prefix of one file per role) in file order."""
    fmt = source.format_name
    if fmt == "lines":
        rows, problems = _read_lines_format(source, file)
    else:
        text, bad_lines, problems = decode(file, source.encoding)
        reader = {"jsonl": _read_jsonl, "json": _read_json}.get(fmt, _read_table)
        rows, more = reader(source, file, text, bad_lines)
        problems += more
    return rows, sorted(problems, key=lambda p: place_of(p.where)[1:])  # file order: a run's error shows the first


_ITEM = re.compile(r"(.*)\[(\d+)\]")


def place_of(where: str) -> tuple[str, int, int]:
    """(file, line, item) of a row's `where`: file:line, or file[item]:line for a JSON array's item."""
    path, _, line = where.rpartition(":")
    item, line = _ITEM.fullmatch(path), int(line) if line.isdigit() else 0
    return (item[1], line, int(item[2])) if item else (path, line, 0)


# ---- text -------------------------------------------------------------------------------

GZIP_MAGIC = b"\x1f\x8b"  # no text file starts with these bytes (0x8b is no first byte in UTF-8 either)
def read_bytes(path: Path) -> bytes:
    """The file's bytes, a gzip-compressed one's decompressed; refused by name, before it is opened,
    when it is not a regular file."""
    why = not_readable(path)
    if why == "not found":
        raise DataError(f"file not found: {path}")
    if why:
        raise DataError(f"{path} is {why}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if raw.startswith(GZIP_MAGIC):
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: damaged gzip data ({e})") from None
    if path.suffix.lower() == ".gz":
        raise DataError(f"{path}: named .gz but not gzip-compressed (rename it, or compress it with gzip)")
    return raw


def lines_file(stem: str | Path, suffix: str) -> Path:
    """A `lines` role's file, `STEM.SUFFIX`, or `STEM.SUFFIX.gz` where only that one exists."""
    plain = Path(f"{stem}.{suffix}")
    packed = Path(f"{plain}.gz")
    return packed if not os.path.lexists(plain) and os.path.lexists(packed) else plain


def decode(path: Path, encoding: str) -> tuple[str, set[int], list[Problem]]:
    """(text, lines that did not decode, a problem per such line). A UTF-8 BOM is skipped. An
    ASCII-compatible encoding is decoded line by line on error, so every bad line is named; another
    (UTF-16) fails as a whole, at its byte offset."""
    raw = read_bytes(path)
    name = codecs.lookup(encoding).name
    if name == "utf-8" and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        return raw.decode(encoding), set(), []
    except UnicodeDecodeError as err:
        if not _ascii_compatible(name):
            raise DataError(f"{path}: not {encoding} text (byte {err.start}: {err.reason})") from None
    lines, bad, problems = [], set(), []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        try:
            lines.append(line.decode(encoding))
        except UnicodeDecodeError as err:
            bad.add(n)
            problems.append(Problem(f"{path}:{n}", f"not {encoding} text (byte 0x{line[err.start]:02x} at "
                                                   f"column {err.start + 1}); is the file in another encoding? "
                                                   "set encoding in its source"))
            lines.append(line.decode(encoding, errors="replace"))
    return "\n".join(lines), bad, problems


def _ascii_compatible(name: str) -> bool:
    try:
        return "\n".encode(name) == b"\n" and "a".encode(name) == b"a"
    except (LookupError, UnicodeError):
        return False


def _text_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) as `wc -l` counts them; a trailing CR is dropped."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for n, line in enumerate(lines, start=1):
        yield n, line.removesuffix("\r")


# ---- one value --------------------------------------------------------------------------

def _value(source: SourceSettings, role: str, raw: Any, where: str, what: str) -> tuple[Value | None, str | None]:
    """(value, None) or (None, the reason the row is malformed). Absent optional roles are (None, None)."""
    required = role in source.ROLES.required
    if raw is None:
        return None, (f"no {what} for {role}" if required else None)
    if isinstance(raw, list):
        if role not in source.ROLES.lists:
            return None, f"{what} ({role}) is a list; expected one text"
        objects = role in source.ROLES.objects
        items = [_object(x) if objects else _scalar(x) for x in raw]
        if any(x is None for x in items):
            return None, f"{what} ({role}) holds an item that is not {'an object' if objects else 'text or a number'}"
        if required and not items:
            return None, f"{what} ({role}) is an empty list"
        items = [x.strip() for x in items]
        if not all(items):
            return None, f"{what} ({role}) holds an empty item"
        return items, None
    text = _scalar(raw)
    if text is None:
        return None, f"{what} ({role}) is a {type(raw).__name__}; expected text"
    text = text.strip()
    if not text:
        return None, (f"empty {role} ({what})" if required else None)
    return text, None


def _scalar(x: Any) -> str | None:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (str, int, float)):
        return str(x)
    return None


def _object(x: Any) -> str | None:
    """A JSON object item as its JSON text (keys sorted: equal objects, equal text)."""
    return json.dumps(x, ensure_ascii=False, sort_keys=True) if isinstance(x, dict) else None


def _row(source: SourceSettings, where: str, get) -> tuple[Row | None, Problem | None]:
    """A row from `get(role) -> (raw value, what it is called)`; the first bad role makes it a problem."""
    values: dict[str, Value] = {}
    for role in source.ROLES.all:
        raw, what = get(role)
        value, why = _value(source, role, raw, where, what)
        if why:
            return None, Problem(where, why)
        if value is not None:
            values[role] = value
    return Row(where, values), None


# ---- formats ----------------------------------------------------------------------------

def _read_jsonl(source: SourceSettings, path: Path, text: str, bad: set[int]) -> tuple[list[Row], list[Problem]]:
    if text.lstrip().startswith("["):
        _refuse_one_array(path, text)
    objects, problems = [], []
    for n, line in _text_lines(text):
        if n in bad or not line.strip():  # bad: already a problem; blank lines carry no row
            continue
        where = f"{path}:{n}"
        try:
            objects.append((where, "", json.loads(line)))
        except json.JSONDecodeError as err:
            problems.append(Problem(where, f"not JSON ({err.msg} at column {err.colno})"))
    rows, more = _json_rows(source, objects)
    return rows, problems + more


def _refuse_one_array(path: Path, text: str) -> None:
    """A .jsonl file that is one JSON array (Alpaca's .json layout) would be a malformed row per line."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return  # lines of their own (each an array, or not JSON): each line's problem says so
    if isinstance(whole, list):
        raise DataError(f"{path}: one JSON array of {len(whole)} items, not JSON lines (one object per line): "
                        "name the file .json (a JSON array's items are read as rows), or set format = \"json\"")


def _read_json(source: SourceSettings, path: Path, text: str, bad: set[int]) -> tuple[list[Row], list[Problem]]:
    """One JSON array of row objects (Alpaca's alpaca_data.json), item i named `PATH[i]:LINE` by the
    line it starts on; an item on a line that did not decode is left out (that line is a problem)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not JSON ({err.msg} at column {err.colno}); a .json source is one "
                        "JSON array of row objects, [{...}, {...}] (one object per line: name it .jsonl)") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: a JSON {_json_type(items)}, not an array of row objects; a .json source is one "
                        "JSON array, [{...}, {...}] (one object per line: name it .jsonl)")
    objects = [(f"{path}[{i}]:{first}", f"item [{i}]", item)
               for i, ((first, last), item) in enumerate(zip(_item_lines(text), items))
               if not bad.intersection(range(first, last + 1))]
    return _json_rows(source, objects)


_BETWEEN_ITEMS = re.compile(r"[\s,]*")


def _item_lines(text: str) -> Iterator[tuple[int, int]]:
    """(first line, last line) of each item of `text`, a valid JSON array, in order."""
    decoder = json.JSONDecoder()
    pos = _BETWEEN_ITEMS.match(text).end() + 1  # past the "["
    line = 1 + text.count("\n", 0, pos)
    while True:
        start = _BETWEEN_ITEMS.match(text, pos).end()
        if text[start] == "]":
            return
        _, end = decoder.raw_decode(text, start)
        first = line + text.count("\n", pos, start)
        line = first + text.count("\n", start, end)
        yield first, line
        pos = end


def _json_type(value: Any) -> str:
    return {dict: "object", str: "string", bool: "boolean"}.get(type(value), type(value).__name__)


def _json_rows(source: SourceSettings, objects: list[tuple[str, str, Any]]) -> tuple[list[Row], list[Problem]]:
    """Rows of parsed JSON values: (where, what the value is called in its file ("item [3]"; "" for
    a line), value). A value missing a key that is a row of another kind the family reads (a chat row
    among Alpaca rows) is named as one, with the first row of each kind."""
    rows, problems, other = [], [], []
    own, first_own = source.kind_read, None
    for where, label, obj in objects:
        said = f"{label}: " if label else ""
        if not isinstance(obj, dict):
            kind = type(obj).__name__  # as every row's message has said: a JSON list, a JSON int
            problems.append(Problem(where, f"{label} is a JSON {kind}; expected an object (a row)" if label
                                    else f"a JSON {kind}; expected an object (one row per line)"))
            continue
        kind = source.row_kind(obj) if own else None
        if kind == own and first_own is None:
            first_own = (where, label)
        if kind not in (None, own) and any(source.column(r) not in obj for r in source.ROLES.required):
            other.append((where, label, kind))
            continue
        row, problem = _row(source, where, lambda r: (obj.get(source.column(r)), f"key {source.column(r)!r}"))
        rows.append(row) if row else problems.append(Problem(where, said + problem.reason))
    return rows, problems + _other_kind(source, other, first_own)


def _other_kind(source: SourceSettings, other: list[tuple[str, str, str]], first_own: tuple[str, str] | None
                ) -> list[Problem]:
    """A problem per row of another kind: with the first row of each kind where both are in the file,
    else the setting that reads the kind there is."""
    own, out, first = source.kind_read, [], {}
    for where, label, kind in other:
        first.setdefault(kind, (where, label))
        setting = source.ROW_KINDS[kind]
        reason = (f"a {kind} row among {own} rows (the first {own} row: {_at(*first_own)}; the first {kind} row: "
                  f"{_at(*first[kind])}): a silo's rows are of one kind; put the {kind} rows in a file of their own, "
                  f"a silo with {setting}" if first_own else
                  f"a {kind} row; this source reads {own} rows: set {setting} to read {kind} rows")
        out.append(Problem(where, f"{label}: {reason}" if label else reason))
    return out


def _at(where: str, label: str) -> str:
    line = f"line {where.rpartition(':')[2]}"
    return f"{label}, {line}" if label else line


def _read_table(source: SourceSettings, path: Path, text: str, bad: set[int]) -> tuple[list[Row], list[Problem]]:
    """CSV (RFC 4180 quoting, a field may span lines) or TSV (no quoting: a tab ends a field)."""
    tsv = source.format_name == "tsv"
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if tsv else ",",
                        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL, strict=not tsv)
    rows, problems = [], []
    kind = "tab" if tsv else "comma"
    header: list[str] | None = None
    start, widest = 1, 0
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as err:  # named at the row's first line; the reader goes on at the next line
            end = reader.line_num
            span = f"; lines {start}-{end} read as one row (an unclosed double quote?)" if end > start else ""
            if source.header and header is None:
                raise DataError(f"{path}:{start}: the header line is malformed CSV ({err}){span}") from None
            problems.append(Problem(f"{path}:{start}", f"malformed CSV ({err}){span}"))
            if end < start:  # nothing read: cannot move on
                break
            start = end + 1
            continue
        first, start = start, reader.line_num + 1
        if any(n in bad for n in range(first, reader.line_num + 1)):
            if source.header and header is None:
                raise DataError(f"{path}:{first}: the header line is not {source.encoding} text; set encoding "
                                "in its source")
            continue
        if source.header and header is None:
            header = [c.strip() for c in cells]
            index = _columns(source, path, header)
            continue
        if not any(c.strip() for c in cells):
            continue  # a blank line
        widest = max(widest, len(cells))
        where = f"{path}:{first}"
        if header is not None:
            if len(cells) != len(header):
                problems.append(Problem(where, f"{len(cells)} {kind}-separated fields; the header has {len(header)}"
                                        + ("" if tsv else " (a comma inside a field needs the field in double "
                                           "quotes)")))
                continue
        else:
            index = {r: source.column(r) for r in source.ROLES.all if isinstance(source.column(r), int)}
            need = max(index[r] for r in source.ROLES.required) + 1
            if len(cells) < need:
                problems.append(Problem(where, f"{len(cells)} {kind}-separated fields; expected at least {need}"))
                continue
        row, problem = _row(source, where, lambda r: (
            cells[index[r]] if r in index and index[r] < len(cells) else None,
            f"column {header[index[r]] if header and r in index else index.get(r, source.column(r))!r}"))
        rows.append(row) if row else problems.append(problem)
    if source.header and header is None:
        raise DataError(f"{path}: empty file (expected a header line naming the columns)")
    if not source.header and widest:
        _indices_in_range(source, path, widest, kind)
    return rows, problems


def _indices_in_range(source: SourceSettings, path: Path, widest: int, kind: str) -> None:
    """A mapped column index that no row of the file reaches is the mapping's error, named once,
    not a problem on every row."""
    for role, column in source.fields.items():
        if isinstance(column, int) and column >= widest:
            raise DataError(f"{path}: fields.{role} = {column} is out of range: the file has {widest} "
                            f"{kind}-separated column(s) (indices 0 to {widest - 1})")


def _columns(source: SourceSettings, path: Path, header: list[str]) -> dict[str, int]:
    """role → column index from the header; a required role's column missing is the file's error."""
    index = {}
    for role in source.ROLES.all:
        name = source.column(role)
        if isinstance(name, int):
            raise DataError(f"{path}: fields.{role} = {name} is a column index, but the file has a header; "
                            f"name the column (one of {', '.join(map(repr, header))}) or set header = false")
        if name in header:
            index[role] = header.index(name)
        elif role in source.ROLES.required:
            hint = "" if role in source.fields else f" (set fields.{role} to the column holding the {role})"
            raise QuotingDataError(f"{path}: line 1: no column {name!r} for {role}{hint}; the header has "
                                   f"{', '.join(map(repr, header))}",
                                   f"{path}: line 1: no column {name!r} for {role}{hint}; the header has "
                                   f"{len(header)} other column(s)")
    return index


def _read_lines_format(source: SourceSettings, prefix: Path) -> tuple[list[Row], list[Problem]]:
    """One file per role, `PREFIX.SUFFIX`, line i of each being one row."""
    files = {r: lines_file(prefix, source.column(r)) for r in source.ROLES.all
             if r in source.ROLES.required or r in source.fields}
    columns, problems, bad = {}, [], set()
    for role, path in files.items():
        if role not in source.ROLES.required and not os.path.lexists(path):
            continue
        text, bad_here, more = decode(path, source.encoding)
        columns[role] = [line for _, line in _text_lines(text)]
        bad |= bad_here
        problems += more
    first_role = source.ROLES.required[0]
    lengths = {r: len(lines) for r, lines in columns.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{files[r]} has {n}" for r, n in lengths.items())
        raise DataError(f"line-aligned files differ in length: {shown} lines; line i of each must be one example")
    rows = []
    for i in range(lengths[first_role]):
        if i + 1 in bad:
            continue
        where = f"{files[first_role]}:{i + 1}"
        row, problem = _row(source, where, lambda r: (columns[r][i] if r in columns else None,
                                                       f"line {i + 1} of {files[r].name}" if r in files else r))
        rows.append(row) if row else problems.append(problem)
    return rows, problems
