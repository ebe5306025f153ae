"""Write the multitask fetch manifest (`sources.tsv`) from the catalogue and a verified mirror.

The manifest pins every file a converter reads: its size and sha256 as found in the mirror, and
where it comes from publicly (repository, path in it, commit), read from the mirror's
`MANIFEST.tsv` (`staged_dir  github:owner/repo  commit  licence`). A staged folder mirrors its
repository's tree, except where `REPO_PREFIX` says otherwise; a file that was unpacked from an
archive of the repository (`UNPACKED`) has no public download of its own and is mirror-only.

    python -m fedsilo.tasks.multitask.pin ../shared/data/multitask   # rewrites sources.tsv
"""
from __future__ import annotations

import csv
import hashlib
import sys
from pathlib import Path

from .catalog import CATALOG
from .converters import load_all

MANIFEST = Path(__file__).with_name("sources.tsv")
HEADER = ("path", "size", "sha256", "repo", "path_in_repo", "commit")
REPO_PREFIX = {"ag_news_csv": "data/ag_news_csv", "nltk_data": "packages"}
"""staged folder → its path inside the repository, where that is not the repository's root."""
UNPACKED = {"CoLA-baselines/acceptability_corpus/cola_public/": "acceptability_corpus/cola_public.zip"}
"""staged path prefix → the archive in the repository it was unpacked from."""


def staged_sources(mirror: Path) -> dict[str, tuple[str, str]]:
    """staged folder → (owner/repo, commit), from the mirror's MANIFEST.tsv."""
    with (mirror / "MANIFEST.tsv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return {r["staged_dir"]: (r["source"].removeprefix("github:"), r["commit"]) for r in rows}


def pin_row(mirror: Path, rel: str, staged: dict[str, tuple[str, str]]) -> tuple[str, ...]:
    data = (mirror / rel).read_bytes()
    folder, _, inner = rel.partition("/")
    repo, commit = staged[folder]
    for prefix, archive in UNPACKED.items():
        if rel.startswith(prefix):
            origin = f"unpacked from {repo}@{commit[:12]}:{archive}"
            return rel, str(len(data)), hashlib.sha256(data).hexdigest(), "-", origin, "-"
    path = f"{REPO_PREFIX[folder]}/{inner}" if folder in REPO_PREFIX else inner
    return rel, str(len(data)), hashlib.sha256(data).hexdigest(), repo, path, commit


def needed_files() -> list[str]:
    """Every file fedsilo's own converters read (sorted, once each; a plugin's tasks are its own business)."""
    load_all()
    ours = [CATALOG.get(name) for name in CATALOG]
    return sorted({f for info in ours if info.module.startswith(__package__ + ".converters")
                   for f in info.files})


def manifest_rows(mirror: Path) -> list[tuple[str, ...]]:
    staged = staged_sources(mirror)
    return [pin_row(mirror, rel, staged) for rel in needed_files()]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "MANIFEST.tsv").is_file():
        print("usage: python -m fedsilo.tasks.multitask.pin MIRROR (a folder holding MANIFEST.tsv)", file=sys.stderr)
        return 2
    rows = manifest_rows(Path(args[0]))
    with MANIFEST.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f, delimiter="\t", lineterminator="\n").writerows([HEADER, *rows])
    print(f"{MANIFEST}: {len(rows)} files pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
