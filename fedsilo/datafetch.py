"""Obtaining benchmark files, pinned by sha256, from a local mirror or GitHub.

Each task ships ``fedsilo/tasks/<task>/sources.tsv`` (path, size, sha256, repo,
path-in-repo, commit) - metadata only, never data.  :func:`ensure` makes
``dest/<path>`` match it: keep a verified copy, else copy from a mirror, else
download the pinned commit from raw.githubusercontent.com.  A file with no public
repository (repo and commit ``-``) comes from a mirror only; its path-in-repo
column then says where it was built from.  Files are written
to a temporary name and renamed only once their hash checks out, so a
destination path never holds a partial or wrong file.
"""
from __future__ import annotations

import csv
import hashlib
import os
import sys
import tempfile
import urllib.request
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fedsilo.errors import DataError

__all__ = ["DataError", "DataChangedWarning", "Source", "default_data_root", "read_manifest", "find_mirror",
           "ensure", "differs_from_pins", "require_files", "warn_if_unpinned"]

_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
_CHUNK = 1 << 20
_NO_REPO = "-"


class DataChangedWarning(UserWarning):
    """Well-formed files in an explicit data folder that differ from the pinned benchmark files."""


@dataclass(frozen=True)
class Source:
    """One manifest row: ``path`` is relative to the task's data folder."""

    path: str
    size: int
    sha256: str
    repo: str
    repo_path: str
    commit: str

    @property
    def mirror_only(self) -> bool:
        """No public download (repo ``-``): ``repo_path`` describes the file's origin instead."""
        return self.repo == _NO_REPO

    @property
    def url(self) -> str:
        return _URL.format(repo=self.repo, commit=self.commit, path=self.repo_path)


def default_data_root() -> Path:
    """``$FEDSILO_DATA`` or ``~/.cache/fedsilo/data``; task files live under ``<root>/<task>/``."""
    env = os.environ.get("FEDSILO_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedsilo" / "data"


def read_manifest(path: Path) -> list[Source]:
    """Parse a tab-separated sources manifest (header row, six columns)."""
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t"))
    except OSError as e:
        raise DataError(f"cannot read manifest {path}: {e.strerror or e}") from None
    sources = []
    for n, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != 6 or not row[1].isdigit():
            raise DataError(f"{path}: line {n}: expected path, size, sha256, repo, path-in-repo, commit")
        sources.append(Source(row[0], int(row[1]), row[2].lower(), *row[3:]))
    return sources


def find_mirror() -> Path | None:
    """First existing mirror root: ``$FEDSILO_DATA_MIRROR``, ``../shared/data`` from the CWD,
    then ``shared/data`` next to the repository checkout."""
    env = os.environ.get("FEDSILO_DATA_MIRROR")
    candidates = [Path(env).expanduser()] if env else []
    candidates += [Path.cwd().parent / "shared" / "data",
                   Path(__file__).resolve().parents[2] / "shared" / "data"]
    return next((c for c in candidates if c.is_dir()), None)


def ensure(task: str, dest: Path, mirror: Path | None = None, manifest: Path | None = None,
           progress: bool = True, only: Iterable[str] | None = None) -> Path:
    """Make every file of ``task``'s manifest (or those of its paths in ``only``) present and verified
    under ``dest``; return ``dest``.

    ``mirror`` is a data root laid out like ``default_data_root()`` (files at
    ``<mirror>/<task>/<path>``); a folder holding the files directly also works.
    """
    dest = Path(dest)
    manifest = Path(manifest) if manifest else _TASKS_DIR / task / "sources.tsv"
    mirror = Path(mirror) if mirror else find_mirror()
    announced = False
    wanted = None if only is None else set(only)
    for src in read_manifest(manifest):
        if wanted is not None and src.path not in wanted:
            continue
        target = dest / src.path
        if _is_verified(target, src):
            continue
        if not announced:
            _log(progress, f"{task} data → {dest.resolve()} (checked against sha256 pins)")
            announced = True
        target.parent.mkdir(parents=True, exist_ok=True)
        local = _mirror_file(mirror, task, src.path)
        if local is not None:
            _log(progress, f"copying {src.path} from {local}")
            with local.open("rb") as f:
                _install(f, target, src, origin=str(local))
        elif src.mirror_only:
            raise DataError(f"{src.path} has no public download ({src.repo_path}); "
                            f"set FEDSILO_DATA_MIRROR to a folder holding it")
        else:
            _log(progress, f"downloading {src.path} ({src.size} bytes) from {src.url}")
            _download(src, target)
    return dest


def differs_from_pins(task: str, folder: Path, names: list[str]) -> list[str]:
    """Those of ``names`` (files in ``folder``) that ``task``'s manifest pins and that differ from the pin.

    Meant for an explicit data folder: a difference is for the caller to warn about (users may edit
    data), not to refuse; names the manifest does not list are not judged."""
    pins = {src.path: src for src in read_manifest(_TASKS_DIR / task / "sources.tsv")}
    return [name for name in names if name in pins and not _is_verified(Path(folder) / name, pins[name])]


def require_files(task: str, data_dir: Path, names: list[str]) -> None:
    """An explicit data folder holds each of ``names``; the first missing one is named."""
    for name in names:
        if not (Path(data_dir) / name).is_file():
            raise DataError(f"{task} data file not found: {Path(data_dir) / name}")


def warn_if_unpinned(task: str, data_dir: Path, names: list[str]) -> None:
    """One warning listing those of ``names`` that differ from ``task``'s pins: used as they are."""
    changed = differs_from_pins(task, data_dir, names)
    if changed:
        warnings.warn(DataChangedWarning(f"task.data_dir {data_dir}: not the pinned benchmark files (sha256), "
                                         f"used as they are: {', '.join(changed)}"), stacklevel=3)


def _is_verified(path: Path, src: Source) -> bool:
    """Already there with the right size and hash (size first: cheap reject)."""
    return path.is_file() and path.stat().st_size == src.size and _sha256_file(path) == src.sha256


MIRROR_FOLDERS = {"translation": "nmt", "matching": "qa"}
"""Tasks whose folder in the shared data mirror has another name than the task."""


def _mirror_file(mirror: Path | None, task: str, rel: str) -> Path | None:
    if mirror is None:
        return None
    folders = dict.fromkeys([task, MIRROR_FOLDERS.get(task, task)])
    return next((p for p in (*(mirror / f / rel for f in folders), mirror / rel) if p.is_file()), None)


def _download(src: Source, target: Path) -> None:
    try:
        with urllib.request.urlopen(src.url, timeout=60) as response:
            _install(response, target, src, origin=src.url)
    except OSError as e:  # URLError, timeouts, HTTP errors
        raise DataError(f"cannot download {src.path} from {src.url}: {e}; "
                        f"set FEDSILO_DATA_MIRROR to a folder holding {src.path}") from None


def _install(stream: BinaryIO, target: Path, src: Source, origin: str) -> None:
    """Copy ``stream`` to a temp file beside ``target``, verify its sha256, then rename it in."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != src.sha256:
            raise DataError(f"checksum mismatch for {src.path} from {origin}: "
                            f"expected sha256 {src.sha256}, got {digest.hexdigest()}")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a data cache is meant to be shared
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[fedsilo data] {message}", file=sys.stderr)
