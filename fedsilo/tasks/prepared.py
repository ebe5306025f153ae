"""The cache of prepared splits every task shares: ``<data root>/prepared/<task>/<name>-<key>.json.gz``,
keyed by the inputs' contents, so a changed source file or preparation code is never served stale.
Each task checks the shape of what it reads back; anything unreadable is simply prepared again."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from fedsilo.datafetch import DataError, default_data_root


def package_version(name: str) -> str:
    """A preparing library's version, for the key (its output may change with it)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_path(task: str, name: str, files: Iterable[Path], parts: Iterable[str]) -> Path:
    """The key covers `parts` (the name, the preparation version, settings, library versions) and
    each input file's name, size and sha256."""
    key = hashlib.sha256()
    for part in (name, *parts):
        key.update(str(part).encode() + b"\0")
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror or e}") from None
        key.update(f"{path.name}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\0".encode())
    return default_data_root() / "prepared" / task / f"{name}-{key.hexdigest()}.json.gz"


def read_cache(path: Path) -> Any | None:
    """The cached JSON, or None when absent or not readable as gzipped JSON."""
    try:
        return json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, zlib.error, ValueError):
        return None


def write_cache(path: Path, payload: Any, level: int = 6) -> None:
    """Atomically (a unique temp file, then a rename: clients preparing at once do not mix), and
    best effort: a read-only cache folder only costs the next load its preparation time."""
    data = gzip.compress(json.dumps(payload, ensure_ascii=False).encode(), level)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a data cache is meant to be shared
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
