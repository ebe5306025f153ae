"""One run directory, one writer: an exclusive lock held for the whole run.

Two runs writing one `--out` would interleave rounds.jsonl and overwrite each other's checkpoints;
the second one fails at once instead. The lock is an `flock` on `OUT/.lock`, so it vanishes with
the process that held it (a killed run never leaves a stale lock behind).

`fedsilo deploy` holds the lock in the command's own process and hands a token to the ServerApp it
submits (another process): the ServerApp trusts a lock file holding that token instead of locking.

An `flock` is shared by every process that inherits its descriptor, so a forked child (a client
worker) closes its copy: otherwise workers orphaned by a `kill -9` would keep the directory locked.
"""
from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

from fedsilo.errors import RunDirError, RunLocked


_HELD: set["RunLock"] = set()   # the locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: close the inherited lock descriptors (the parent's lock stays held)."""
    for lock in list(_HELD):
        lock._fh.close()
        lock._fh = None
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLock:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self.token: str | None = None
        self._fh = None

    def acquire(self) -> "RunLock":
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"{self.run_dir} is a file, not a run directory")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().split()
            fh.close()
            pid = f" (process {holder[0]})" if holder else ""
            raise RunLocked(f"{self.run_dir} is in use by another fedsilo run{pid}; wait for it to end "
                            "or choose another --out") from None
        self.token = uuid.uuid4().hex
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {self.token}\n")
        fh.flush()
        self._fh = fh
        _HELD.add(self)
        return self

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
            _HELD.discard(self)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def held_for(run_dir: str | Path, token: str | None) -> bool:
    """True when `token` is the one a live lock holder wrote (the deploy command that submitted us)."""
    if not token:
        return False
    try:
        holder = (Path(run_dir) / ".lock").read_text().split()
    except OSError:
        return False
    return len(holder) == 2 and holder[1] == token
