"""The folder `fedsilo export` writes: whole or not at all, and never one it was not told to replace.

The export is written into a temporary sibling (.DIR.exporting-PID) and renamed into place once complete,
so a failed export (a full disk, an error half-way) leaves no folder that looks like a model. An --out
that holds files (another model, the user's own) is replaced only with --force, and then as a whole:
nothing of the old folder mixes with the new export. The run itself, a folder that holds it, the
current folder and the home folder are never replaced.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedsilo.errors import UserError

__all__ = ["check_out", "written_whole"]


def check_out(out: Path, run: Path, force: bool) -> None:
    """Refuse `out` before anything is loaded or written: a file, a folder that holds the run (or the
    current or home folder), or one that holds files without `force`."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder: name a folder for the export")
    held = out.resolve()
    for kept, what in ((run, f"the run {run}"), (Path.cwd(), "the current folder"), (Path.home(), "the home folder")):
        kept = kept.resolve()
        if held == kept or held in kept.parents:
            raise UserError(f"--out {out} holds {what}, which an export never replaces: name another folder")
    present = sorted(p.name for p in out.iterdir())
    if present and not force:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise UserError(f"--out {out} already holds {shown}: pass --force to replace that folder with the export, "
                        "or name a new or empty folder")


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write into; in `out`'s place once the block ends, gone if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    writing = out.parent / f".{out.name}.exporting-{os.getpid()}"
    shutil.rmtree(writing, ignore_errors=True)
    writing.mkdir()
    try:
        yield writing
    except BaseException:
        shutil.rmtree(writing, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    if out.exists() or out.is_symlink():  # an empty folder, or one --force replaces
        os.replace(out, old)
    os.replace(writing, out)
    if old.is_symlink():
        old.unlink()
    elif old.exists():
        shutil.rmtree(old)
