"""The cache of prepared splits every task shares: ``<data root>/prepared/<task>/<name>-<key>.json.gz``,
keyed by the inputs' contents, so a changed source file or preparation code is never served stale.
An entry carries a content hash of its payload: one that does not match it (changed after it was
written), lacks it (an older fedsilo) or does not read is prepared again with a warning naming it,
never trusted, and never blamed on the data. Each task also checks the shape of what it reads back."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
import warnings
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


HASH = "sha256"  # the key of an entry's content hash, beside its payload's own keys


def _digest(payload: dict) -> str:
    """sha256 of the payload's JSON (keys sorted): the same before writing and after reading back."""
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def ignored(path: Path, why: str) -> None:
    """Warn that the entry at `path` is not used (the caller prepares it again and overwrites it)."""
    warnings.warn(f"prepared-splits cache {path}: {why}; preparing it again", stacklevel=3)


def read_cache(path: Path) -> Any | None:
    """The cached payload, or None when absent or not to be trusted (then with a warning)."""
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()))
    except (FileNotFoundError, NotADirectoryError):  # no entry (the latter: a file where a folder would be)
        return None
    except (OSError, EOFError, zlib.error, ValueError) as err:
        return ignored(path, f"not readable as gzipped JSON ({err})")
    claimed = entry.pop(HASH, None) if isinstance(entry, dict) else None
    if claimed is None:
        return ignored(path, "it carries no content hash (written by an older fedsilo)")
    if _digest(entry) != claimed:
        return ignored(path, "it does not match its content hash (changed after it was written)")
    return entry


def write_cache(path: Path, payload: dict, level: int = 6) -> None:
    """`payload` (a JSON object with string keys, without HASH) with its hash. Atomically (a unique
    temp file, then a rename: clients preparing at once do not mix), and best effort: a read-only
    cache folder only costs the next load its preparation time."""
    data = gzip.compress(json.dumps({**payload, HASH: _digest(payload)}, ensure_ascii=False).encode(), level)
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
