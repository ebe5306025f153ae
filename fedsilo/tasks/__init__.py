"""Task plug-ins: one registry, one entry per task family, selected by `task.name` in a config.

An entry's settings class is the task's own `[task]` config section (validated strictly); its value
is a `TaskPlugin` that builds the task lazily, so validating a config imports no model or data code.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedsilo.datafetch import default_data_root, ensure
from fedsilo.errors import DataError
from fedsilo.registry import Registry
from fedsilo.settings import SectionError


class TaskSettings(BaseModel):
    """Keys every task section has; a task's settings class adds its own."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    data_dir: str | None = Field(None, description="None: fetch and verify into the data cache")
    eval_batch_size: int = Field(32, gt=0)

    SOURCE: ClassVar[type | None] = None        # the family's `fedsilo.sources.SourceSettings` (own silos)
    BENCHMARK: ClassVar[tuple[str, ...]] = ()   # the benchmark's silo names (sources of format "benchmark")
    DISPLAY: ClassVar[dict[str, str]] = {}      # their names in tables

    @model_validator(mode="before")
    @classmethod
    def _silos_default_to_sources(cls, raw: Any) -> Any:
        """With own sources and no `silos`, the run's silos are the sources (in config order)."""
        if isinstance(raw, dict) and raw.get("sources") and "silos" not in raw and "silos" in cls.model_fields:
            return {**raw, "silos": list(raw["sources"])}
        return raw

    def own_source(self, silo: str):
        """Silo `silo`'s own source (a `fedsilo.sources.SourceSettings`), None for a benchmark silo."""
        source = (getattr(self, "sources", None) or {}).get(silo)
        return None if source is None or source.is_benchmark else source

    def needed_silos(self) -> list[str]:
        """Every silo whose data this config reads (the run's, and any read besides: a test matrix)."""
        return self.client_names()

    def needs_benchmark(self) -> bool:
        """Whether any silo read is a benchmark silo (else no benchmark files are fetched)."""
        return any(self.own_source(s) is None for s in self.needed_silos())

    def display_names(self) -> dict[str, str]:
        """silo → its name in tables: an own source's `display`, else the benchmark's, else its name."""
        out = dict(self.DISPLAY)
        for name, source in (getattr(self, "sources", None) or {}).items():
            if source.display:
                out[name] = source.display
        return out

    def client_names(self) -> list[str]:
        """The participants this config selects (silos, or multi-task clients)."""
        raise NotImplementedError

    def known_clients(self) -> list[str]:
        """Every participant name a config may mention (e.g. in [clients.<name>] overrides)."""
        raise NotImplementedError

    def for_silos(self, names: list[str]) -> "TaskSettings":
        """These settings as one machine holding only `names` sees them (a Flower silo)."""
        return self.model_copy(update={"silos": list(names)})

    def alone(self, silo: str) -> "TaskSettings":
        """These settings for `silo` trained on its own (a finetune run's per-silo run)."""
        return self.model_copy(update={"silos": [silo]})


class SiloTaskSettings(TaskSettings):
    """A task whose participants are silos named in `silos`: the benchmark's (`BENCHMARK`) and the
    config's own sources (`sources`, of the family's `SOURCE` class), one client each. Subclasses
    declare `sources: dict[str, TheirSource]` and `silos` with the benchmark as default."""

    @field_validator("sources", check_fields=False)
    @classmethod
    def _sources(cls, v: dict) -> dict:
        return check_sources(v, cls.BENCHMARK)

    @model_validator(mode="after")
    def _known_silos(self) -> "SiloTaskSettings":
        check_names(self.silos, self.known_clients(), section=True)
        return self

    def client_names(self) -> list[str]:
        return list(self.silos)

    def known_clients(self) -> list[str]:
        return list(dict.fromkeys([*self.BENCHMARK, *self.sources]))

    def for_silos(self, names: list[str]) -> "SiloTaskSettings":
        """Only `names` and their own sources (a silo's machine knows nothing of another's files)."""
        return self.model_copy(update={"silos": list(names),
                                       "sources": {k: v for k, v in self.sources.items() if k in names}})


def sources_field(what: str = "files, format, fields and splits"):
    """The `sources` field every silo task declares (its own value type)."""
    return Field(default_factory=dict, description=f"own silos (and benchmark ones, format = \"benchmark\") by "
                                                   f"name: their {what} (docs/your-data.md)")


def silos_field(benchmark: Sequence[str], what: str):
    return Field(default_factory=lambda: list(benchmark),
                 description=f"the run's silos: benchmark {what} and [task.sources] names (default: the sources "
                             f"if any, else the benchmark's)")


SILO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_sources(sources: dict, benchmark: Sequence[str]) -> dict:
    """`[task.sources.NAME]` entries: a name fit for a folder; "benchmark" only for a benchmark
    silo's name, and a benchmark silo's name only for "benchmark" (an own silo must not pass for it)."""
    for name, source in sources.items():
        if not SILO_NAME.fullmatch(name):
            raise SectionError(f"task.sources.{name}: a silo name is letters, digits, '_', '-', '.' (at most 64, "
                             "starting with a letter or digit): it names the silo's folder in a run")
        if source.is_benchmark and name not in benchmark:
            raise SectionError(f"task.sources.{name}: format = \"benchmark\" but no benchmark silo is called {name!r}; "
                             f"they are {', '.join(benchmark)}")
        if not source.is_benchmark and name in benchmark:
            raise SectionError(f"task.sources.{name}: {name!r} is a benchmark silo's name; give your silo another name")
    return sources


def check_names(names: list[str], known: Sequence[str], kind: str = "silo", what: str = "silos",
                empty_ok: bool = False, section: bool = False) -> list[str]:
    """A config's list of clients (silos, domains): known names, no repeats, non-empty unless allowed.
    `section`: the error names its key in full (`task.<what>: ...`), as a check of the whole section
    (which sees the own sources too) must."""
    error = SectionError if section else ValueError
    where = f"task.{what}: " if section else ""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise error(f"{where}unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    if (not names and not empty_ok) or len(set(names)) != len(names):
        raise error(f"{'task.' if section else ''}{what} must be a {'' if empty_ok else 'non-empty '}list without "
                    "repeats")
    return names


@dataclass(frozen=True)
class TaskPlugin:
    """How a task is built, and where its data comes from.

    `verify(settings, data_dir)` checks an explicit `task.data_dir` as the cache is checked by its
    sha256 pins, before the task loads it: it raises `fedsilo.datafetch.DataError` naming the file
    and what is wrong (a needed file missing, a database that does not open), and warns
    (`DataChangedWarning`, see `datafetch.differs_from_pins`) where a well-formed file differs from
    a pinned one, since users may edit data. It runs at every start on every engine (in-process,
    Flower simulation, each deployed silo on its own copy), so it stays cheap and checks only the
    files `settings` needs; what the loader parses anyway (records, columns) the loader checks.
    """
    build: Callable[..., object]          # (settings, tokenizer, data_dir: Path) -> Task
    spec: Callable[[], object]            # () -> the task's MetricSpec (lazy: no data needed)
    data: str | None = None               # datafetch manifest name; None: no fetch
    default_model: dict = field(default_factory=dict)  # model config defaults for this task
    verify: Callable[[TaskSettings, Path], None] | None = None  # checks an explicit data_dir
    # (settings, data_dir) -> the task's own tokenizer, for models trained from scratch on it
    tokenizer: Callable[[TaskSettings, Path], object] | None = None
    # (settings, silo) -> the files (relative to the data folder) one silo's machine needs;
    # None: the files named after the silo (text2sql's NAME.json, NAME-schema.csv)
    silo_files: Callable[[TaskSettings, str], list[str]] | None = None
    # (settings, silo, data_dir) -> a `fedsilo.sources.check.SiloCheck` of that silo's data, every
    # malformed row listed (not refused); None: `fedsilo data check` counts the built task's examples
    inspect: Callable[[TaskSettings, str, Path | None], object] | None = None
    # (settings) -> the manifest's paths (licences too) that `settings` reads, fetched into the cache
    # when it has no `data_dir`; None: the whole manifest
    fetch_files: Callable[[TaskSettings], list[str]] | None = None

    def data_dir(self, settings: TaskSettings) -> Path | None:
        """The task's verified data folder: `data_dir` as given (checked by `verify`), else fetched
        into the cache."""
        if not settings.needs_benchmark():
            return None  # own sources only: they name their own files
        if settings.data_dir:
            path = Path(settings.data_dir)
            if not path.is_dir():
                raise DataError(f"task.data_dir: {path} is not a folder")
            if self.verify is not None:
                self.verify(settings, path)
            return path
        if self.data is None:
            return None
        try:
            return ensure(self.data, default_data_root() / self.data,
                          only=None if self.fetch_files is None else self.fetch_files(settings))
        except DataError as err:
            read = [s for s in settings.needed_silos() if settings.own_source(s) is None]
            raise DataError(f"{err} (this config reads the {self.data} benchmark's silo(s) {', '.join(read)}: its "
                            "silos and any public text its tokenizer is fitted on)") from None


TASKS: Registry[TaskPlugin] = Registry("task")
