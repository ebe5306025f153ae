"""A source as the config writes it: `[task.sources.NAME]`.

    [task.sources.legal]
    path = "legal"                       # a folder holding the split files, or one file to split
    format = "csv"                       # jsonl | json | csv | tsv | lines | benchmark (inferred from the suffix)
    fields = {source = "german", target = "english"}   # role → column (key, or file suffix for lines)
    files = {train = "train.csv", dev = "dev.csv", test = "test.csv"}
    # or, one file split by fraction, grouped so no key crosses splits:
    split = {dev = 0.1, test = 0.1, seed = 0, by = "source"}

Each task family says which roles its examples have (`Roles`); a role left out of `fields` is read
from the column of the same name. Relative paths are relative to the config file's folder (made
absolute when the config is loaded, see `resolve_paths`).
"""
from __future__ import annotations

import codecs
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from fedsilo.errors import ConfigError
from fedsilo.settings import Strict

SPLITS = ("train", "dev", "test")
FORMATS = ("jsonl", "csv", "tsv", "lines", "json")
BENCHMARK = "benchmark"
_SUFFIX_FORMAT = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv"}
PATH_KEYS = ("path", "schema_file", "database")  # a source's keys naming a file (a family adds the last two)


@dataclass(frozen=True)
class Roles:
    """What a task family's examples are made of: `required` roles every row has, `optional` ones
    (e.g. a second reference), `key` the role grouping rows (duplicates, splits, overlap) by default,
    and `lists` the roles a JSONL row may hold as a list (a ranking row's candidates and labels);
    `aliases`: column names `fedsilo init` takes for a role (besides the role's own name); `objects`:
    list roles whose items are JSON objects (chat messages), each read as its JSON text, so a row
    stays text that splits, duplicates and fingerprints compare, and the family parses it;
    `regroup`: roles a split may group by instead of `key` where rows share their key (instruction
    rows that all ask one thing of a different input): init picks one, a split's error names it."""
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    key: str = ""
    lists: tuple[str, ...] = ()
    aliases: tuple[tuple[str, tuple[str, ...]], ...] = ()
    objects: tuple[str, ...] = ()
    regroup: tuple[str, ...] = ()

    def names_for(self, role: str) -> tuple[str, ...]:
        return (role, *dict(self.aliases).get(role, ()))

    @property
    def all(self) -> tuple[str, ...]:
        return self.required + self.optional


class SplitSettings(Strict):
    """A seeded split of one file's rows by fraction; rows sharing a `by` value go to one split."""
    dev: float = Field(0.1, ge=0, lt=1, description="share of the groups held out as dev")
    test: float = Field(0.1, ge=0, lt=1, description="share of the groups held out as test")
    seed: int = Field(0, ge=0, description="the draw's seed (independent of the run seed)")
    by: str | None = Field(None, description="the role grouping rows (default: the family's key, e.g. the "
                                             "source or the question); its text compared case-insensitively")

    @model_validator(mode="after")
    def _train_left(self) -> "SplitSettings":
        if self.dev + self.test >= 1:
            raise ValueError(f"split: dev + test = {self.dev + self.test:g} leaves nothing to train on")
        return self


class SourceSettings(Strict):
    """Where one silo's examples come from. A task family subclasses it to set `ROLES` and add its
    own keys (a schema file, a metric)."""
    ROLES: ClassVar[Roles] = Roles(("text",), key="text")

    format: Literal["benchmark", "jsonl", "json", "csv", "tsv", "lines"] | None = Field(
        None, description="benchmark: the paper's silo of this name; else the files' format (None: from the "
                          "file suffix, .jsonl/.json/.csv/.tsv, also under .gz); json: one array of row objects")
    path: str | None = Field(None, description="a folder holding `files`, or the one file to `split` "
                                               "(for lines: the common prefix, e.g. corpus for corpus.de)")
    fields: dict[str, str | int] = Field(default_factory=dict, description="role → column name (JSONL key, CSV/TSV "
                                         "header, a 0-based column index when header = false, or for lines the file "
                                         "suffix); a role left out reads the column of its own name")
    files: dict[Literal["train", "dev", "test"], str] = Field(
        default_factory=dict, description="split → file (relative to path); a split left out is cut from train "
                                          "by `split`")
    split: SplitSettings | None = Field(None, description="a seeded split by fraction of the train rows")
    header: bool = Field(True, description="csv/tsv: the first line names the columns")
    encoding: str = Field("utf-8", description="the files' text encoding (a BOM is skipped)")
    bad_rows: Literal["error", "skip"] = Field(
        "error", description="a malformed row stops the run (error) or is left out and counted (skip); "
                             "both name it by file:line")
    display: str | None = Field(None, description="the silo's name in tables (default: its config name)")

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, v: str) -> str:
        try:
            codecs.lookup(v)
        except LookupError:
            raise ValueError(f"unknown text encoding {v!r}") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SourceSettings":
        if self.format == BENCHMARK:
            own = [k for k in ("path", "fields", "files", "split") if getattr(self, k)]
            if own:
                raise ValueError(f"format = \"benchmark\" reads the benchmark's own files: remove {', '.join(own)}")
            return self
        if not self.path:
            raise ValueError("path is required (a folder with the split files, or the one file to split)")
        if self.format is None and self.inferred_format() is None:
            raise ValueError(f"format: cannot tell it from the file name {self._sample_name()!r}; set "
                             f"format = one of {', '.join(FORMATS)}")
        roles = self.ROLES.all
        unknown = [r for r in self.fields if r not in roles]
        if unknown:
            raise ValueError(f"fields: {unknown[0]!r} is not a role of this task's examples; roles: {', '.join(roles)}")
        if not self.header and self.format_name not in ("csv", "tsv"):
            raise ValueError(f"header = false applies to csv and tsv files, not {self.format_name}")
        if self.format_name == "lines":
            if any(not isinstance(self.fields.get(r), str) for r in self.ROLES.required):
                example = ", ".join(f'{r} = "{r[:2]}"' for r in self.ROLES.required)
                raise ValueError("fields: format \"lines\" reads one file per role (PREFIX.SUFFIX): give each "
                                 f"role its file suffix, e.g. fields = {{{example}}}")
        elif self.format_name in ("csv", "tsv") and not self.header and any(
                not isinstance(self.fields.get(r), int) for r in self.ROLES.required):
            example = ", ".join(f"{r} = {i}" for i, r in enumerate(self.ROLES.required))
            raise ValueError(f"header = false: give every role its 0-based column index, e.g. fields = {{{example}}}")
        missing = [s for s in SPLITS if s not in self.files]
        if "train" not in self.files and self.files:
            raise ValueError("files: train is required when files are given per split (dev and test may be cut "
                             "from it with split)")
        if missing and self.files and self.split is None:
            raise ValueError(f"files: no {' / '.join(missing)} file: give it, or cut it from train with "
                             "split = {dev = 0.1, test = 0.1}")
        if self.split is not None:
            by = self.split.by or self.ROLES.key
            if by not in roles:
                raise ValueError(f"split.by: {by!r} is not a role; roles: {', '.join(roles)}")
            cut = [s for s in ("dev", "test") if s not in self.files and getattr(self.split, s) == 0]
            if cut:
                raise ValueError(f"split.{cut[0]} = 0 leaves no {cut[0]} split: give a share, or files.{cut[0]}")
        elif not self.files:
            raise ValueError("give files per split (files = {train = ..., dev = ..., test = ...}) or "
                             "split = {dev = 0.1, test = 0.1} to split the one file")
        return self

    def _sample_name(self) -> str:
        return next(iter(self.files.values()), None) or self.path or ""

    def inferred_format(self) -> str | None:
        """From the file's suffix, a gzip-compressed file's inner one (train.csv.gz: csv)."""
        name = Path(self._sample_name())
        return _SUFFIX_FORMAT.get((name.with_suffix("") if name.suffix.lower() == ".gz" else name).suffix.lower())

    @property
    def format_name(self) -> str:
        """The format, inferred from the file suffix when not set."""
        return self.format or self.inferred_format() or ""

    @property
    def is_benchmark(self) -> bool:
        return self.format == BENCHMARK

    def column(self, role: str) -> str | int:
        return self.fields.get(role, role)

    # A family whose JSON rows come in more than one kind (an instruct silo's chat or Alpaca rows) says
    # which kind a row is, so a row of the other kind is named as one, not as a missing key.
    ROW_KINDS: ClassVar[dict[str, str]] = {}
    """kind → the setting with which a source reads rows of that kind; {}: one kind."""

    @property
    def kind_read(self) -> str | None:
        """The kind of row this source reads (a key of ROW_KINDS)."""
        return None

    def row_kind(self, obj: dict) -> str | None:
        """The kind of row a JSON object is; None when it is none the family knows."""
        return None

    def split_by(self) -> str:
        return (self.split.by if self.split else None) or self.ROLES.key


def resolve_paths(raw_sources: object, base: Path) -> None:
    """Make each raw `[task.sources.NAME]` entry's relative paths relative to `base` (the config
    file's folder), in place, before validation: a run directory's config.toml then names the same
    files from anywhere, and so does a Flower process."""
    if not isinstance(raw_sources, dict):
        return
    for name, entry in raw_sources.items():
        if not isinstance(entry, dict):
            continue
        for key in PATH_KEYS:
            value = entry.get(key)
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                entry[key] = str(real_path(base / value, f"task.sources.{name}.{key} = {value!r}"))
            elif isinstance(value, str) and value.startswith("~"):
                entry[key] = str(Path(value).expanduser())


def real_path(path: Path, named: str) -> Path:
    """`path` absolute, symlinks resolved; a symlink loop is a ConfigError naming it (`named`: the
    config entry that leads there), not the RuntimeError Python raises."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as err:  # Python < 3.13: RuntimeError("Symlink loop ..."); later: OSError
        if isinstance(err, OSError) and err.errno != errno.ELOOP:
            raise ConfigError(f"{named}: {path}: {err.strerror or err}") from None
        raise ConfigError(f"{named}: {path} is a symlink loop (a link that leads back to itself)") from None
