"""Atomic file writes: a temporary file, fsync, then a rename, so a reader (or a resume) never sees
a half-written file."""
from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:  # a full disk: no .tmp left behind, and the error names the file
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(path)) from None
    os.replace(tmp, path)
