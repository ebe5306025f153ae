"""What a run read: each silo's files with their size and sha256, kept in the run directory
(`data.json`), so a resume that finds a file changed says which one instead of training on
different data without a word.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from fedsilo.fileio import atomic_write_bytes

RECORD = "data.json"


def fingerprint(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def fingerprints(paths: Iterable[Path]) -> dict[str, dict]:
    """str(path) → {bytes, sha256}, for the files that exist (a missing one is the reader's error)."""
    return {str(p): fingerprint(Path(p)) for p in dict.fromkeys(paths) if Path(p).is_file()}


def changes(before: Mapping[str, Mapping[str, dict]], now: Mapping[str, Mapping[str, dict]]) -> list[str]:
    """One line per silo file that changed, appeared or went away between two records
    (silo → path → fingerprint); silos in only one record are not compared (a resume may add none)."""
    out = []
    for silo in sorted(set(before) & set(now)):
        old, new = before[silo], now[silo]
        for path in sorted(set(old) | set(new)):
            if path not in new:
                out.append(f"silo {silo}: {path} is no longer read (it was when the run started)")
            elif path not in old:
                out.append(f"silo {silo}: {path} is read now but was not when the run started")
            elif old[path].get("sha256") != new[path].get("sha256"):
                out.append(f"silo {silo}: {path} changed since the run started ({old[path].get('bytes')} → "
                           f"{new[path].get('bytes')} bytes, sha256 {str(old[path].get('sha256'))[:12]} → "
                           f"{new[path]['sha256'][:12]}): the rounds from here on train on its new contents")
    return out


def record(run_dir: Path, now: Mapping[str, Mapping[str, dict]], resume: bool) -> list[str]:
    """Write `now` (silo → path → fingerprint) to the run directory's record; on a resume, first
    compare it with the recorded one and return the changes (the caller warns). The first record
    is kept as `started`, so every later resume compares with what the run began on."""
    path = Path(run_dir) / RECORD
    old = None
    if resume and path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
    started = old.get("started") if isinstance(old, dict) and isinstance(old.get("started"), dict) else None
    found = changes(started, now) if started is not None else []
    payload = {"started": started if started is not None else dict(now), "now": dict(now)}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(payload, indent=1, sort_keys=True).encode())
    return found
