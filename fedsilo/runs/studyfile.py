"""A study file read into one validated run config per variant (and per seed).

A study file is TOML with three parts:

    [study]                  name, title, metrics (the columns per client; default: the task's primary),
                             seeds (e.g. [0, 1, 2]; default: the config's own seed, run once),
                             baseline (the variant the others are checked against; default: the first),
                             alpha (the significance level of those checks; default 0.05)
    [base]                   a whole run config (or what changes `[study] config`, a run config file)
    [variants.NAME]          what each variant changes in the base (deep-merged), e.g. paradigm = "finetune"

Seed S sets the run's `seed` (model init, data order, dropout, client sampling) and, for a task with a
few-shot sample seed (multitask's `task.sample_seeds`), draws another sample too: each configured
sample seed plus S, so seed 0 keeps the configured sample. Both move a result between runs of one
method, so both belong in its spread. A variant that sets `task.sample_seeds` itself keeps it for
every seed, and `[study] vary_sample = false` keeps the sample fixed everywhere (training noise only).
Running the variants is study.py; this module only reads and validates, so a study file is checked
(and bench scripts build a variant's config exactly as a study does) without running anything.
"""
from __future__ import annotations

import copy
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from fedsilo.config import ConfigError, RunConfig, Strict, apply_overrides, locate_files, validate
from fedsilo.fileio import regular_file
from fedsilo.recipe import build_recipe

__all__ = ["StudySettings", "load_study", "parse_seeds", "check_seeds", "deep_merge", "seeded"]

SAMPLE_SEEDS = "sample_seeds"  # a task's few-shot sample seeds (multitask); a study seed shifts them
MAX_SEED = 2**63  # RunConfig.seed's bound
PLAIN_NAME = re.compile(r"\w[\w.+-]*")  # a variant's name is its folder's name


class StudySettings(Strict):
    name: str
    title: str = ""
    metrics: list[str] | None = Field(None, description="metric keys shown per client; None: the task's primary")
    seeds: list[int] | None = Field(None, description="run each variant once per seed; None: the config's seed")
    baseline: str | None = Field(None, description="the variant the others are checked against; None: the first")
    alpha: float = Field(0.05, gt=0, lt=1, strict=True, description="significance level of the claims against the baseline "
                                                      "(runs/significance.py): p below it holds or is reversed")
    vary_sample: bool = Field(True, description="a seed also shifts the task's few-shot sample seeds")
    config: str | None = Field(None, description="a run config file (relative to the study file) that is the base, "
                                                 "[base] then changing it: e.g. the one `fedsilo init` wrote")


def check_seeds(seeds: Sequence[int], where: str) -> list[int]:
    """The seeds as a list, or a ConfigError naming the first problem: none, negative, too large, repeated."""
    if not seeds:
        raise ConfigError(f"{where}: no seeds; give non-negative integers, e.g. 0,1,2")
    seen: set[int] = set()
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{where}: {seed!r} is not an integer")
        if not 0 <= seed < MAX_SEED:
            raise ConfigError(f"{where}: {seed} is out of range (a seed is 0 … 2**63−1)")
        if seed in seen:
            raise ConfigError(f"{where}: seed {seed} is given twice")
        seen.add(seed)
    return list(seeds)


def parse_seeds(text: str, where: str = "--seeds") -> list[int]:
    """`--seeds 0,1,2` → [0, 1, 2]; anything else is one ConfigError (exit code 2 from the CLI)."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        return check_seeds([], where)
    seeds = []
    for part in parts:
        try:
            seeds.append(int(part))
        except ValueError:
            raise ConfigError(f"{where}: {part!r} is not an integer (expected e.g. 0,1,2)") from None
    return check_seeds(seeds, where)


def deep_merge(base: Mapping[str, Any], change: Mapping[str, Any]) -> dict:
    """`base` with `change` laid over it: tables merge key by key, any other value replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in change.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def seeded(cfg: RunConfig, seed: int, vary_sample: bool = True) -> RunConfig:
    """`cfg` run with `seed`; with `vary_sample`, a task's few-shot sample seeds shifted by `seed` too
    (seed 0 keeps the configured sample, so a one-seed study at 0 is today's run)."""
    update: dict[str, Any] = {"seed": seed}
    if vary_sample and SAMPLE_SEEDS in type(cfg.task).model_fields:
        shifted = [s + seed for s in getattr(cfg.task, SAMPLE_SEEDS)]
        update["task"] = cfg.task.model_copy(update={SAMPLE_SEEDS: shifted})
    return cfg.model_copy(update=update)


def _read_toml(path: Path, what: str, missing: str) -> dict:
    """The TOML file `what` names; one that is there but is not a regular file (a FIFO would block the
    reader for ever, a folder) is refused by name before it is opened."""
    if not os.path.lexists(path):
        raise ConfigError(missing)
    regular_file(path, what, ConfigError)
    try:
        return tomllib.loads(path.read_text())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def load_study(path: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
               seed: int | None = None, multi_seed: bool = False) -> tuple[StudySettings, dict[str, RunConfig]]:
    """(settings, {variant: validated config}); `assignments` (`--set`) change the base. With `seed`,
    each config is `seeded` (its name gains /seed-S when `multi_seed`)."""
    path = Path(path)
    raw = _read_toml(path, "study file", f"study file not found: {path}")
    unknown = sorted(set(raw) - {"study", "base", "variants"})
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]}: unknown section (a study has [study], [base], [variants.NAME])")
    try:
        settings = StudySettings.model_validate(raw.get("study", {}))
    except ValidationError as err:  # one line naming the key and the value, not pydantic's block
        first = err.errors()[0]
        key = ".".join(map(str, first["loc"])) or "study"
        raise ConfigError(f"{path}: [study]: {key}: {first['msg']} (got {first.get('input')!r})") from None
    except ValueError as err:
        raise ConfigError(f"{path}: [study]: {err}") from None
    if settings.seeds is not None:
        check_seeds(settings.seeds, f"{path}: [study] seeds")
    variants = raw.get("variants") or {}
    if not variants or not all(isinstance(v, dict) for v in variants.values()):
        raise ConfigError(f"{path}: needs at least one [variants.NAME] table")
    bad = next((name for name in variants if not PLAIN_NAME.fullmatch(name)), None)
    if bad is not None:  # it names the variant's folder under --out: "../x" would write outside it
        raise ConfigError(f"{path}: [variants] {bad!r} is not a plain name (letters, digits, _ . + -, not starting "
                          "with . or -): rename the variant")
    if settings.baseline is not None and settings.baseline not in variants:
        raise ConfigError(f"{path}: [study] baseline {settings.baseline!r}: no such variant ({', '.join(variants)})")
    if only:
        missing = [v for v in only if v not in variants]
        if missing:
            raise ConfigError(f"--only {missing[0]!r}: no such variant in {path} ({', '.join(variants)})")
        variants = {k: v for k, v in variants.items() if k in only}
    base = dict(raw.get("base") or {})
    if settings.config is not None:  # a run config file as the base; [base] changes it
        source = (path.parent / settings.config).expanduser()
        own = _read_toml(source, f"{path}: [study] config", f"{path}: [study] config: {source} is not a file")
        base = deep_merge(locate_files(own, source.parent), base)  # its paths: relative to its own folder
    base = apply_overrides(base, list(assignments))
    suffix = f"/seed-{seed}" if multi_seed else ""
    configs = {}
    for name, change in variants.items():
        merged = locate_files(deep_merge(base, change), path.parent)  # plugins, silo files: beside the study file
        where = f"{path} [variants.{name}]"
        cfg = validate({**merged, "name": f"{settings.name}/{name}{suffix}"}, where, warn=True)
        build_recipe(cfg, where)  # every variant's combination checked before any runs
        if seed is not None:  # a variant's own sample seeds are held fixed: it asked for that sample
            cfg = seeded(cfg, seed, settings.vary_sample and SAMPLE_SEEDS not in (change.get("task") or {}))
        configs[name] = cfg
    _check_metrics(settings.metrics or [], configs.values(), path)
    return settings, configs


def _check_metrics(metrics: Sequence[str], configs, path: Path) -> None:
    """A `[study] metrics` key the task does not compute would show as an empty column: refused, with the
    task's keys (its MetricSpec's columns, which results.json records)."""
    from fedsilo.tasks import TASKS

    for cfg in configs:
        keys = [c.key for c in TASKS.get(cfg.task.name).spec().columns]
        unknown = next((m for m in metrics if m not in keys), None)
        if unknown is not None:
            raise ConfigError(f"{path}: [study] metrics: {unknown!r} is not a metric of the {cfg.task.name} task "
                              f"(its metrics: {', '.join(keys)})")
