"""A study: several variants of one base config, run one after another and compared in one table.

A study file is TOML with three parts:

    [study]                  name, title, metrics (the columns per client; default: the task's primary)
    [base]                   a whole run config
    [variants.NAME]          what each variant changes in the base (deep-merged), e.g. paradigm = "finetune"

Each variant runs into OUT/NAME exactly as `fedsilo run --resume` would (a finished one returns its
recorded results, an interrupted one continues). The comparison — untrained reference rankers the
task scores (e.g. BM25), then each variant — is printed and written to OUT/report.md and
OUT/study.json, with each variant's parameters sent and wall time.
"""
from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from fedsilo.config import ConfigError, RunConfig, Strict, apply_overrides, validate
from fedsilo.fileio import atomic_write_bytes
from fedsilo.progress import Display

from .report import _column, _fmt, _print_grid, display_name, exchange_totals, markdown_table, read_rounds, write_report

__all__ = ["StudySettings", "load_study", "run_study", "comparison_table"]


class StudySettings(Strict):
    name: str
    title: str = ""
    metrics: list[str] | None = Field(None, description="metric keys shown per client; None: the task's primary")


def deep_merge(base: Mapping[str, Any], change: Mapping[str, Any]) -> dict:
    """`base` with `change` laid over it: tables merge key by key, any other value replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in change.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_study(path: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None
               ) -> tuple[StudySettings, dict[str, RunConfig]]:
    """(settings, {variant: validated config}); `assignments` (`--set`) change the base."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"study", "base", "variants"})
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]}: unknown section (a study has [study], [base], [variants.NAME])")
    try:
        settings = StudySettings.model_validate(raw.get("study", {}))
    except ValueError as err:
        raise ConfigError(f"{path}: [study]: {err}") from None
    variants = raw.get("variants") or {}
    if not variants or not all(isinstance(v, dict) for v in variants.values()):
        raise ConfigError(f"{path}: needs at least one [variants.NAME] table")
    if only:
        missing = [v for v in only if v not in variants]
        if missing:
            raise ConfigError(f"--only {missing[0]!r}: no such variant in {path} ({', '.join(variants)})")
        variants = {k: v for k, v in variants.items() if k in only}
    base = apply_overrides(dict(raw.get("base") or {}), list(assignments))
    configs = {name: validate({**deep_merge(base, change), "name": f"{settings.name}/{name}"},
                              f"{path} [variants.{name}]") for name, change in variants.items()}
    return settings, configs


def comparison_table(named_results: Mapping[str, Mapping[str, Any]], metrics: Sequence[str],
                     display: Mapping[str, str] | None = None) -> list[list[str]]:
    """One line per method (header first), one column per client, then "Overall": each metric's
    macro mean over clients (the mean over silos, as the FedMatch paper reports it). A cell holds
    the metrics joined by " / " (the header's first cell names them)."""
    clients = list(dict.fromkeys(r["client"] for res in named_results.values() for r in res["test"]["rows"]))
    spec = next(iter(named_results.values())).get("metric_spec")
    label = " / ".join((_column(spec, m) or {}).get("label", m) for m in metrics)
    fmt = {m: (_column(spec, m) or {}).get("fmt", ".4f") for m in metrics}

    def cell(values: Mapping[str, Any]) -> str:
        return " / ".join(_fmt(values.get(m), fmt[m]) for m in metrics)

    table = [[label, *(display_name(c, display) for c in clients), "Overall"]]
    for name, results in named_results.items():
        by_client = {r["client"]: r.get("metrics") or {} for r in results["test"]["rows"]}
        table.append([name, *(cell(by_client.get(c, {})) for c in clients), cell(results["test"].get("macro") or {})])
    return table


def _cost(out: Path, results: Mapping[str, Any]) -> dict[str, float]:
    """Parameters sent up and down over the whole run (every client, every round) and wall time."""
    runs = [out] + [out / p for p in (results.get("subruns") or {}).values()]
    rounds = [r for sub in runs if (sub / "rounds.jsonl").is_file() for r in read_rounds(sub)]
    totals = exchange_totals(rounds) if results.get("paradigm") == "federated" else {}
    return {"params_up": totals.get("params_up", 0.0), "params_down": totals.get("params_down", 0.0),
            "bytes_up": totals.get("bytes_up", 0.0), "wall_seconds": float(results.get("wall_seconds") or 0.0)}


def run_study(path: str | Path, out: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
              show_progress: Display = True, console=None) -> dict:
    """Run every variant (resumable), then print and write the comparison. Returns study.json's content."""
    from rich.console import Console

    from .runner import run_experiment

    settings, configs = load_study(path, assignments, only)
    out = Path(out)
    console = console or Console(width=max(Console().width, 160))
    results: dict[str, dict] = {}
    for name, cfg in configs.items():
        console.print(f"[bold]{settings.name}: {name}[/bold] → {out / name}")
        results[name] = run_experiment(cfg, out / name, resume=True, show_progress=show_progress)
        write_report(out / name)
        console.print(_finished_line(settings.name, name, results[name]), highlight=False)
    first = next(iter(results.values()))
    spec = first.get("metric_spec") or {}
    metrics = settings.metrics or [spec.get("primary", "score")]
    display = first.get("display") or None
    rows = {f"{ref} (no training)": {**first, "test": summary}
            for ref, summary in (first.get("reference") or {}).items()}
    rows.update(results)
    table = comparison_table(rows, metrics, display)
    costs = {name: _cost(out / name, res) for name, res in results.items()}
    study = {"name": settings.name, "title": settings.title, "metrics": metrics, "table": table, "costs": costs,
             "variants": {name: str(out / name) for name in results}}
    _write(out, settings, table, costs, study)
    _print(console, settings, table, costs)
    return study


def _finished_line(study: str, name: str, results: Mapping[str, Any]) -> str:
    """`study: variant done: Overall MAP 0.6130 (2.1 min)`: one line per variant, also without progress bars."""
    spec = results.get("metric_spec") or {}
    primary = spec.get("primary", "score")
    column = _column(spec, primary) or {}
    value = (results.get("test", {}).get("macro") or {}).get(primary)
    minutes = float(results.get("wall_seconds") or 0.0) / 60
    return (f"{study}: {name} done: Overall {column.get('label', primary)} "
            f"{_fmt(value, column.get('fmt', '.4f'))} ({minutes:.1f} min)")


def _cost_table(costs: Mapping[str, Mapping[str, float]]) -> list[list[str]]:
    rows = [["method", "parameters up", "parameters down", "MB up", "wall time"]]
    for name, c in costs.items():
        rows.append([name, f"{c['params_up']:,.0f}", f"{c['params_down']:,.0f}", f"{c['bytes_up'] / 1e6:.1f}",
                     f"{c['wall_seconds'] / 60:.1f} min"])
    return rows


def _write(out: Path, settings: StudySettings, table, costs, study: dict) -> None:
    lines = [f"# {settings.title or settings.name}\n", "Test set; Overall = the mean over silos.", "",
             markdown_table(table), "", "## Cost\n", "Parameters sent over the whole run (all clients, all "
             "rounds); a silo trained alone sends nothing.", "", markdown_table(_cost_table(costs)), "",
             "## Runs\n", *(f"- [{name}]({name}/report.md)" for name in study["variants"]), ""]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "report.md", "\n".join(lines).encode())
    atomic_write_bytes(out / "study.json", json.dumps(study, indent=1).encode())


def _print(console, settings: StudySettings, table, costs) -> None:
    _print_grid(console, settings.title or settings.name, table)
    _print_grid(console, "cost", _cost_table(costs))
