"""What `fedsilo init` reads from names alone: a file's format and split from its name (train.de.gz,
newstest2019.csv), a silo's name from its file or folder (café.csv: cafe, shown as café), names told
apart when two files share one, and the names a config cannot hold (not UTF-8)."""
from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from fedsilo.runs.init_peek import head, one_array
from fedsilo.runs.init_text import Guess
from fedsilo.tasks import SILO_NAME

DATA_SUFFIXES = {"csv": "csv", "tsv": "tsv", "jsonl": "jsonl", "json": "json"}
SPLIT_NAMES = {"train": "train", "training": "train", "dev": "dev", "valid": "dev", "validation": "dev",
               "val": "dev", "test": "test", "testing": "test"}
SPLIT_ENDINGS = ("test", "dev")  # a word ending so names its split too (newstest2019, newsdev)


@dataclass(frozen=True)
class FileName:
    """A file's name as init reads it: train.de.gz is stem train, suffix de, gzip-compressed."""
    path: Path
    stem: str
    suffix: str   # without the dot, "" when none
    gz: bool

    @classmethod
    def of(cls, path: Path) -> "FileName":
        name = path.name
        gz = name.lower().endswith(".gz") and len(name) > 3
        inner = Path(name[:-3] if gz else name)
        return cls(path, inner.stem if inner.suffix else inner.name, inner.suffix[1:], gz)

    @property
    def table(self) -> str | None:
        """csv, tsv, jsonl or json when the file is one."""
        return DATA_SUFFIXES.get(self.suffix.lower())

    @property
    def rows(self) -> bool:
        """A file of rows: a table, a .json one holding a JSON array (not dataset_info.json's object)."""
        return bool(self.table) and (self.table != "json" or one_array(head(self.path)))

    @property
    def lines_name(self) -> str:
        """The name a `lines` source gives it (PREFIX.SUFFIX; the reader finds the .gz itself)."""
        return f"{self.stem}.{self.suffix}"


def distinct_names(guesses: list[Guess], paths: list[Path]) -> None:
    """Silos sharing a name (bank.csv and bank.jsonl) are told apart by their suffix (bank_csv,
    bank_jsonl), then by a number: a config cannot declare one source twice."""
    count: dict[str, int] = {}
    for g in guesses:
        count[g.name] = count.get(g.name, 0) + 1
    for g, p in zip(guesses, paths):
        if count[g.name] > 1 and p.is_file():
            g.name = clean_name(f"{g.name}_{FileName.of(p).suffix or 'file'}")
    seen: set[str] = set()
    for g in guesses:
        name, n = g.name, 2
        while name in seen:
            name, n = clean_name(f"{g.name}_{n}"), n + 1
        g.name = name
        seen.add(name)


def clean_name(name: str) -> str:
    """A silo name (ASCII letters, digits, _ - .: it is a bare TOML key and names a folder in a run):
    accents dropped (café: cafe), any other character "_"."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", ascii_name).strip("._-") or "silo"
    if not SILO_NAME.fullmatch(clean):
        clean = ("s" + clean)[:64]
    return clean


def own_name(path: Path) -> str:
    return path.name if path.is_dir() else FileName.of(path).stem


def keep_display(g: Guess, path: Path) -> None:
    """A silo whose file name is no silo name (café.csv: silo cafe) keeps it as its name in tables."""
    own = own_name(path)
    if clean_name(own) != own and own.isprintable():  # not a name with a line break or undecodable bytes
        g.entry["display"] = own
        g.comments["display"] = (f"the file's name; the silo's name is {g.name}: a silo name is ASCII letters, "
                                 "digits, _ - . (it names the silo's folder in a run)")


def split_of(stem: str) -> tuple[str | None, bool]:
    """(split, whether the name is exactly a split's): train, valid, test; else a name holding one
    split's word (test_2019, newstest2019, dev-2010), which init takes and says so."""
    low = stem.lower()
    if low in SPLIT_NAMES:
        return SPLIT_NAMES[low], True
    words = re.findall(r"[a-z]+", low)
    found = {SPLIT_NAMES[w] for w in words if w in SPLIT_NAMES}
    found |= {s for w in words for s in SPLIT_ENDINGS if w.endswith(s) and w not in SPLIT_NAMES}
    return (found.pop(), False) if len(found) == 1 else (None, False)


def unnamable(path: Path) -> str | None:
    """Why a config cannot name `path`: a file name that is not UTF-8 (TOML is UTF-8 text), or None."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not UTF-8 text, which a config cannot hold: rename it"
    return None


def shown(path: Path) -> str:
    """The entry's name as a terminal can print it (an undecodable byte as U+FFFD)."""
    return os.fsencode(path.name).decode("utf-8", "replace")
