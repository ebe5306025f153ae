"""What a user-named path is before anything opens it (`not_readable`, `regular_file`). Atomic file writes: a temporary file, fsync, then a rename, so a reader (or a resume) never sees
a half-written file; a failed write (a full disk) leaves no .tmp behind and names the file. And the
one reader of an append-only JSON-lines log, which a crash may leave with a partly written last line."""
from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fedsilo.errors import FedsiloError, UserError


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


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_readable(path: Path) -> str | None:
    """What `path` is when it cannot be read as a data file ("a symlink loop ..."), asking only its
    metadata; None for a regular file. Nothing else is opened: a reader of a FIFO waits forever for
    a writer, and a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symlink to nothing (its target is missing)" if os.path.islink(path) else "not found"
    except OSError as e:
        return ("a symlink loop (a link that leads back to itself)" if e.errno == errno.ELOOP
                else f"unreadable ({e.strerror or e})")
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    kind = next((what for test, what in _NOT_REGULAR if test(mode)), None)
    return f"{kind}, not a regular file: refused before opening it" if kind else None


def regular_file(path: str | Path, what: str, error: type[FedsiloError] = UserError) -> Path:
    """`path` as a Path when it is a regular file (or a symlink to one); else `error` in one line naming
    `what` (e.g. "--prompt-file", "node config roster") and what the path is, before anything opens it."""
    path = Path(path)
    why = not_readable(path)
    if why:
        raise error(f"{what}: {path} is {why}")
    return path


def writable_file(path: str | Path, what: str, error: type[FedsiloError] = UserError) -> Path:
    """`path` as a Path when nothing is there or a regular file is (which a write replaces); a FIFO there
    would block the writer for ever, a folder is no file: `error` naming `what`."""
    path = Path(path)
    why = not_readable(path)
    if why and why != "not found":
        raise error(f"{what}: {path} is {why}")
    return path
