"""Atomic file writes: a temporary file, fsync, then a rename, so a reader (or a resume) never sees
a half-written file; a failed write (a full disk) leaves no .tmp behind and names the file. And the
one reader of an append-only JSON-lines log, which a crash may leave with a partly written last line."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """`write(fh)` into `path.tmp`, then rename it to `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # torch.save wraps a write error in a RuntimeError, keeping the OSError as its context
        cause = err if isinstance(err, OSError) else err.__context__ if isinstance(err, RuntimeError) else None
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def read_jsonl(text: str, where: str) -> tuple[list[tuple[int, object]], str | None]:
    """([(line number, value)], note): every complete line of a JSON-lines log parsed; a partly written
    last line (no newline after it: the writer was cut off) is skipped and named in the note; any
    other malformed line raises ValueError naming `where`:line."""
    lines = text.split("\n")
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                return out, (f"{where}:{lineno}: partly written last line ({len(line)} characters, "
                             "what an interrupted run leaves) skipped")
            raise ValueError(f"{where}:{lineno}: malformed JSON ({err.msg})") from None
    return out, None
