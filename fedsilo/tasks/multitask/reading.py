"""Reading a converter's source files so that a malformed one is a `DataError` naming the file, the
line (or record) and what is wrong, never a bare KeyError or IndexError from inside a converter:
`task.data_dir` may hold a user's own or edited copies of the sources.

A converter reads each file through a `Source` used as a context: its readers yield rows and note
where each came from, and an error a row of the wrong shape raises inside the `with` (a missing
field, too few columns, a failed unpacking, an unknown label) names that place. The readers keep
the converters' exact line splitting (CrossFit's files are reproduced byte for byte).
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fedsilo.datafetch import DataError

T = TypeVar("T")

RECORD_ERRORS = (KeyError, IndexError, ValueError, TypeError, AttributeError, csv.Error)
"""What a converter's own code raises on a record of the wrong shape."""


def decode(data: bytes, encoding: str, where: object) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{where}:{line}: not {encoding} text (byte {data[e.start]:#04x}: {e.reason})") from None


def label(words: Mapping[Any, str] | Sequence[str], value: Any) -> str:
    """The label word of `value` (a key of `words`, or an index into a tuple of words)."""
    keys = range(len(words)) if isinstance(words, Sequence) else words
    if value not in keys:
        raise ValueError(f"unknown label {value!r}; expected one of {', '.join(map(repr, keys))}")
    return words[value]


class Source:
    """One source file. Inside `with Source(path) as src:`, a record error names `path:line` (or
    `path: record`) of the row `src`'s readers yielded last."""

    def __init__(self, path: Path) -> None:
        self.path, self.where, self.row = Path(path), str(path), None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if isinstance(error, RECORD_ERRORS) and not isinstance(error, DataError):
            raise DataError(f"{self.where}: malformed record: {_reason(error, self.row)}") from None

    def track(self, rows: Iterable[tuple[str, T]]) -> Iterator[T]:
        """Yield each row, noting its place (":LINE" or ": RECORD" after the path)."""
        for place, row in rows:
            self.where, self.row = f"{self.path}{place}", row
            yield row

    def text(self, encoding: str = "utf-8", universal: bool = False) -> str:
        """The whole file; `universal`: "\\r\\n" and "\\r" read as "\\n" (as `open` reads text)."""
        text = decode(self.path.read_bytes(), encoding, self.path)
        return text.replace("\r\n", "\n").replace("\r", "\n") if universal else text

    def lines(self, encoding: str = "utf-8", universal: bool = False, text: str | None = None) -> Iterator[str]:
        """Lines split on "\\n" only (`str.splitlines` also splits at NEL, U+2028 ...), without the
        empty tail after the last one."""
        lines = (self.text(encoding, universal) if text is None else text).split("\n")
        lines = lines[:-1] if lines and lines[-1] == "" else lines
        return self.track((f":{n}", line) for n, line in enumerate(lines, 1))

    def csv(self, delimiter: str = ",", header: bool = False) -> Iterator[list[str]] | Iterator[dict[str, str]]:
        """csv rows (quoting on, as `open(newline="")` + `csv.reader` reads them), each noted at the
        line it starts on (a quoted field may span lines); `header`: dicts keyed by the first row."""
        stream = io.StringIO(self.text(), newline="")
        reader = csv.DictReader(stream, delimiter=delimiter) if header else csv.reader(stream, delimiter=delimiter)
        lines = reader.reader if header else reader
        if header:
            self.where = f"{self.path}:1"
            _ = reader.fieldnames  # reads the header line now, so that data lines are numbered from 2
        while True:
            self.where, self.row = f"{self.path}:{lines.line_num + 1}", None
            try:
                row = next(reader)
            except StopIteration:
                return
            self.row = row
            yield row

    def jsonl(self, encoding: str = "utf-8") -> Iterator[Any]:
        """One JSON value per non-blank line."""
        for line in self.lines(encoding, universal=True):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{self.where}: invalid JSON ({e.msg} at column {e.colno})") from None

    def json(self) -> Any:
        try:
            return json.loads(self.text())
        except json.JSONDecodeError as e:
            raise DataError(f"{self.path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


def _reason(error: BaseException, row: Any) -> str:
    if isinstance(error, KeyError):
        return f"no field {error.args[0]!r}"
    shape = f" (the record has {len(row)} fields)" if isinstance(row, list) and isinstance(error, IndexError) else ""
    return " ".join(f"{error}{shape}".split())  # one line, whatever the exception's message holds
