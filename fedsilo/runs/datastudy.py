"""`fedsilo data check STUDY.toml`: what a study will run, checked before it runs. Its runs (each
variant after its overrides, once per seed, loaded as `fedsilo study` loads them) are grouped by data
setup: the same [task] section read through the same tokenizer gives the same examples and token counts.
Each setup is checked once, as `fedsilo data check` checks a run config, with those runs' own tokenizer
and lengths (a base config checked alone would count with its own), and its block names the variants
and seeds it covers.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsilo.config import RunConfig
from fedsilo.tasks.tokenizer_source import model_kind_name, saved_tokenizer

from .datareport import DataCheck, check_config
from .studyfile import load_study


def is_study(path: str | Path) -> bool:
    """Whether `path` reads as a study file ([study] or [variants.NAME]); what does not read as TOML is
    left to the run config's loader, whose error says why."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        raw = tomllib.loads(path.read_text())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return False
    return "study" in raw or "variants" in raw


def setup_key(cfg: RunConfig) -> str:
    """What decides a run's examples and token counts: its [task] section and its tokenizer (the model
    kind and name a run builds, and the tokenizer saved beside `model.init_from`, if any)."""
    saved = saved_tokenizer(cfg.model.init_from)
    return json.dumps([cfg.task.model_dump(mode="json"), *model_kind_name(cfg), str(saved) if saved else None],
                      sort_keys=True)


@dataclass
class Setup:
    """One data setup: a run config that has it, and the runs that share it (variant → seeds)."""
    cfg: RunConfig
    runs: dict[str, list[int | None]] = field(default_factory=dict)
    check: DataCheck | None = None

    def covers(self) -> str:
        """The variants, and their seeds (none named when the study gives none: each config's own)."""
        seeds = {tuple(s) for s in self.runs.values()}
        if len(seeds) == 1:
            return (f"variant{'s' if len(self.runs) > 1 else ''} {', '.join(self.runs)}"
                    + (f"; {_seeds(self.runs[next(iter(self.runs))])}" if seeds != {(None,)} else ""))
        return "variants " + ", ".join(f"{name} ({_seeds(s)})" for name, s in self.runs.items())


def _seeds(seeds: list[int | None]) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def _many(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


@dataclass
class StudyPlan:
    name: str
    variants: int
    seeds: list[int] | None
    setups: list[Setup]


def study_setups(path: str | Path, assignments: list[str]) -> StudyPlan:
    """Every run of the study (its [study] seeds, as `fedsilo study` makes them) grouped by data setup,
    in the order the study runs them."""
    settings, configs = load_study(path, assignments)
    seeds = settings.seeds
    plan = {None: configs} if seeds is None else {
        seed: load_study(path, assignments, None, seed, len(seeds) > 1)[1] for seed in seeds}
    setups: dict[str, Setup] = {}
    for seed, runs in plan.items():
        for name, cfg in runs.items():
            setups.setdefault(setup_key(cfg), Setup(cfg)).runs.setdefault(name, []).append(seed)
    return StudyPlan(settings.name, len(configs), seeds, list(setups.values()))


@dataclass
class StudyCheck:
    plan: StudyPlan

    @property
    def blocking(self) -> bool:
        return any(s.check.blocking for s in self.plan.setups)

    def text(self) -> str:
        p, n = self.plan, len(self.plan.setups)
        runs = sum(len(s) for setup in p.setups for s in setup.runs.values())
        each = (f"{_many(p.variants, 'variant')} × {_many(len(p.seeds), 'seed')}" if p.seeds
                else f"{_many(p.variants, 'variant')}, once each")
        lines = [f"study {p.name}: {_many(runs, 'run')} ({each}) in {_many(n, 'data setup')}"]
        for i, setup in enumerate(p.setups, 1):
            lines += ["", f"data setup {i} of {n}: {setup.covers()}", setup.check.text()]
        blocked = [str(i) for i, s in enumerate(p.setups, 1) if s.check.blocking]
        verdict = (f"data setup{'s' if len(blocked) > 1 else ''} {', '.join(blocked)} cannot be run" if blocked
                   else "every data setup ready to run")
        lines += ["", f"study {p.name}: {verdict}"]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"study": self.plan.name, "setups": [{"runs": s.runs, "silos": s.check.to_json()}
                                                    for s in self.plan.setups]}


def check_study(plan: StudyPlan, build: bool = True) -> StudyCheck:
    """Each data setup checked once, as `fedsilo data check` checks one of its runs' configs."""
    for setup in plan.setups:
        setup.check = check_config(setup.cfg, build)
    return StudyCheck(plan)
