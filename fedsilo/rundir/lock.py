"""One run directory, one writer: an exclusive lock held for the whole run.

Two runs writing one `--out` would interleave rounds.jsonl and overwrite each other's checkpoints;
the second one fails at once instead. The lock is an `flock` on `OUT/.lock`, so it vanishes with
the process that held it (a killed run never leaves a stale lock behind). Released, the lock takes
its file with it (a run that opened the file just before then finds it gone after its flock, and
locks afresh), and when it is let go on an error, the folders it made if they are left empty: a run
refused at its start leaves no --out behind.

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
        self._made: list[Path] = []  # the folders acquire() created, deepest first

    def acquire(self) -> "RunLock":
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"{self.run_dir} is a file, not a run directory")
        self._made = []
        while True:
            self._made += _missing_folders(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fh = open(self.path, "a+")
            except FileNotFoundError:  # a holder letting go removed the folder in between
                continue
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().split()
                fh.close()
                pid = f" (process {holder[0]})" if holder else ""
                raise RunLocked(f"{self.run_dir} is in use by another fedsilo run{pid}; wait for it to end "
                                "or choose another --out") from None
            if _same_file(fh, self.path):
                break
            fh.close()  # its holder removed it as it let go: lock the one at the path now
        self.token = uuid.uuid4().hex
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {self.token}\n")
        fh.flush()
        self._fh = fh
        _HELD.add(self)
        return self

    def release(self, failed: bool = False) -> None:
        """Let go; `failed`: on an error, which also removes the folders acquire() made, those left empty."""
        if self._fh is not None:
            self.path.unlink(missing_ok=True)  # still held: no other run can be locking this file
            if failed:
                self._remove_made()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
            _HELD.discard(self)

    def _remove_made(self) -> None:
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): it and its parents stay
                break

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, exc_type, *exc) -> None:
        self.release(failed=exc_type is not None)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _same_file(fh, path: Path) -> bool:
    """Whether the open `fh` is still the file at `path` (not one a releasing holder unlinked)."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fh.fileno())
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def held_for(run_dir: str | Path, token: str | None) -> bool:
    """True when `token` is the one a live lock holder wrote (the deploy command that submitted us)."""
    if not token:
        return False
    try:
        holder = (Path(run_dir) / ".lock").read_text().split()
    except OSError:
        return False
    return len(holder) == 2 and holder[1] == token
