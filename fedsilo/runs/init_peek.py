"""What `fedsilo init` reads from a data file before it writes a config: its first 64 KiB (through
gzip), whether it opens one JSON array or JSON lines, its columns (read as a run reads a header) and
a chat conversation's key. Never the whole file: init looks, the run reads."""
from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

from fedsilo.runs.init_text import Guess
from fedsilo.sources.read import GZIP_MAGIC

__all__ = ["head", "one_array", "columns", "messages_key"]


def head(path: Path) -> str:
    """The file's first 64 KiB as text (through gzip); "" when unreadable."""
    try:
        with open(path, "rb") as f:
            packed = f.read(2) == GZIP_MAGIC
        with (gzip.open if packed else open)(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8-sig", errors="replace")
    except (OSError, EOFError):
        return ""


def one_array(start: str) -> bool:
    """Whether a file's first 64 KiB open one JSON array (alpaca_data.json's layout), not JSON lines
    (a JSONL whose rows are arrays has a complete one on each line)."""
    if not start.lstrip().startswith("["):
        return False
    lines = [line for line in start.splitlines() if line.strip()]
    try:
        json.loads(lines[0])
    except json.JSONDecodeError:
        return True  # "[" alone, or the array's first items: the array goes on
    return len(lines) == 1


def _first_object(path: Path, fmt: str) -> dict:
    """The first row of a JSONL file (its first line), or of a JSON array (its first item), as a JSON
    object; {} when it is none."""
    start = head(path)
    if fmt == "json":
        text = start.lstrip()[1:].lstrip()
    else:
        text = next((line for line in start.splitlines() if line.strip()), "")
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def columns(g: Guess, path: Path, fmt: str) -> list[str]:
    """The header's columns (csv/tsv), read as a run reads it, or the first JSON row's keys; [] when
    unreadable. A CR inside the first line ends the header there, for a run too: a DECIDE line says so."""
    if fmt in ("jsonl", "json"):
        return list(_first_object(path, fmt))
    start = head(path)
    tsv = fmt == "tsv"
    reader = csv.reader(io.StringIO(start, newline=""), delimiter="\t" if tsv else ",",  # newline="": a CR ends
                        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)          # a line, as for a run
    first = next(reader, [])
    if reader.line_num == 1 and "\n" in start and io.StringIO(start, newline="").readline().endswith("\r"):
        g.decide.append(f"{path.name}'s first line holds a carriage return (\\r) before its end: the header is read "
                        "up to it, as a run reads it (a CR ends a CSV line); if it is a stray one, remove it (the rest "
                        "of the line is read as a row, which `fedsilo data check` names)")
    return [c.strip() for c in first]


def messages_key(path: Path, fmt: str) -> str | None:
    """The key of the first JSON row holding a chat conversation: a non-empty list of objects that
    each have a "role" (OpenAI's and Hugging Face's `messages`, or any other name); None when none does."""
    return next((key for key, value in _first_object(path, fmt).items() if isinstance(value, list) and value
                 and all(isinstance(m, dict) and "role" in m for m in value)), None)
