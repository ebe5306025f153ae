"""A study: several variants of one base config, run one after another and compared in one table.

The study file (studyfile.py) gives each variant's config. Each variant runs into OUT/NAME exactly
as `fedsilo run --resume` would (a finished one returns its recorded results, an interrupted one
continues; a failed one, e.g. diverged, is shown as failed, the others are compared, and the study
ends with an error). The comparison — untrained reference rankers the task scores (e.g. BM25), then
each variant — is printed and written to OUT/report.md and OUT/study.json, with each variant's
parameters sent and wall time. Its Overall column compares like with like (overall.py).

Several seeds (`--seeds 0,1,2` or `[study] seeds`; the command line wins) run every variant once per
seed, into OUT/NAME/seed-S, all variants of one seed before the next seed (so an interrupted study
already holds a whole comparison). One seed keeps today's layout, OUT/NAME. A run already in the other
layout's place with exactly that seed's config counts as that seed's run where it is (_placed): going
from one seed to several runs only the seeds still missing.

A cell then reads `mean ± sd` over the seeds (spread.py); reference rows (untrained rankers) do not
depend on the seed and show one value. Under the table, with one seed or several, each variant is
checked against the baseline on the first metric overall (spread.claim_lines): by the field's
significance test over the test items where every run kept per-item records, else over the seeds
(under two a side, the line says so and how to get a verdict), at `[study] alpha` (0.05), never
below the metric's resolution (significance.py); each line names its test and p. study.json keeps
every seed's numbers in `per_seed` so bench scripts can check their own claims with the same rule.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from fedsilo.errors import RunDirError, RunFailed, StudyFailed
from fedsilo.fileio import atomic_write_bytes
from fedsilo.paradigms import PARADIGMS
from fedsilo.progress import Display, Heard
from fedsilo.rundir.layout import RunDir
from fedsilo.rundir.records import column, exchange_totals, higher_is_better, read_rounds

from . import runner
from .overall import common_units, comparison
from .significance import Metric
from .spread import SPREAD, claim_lines, rule
from .studyfile import StudySettings, check_seeds, load_study
from .tables import MODEL_NOTE, format_value, markdown_table, print_grid
from .tracked import Nest, RunTracking, log_study, study_tracking

__all__ = ["run_study", "run_dir"]

FAILED = "failed"  # the cells of a variant whose run failed


def _cost(out: Path, results: Mapping[str, Any]) -> dict[str, float]:
    """Parameters sent up and down over the whole run (every client, every round) and wall time."""
    runs = [out] + [out / p for p in (results.get("subruns") or {}).values()]
    rounds = [r for sub in runs if (sub / "rounds.jsonl").is_file() for r in read_rounds(sub)]
    totals = exchange_totals(rounds) if _federates(results.get("paradigm")) else {}
    return {"params_up": totals.get("params_up", 0.0), "params_down": totals.get("params_down", 0.0),
            "bytes_up": totals.get("bytes_up", 0.0), "wall_seconds": float(results.get("wall_seconds") or 0.0)}


def _federates(paradigm: str | None) -> bool:
    """Whether a finished run's paradigm sent anything (a finetune run's silos each ran alone)."""
    return paradigm in PARADIGMS and PARADIGMS.get(paradigm).federates


def _mean_cost(costs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean over seeds of each cost (parameters sent do not change with the seed; wall time does)."""
    return {key: statistics.fmean(c[key] for c in costs) for key in costs[0]}


def run_dir(out: Path, variant: str, seed: int | None, multi_seed: bool) -> Path:
    """OUT/NAME for one seed (today's layout), OUT/NAME/seed-S for several."""
    return out / variant / f"seed-{seed}" if multi_seed else out / variant


def _holds(path: Path, cfg) -> bool:
    """Whether `path` holds a run of exactly `cfg` (its recorded config.toml is the one a resume accepts)."""
    if not (path / "config.toml").is_file():
        return False
    try:
        RunDir(path).prepare(cfg, resume=True)  # a resume's check: reads and compares, writes nothing
    except RunDirError:
        return False
    return True


def _placed(out: Path, study: str, variant: str, cfg, multi_seed: bool) -> tuple[Path, Any, bool]:
    """(run directory, config, reused) of one variant's run at `cfg.seed`. The layout's place (run_dir)
    unless only the other layout's place holds this very run: a study that went from one seed to
    several (or back) then counts that run as its seed, where it is and under the name it was recorded
    with, rather than training it again. Nothing is moved, and a run of another config is never taken."""
    own = run_dir(out, variant, cfg.seed, multi_seed)
    other = run_dir(out, variant, cfg.seed, not multi_seed)
    renamed = cfg.model_copy(update={"name": f"{study}/{variant}" + ("" if multi_seed else f"/seed-{cfg.seed}")})
    if not _holds(own, cfg) and _holds(other, renamed):
        return other, renamed, True
    return own, cfg, False


def run_study(path: str | Path, out: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
              show_progress: Display = True, console=None, seeds: Sequence[int] | None = None) -> dict:
    """Run every variant for every seed (resumable), then print and write the comparison. `seeds`
    (the CLI's --seeds) wins over `[study] seeds`. Returns study.json's content."""
    settings, _ = load_study(path, assignments, only)
    seeds = check_seeds(seeds, "--seeds") if seeds is not None else settings.seeds
    multi = seeds is not None and len(seeds) > 1
    out = Path(out)
    console = console or Console(width=max(Console().width, 160))
    plan = {seed: load_study(path, assignments, only, seed, multi)[1] for seed in (seeds or [None])}
    names = list(next(iter(plan.values())))
    base = next(iter(plan.values()))[names[0]]
    params = {"file": str(path), "variants": names, "seeds": seeds, "baseline": settings.baseline or names[0],
              "alpha": settings.alpha, "metrics": settings.metrics}
    warn = lambda message: console.print(f"fedsilo: warning: {message}", style="yellow", markup=False,  # noqa: E731
                                         highlight=False, soft_wrap=True)
    with study_tracking(base, out, settings.name, params, warn) as tracking:
        return _run_plan(path, out, settings, plan, names, multi, seeds, show_progress, console, tracking)


def _run_plan(path, out: Path, settings: StudySettings, plan: dict, names: list[str], multi: bool, seeds,
              show_progress: Display, console, tracking: RunTracking) -> dict:
    """Every run of the plan, then the comparison (printed, written, tracked on the study's run)."""
    results: dict[str, dict[int, dict]] = {name: {} for name in names}
    costs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, dict[str, str]] = {}  # variant → seed → why its run failed
    heard = Heard()  # a warning every run gives (a silo's duplicates) is shown once
    where: dict[str, dict[str, str]] = {name: {} for name in names}  # variant → seed → its run directory
    for seed, configs in plan.items():
        for name, cfg in configs.items():
            target, cfg, reused = _placed(out, settings.name, name, cfg, multi)
            note = f" (its {'one-seed' if multi else f'seed-{cfg.seed}'} run, reused)" if reused else ""
            console.print(f"[bold]{settings.name}: {name}{f' seed {seed}' if multi else ''}[/bold] → {target}{note}")
            try:
                nest = Nest(tracking, f"{name} seed {cfg.seed}" if multi else name,
                            {"fedsilo.study": settings.name, "fedsilo.variant": name, "fedsilo.seed": str(cfg.seed)})
                done = runner.run_experiment(cfg, target, resume=True, show_progress=show_progress, heard=heard,
                                             nest=nest)
            except RunFailed as err:  # the other runs go on; this variant is shown as failed
                failed.setdefault(name, {})[str(cfg.seed)] = str(err)
                console.print(f"{settings.name}: {name}{f' seed {seed}' if multi else ''} failed: {err}",
                              highlight=False)
                continue
            console.print(_finished_line(settings.name, name, done, seed if multi else None), highlight=False)
            results[name][cfg.seed] = done
            where[name][str(cfg.seed)] = str(target)
            costs[name].append(_cost(target, done))
    for line in repeated_warnings(heard):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for name in failed:  # a variant with a failed seed has no spread to compare: not trained
        del results[name], costs[name]
    if not results:
        raise StudyFailed(_failed_line(settings.name, failed, len(plan) * len(names), multi, path, None))
    first = next(iter(next(iter(results.values())).values()))
    spec = first.get("metric_spec") or {}
    metrics = settings.metrics or [spec.get("primary", "score")]
    display = first.get("display") or None
    rows: dict[str, Any] = {f"{ref} (no training)": {**first, "test": summary}
                            for ref, summary in (first.get("reference") or {}).items()}
    rows.update({name: list(by_seed.values()) for name, by_seed in results.items()})
    compared = comparison(rows, metrics, display)
    table = compared["table"]
    table += [[name, *[FAILED] * (len(table[0]) - 1)] for name in failed]
    # overall: over the silos every line has (study.json's overall_clients); macro: the run's own, over its silos
    per_seed = {name: {str(seed): {"overall": overall, "macro": res["test"].get("macro") or {},
                                   "clients": {r["client"]: r.get("metrics") or {} for r in res["test"]["rows"]},
                                   "cost": cost}
                       for (seed, res), overall, cost in zip(by_seed.items(), compared["overall"][name], costs[name])}
                for name, by_seed in results.items()}
    baseline = settings.baseline or names[0]
    col = column(spec, metrics[0]) or {}
    first_over = compared["shown_over"][metrics[0]]
    run_dirs = {name: where[name] for name in results}
    units = common_units({name: [r] if isinstance(r, Mapping) else r for name, r in rows.items()}, metrics[0])
    checks = claim_lines(per_seed, baseline, metrics[0], col.get("label", metrics[0]), col.get("fmt", ".4f"),
                         first_over if compared["left_out"][metrics[0]] or first_over == [] else None,
                         run_dirs, units, _score(next(iter(plan.values()))[names[0]], metrics[0]), settings.alpha,
                         higher_is_better=higher_is_better(spec, metrics[0])
                         ) if baseline in results else []
    used = seeds or sorted({s for by_seed in results.values() for s in by_seed})
    study = {"name": settings.name, "title": settings.title, "metrics": metrics, "seeds": used,
             "table": table, "overall_clients": compared["over"], "notes": compared["notes"],
             "costs": {name: _mean_cost(c) for name, c in costs.items()},
             "variants": {name: str(out / name) for name in results},
             "runs": run_dirs, "per_seed": per_seed}
    if multi:
        study["spread"] = SPREAD
    if multi or checks:  # one seed too: judged over the runs' per-item records, or a line says why not
        study.update({"rule": rule(settings.alpha), "alpha": settings.alpha, "baseline": baseline, "checks": checks})
    if failed:
        study["failed"] = failed
    _write(out, settings, study)
    log_study(tracking, study, out, markdown_table(study["table"]))
    _print(console, settings, study)
    if failed:
        raise StudyFailed(_failed_line(settings.name, failed, len(plan) * len(names), multi, path, out / "report.md"))
    return study


def repeated_warnings(heard: Heard) -> list[str]:
    """One line per warning that several of the study's runs gave, each shown once above."""
    return [f"fedsilo: the warning {_start(message)!r} above concerned {n} of the study's {heard.runs} runs "
            "(shown once)" for message, n in heard.repeated().items()]


def _start(text: str, n: int = 70) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _score(cfg, metric: str) -> Metric | None:
    """Pooled item statistics → `metric`, by the task's own metric function (the one results.json's
    numbers come from); None when the task's spec cannot be had (then claims use the seeds' values)."""
    from fedsilo.tasks import TASKS

    try:
        compute = TASKS.get(cfg.task.name).spec().compute
    except Exception:  # noqa: BLE001 - a plugin task without a spec: judged over the seeds instead
        return None
    return lambda stats: compute(stats).get(metric)


def _failed_line(study: str, failed: Mapping[str, Mapping[str, str]], runs: int, multi: bool, path: str | Path,
                 report: Path | None) -> str:
    """One line: how many runs failed, each with its reason, and what to do."""
    n = sum(len(seeds) for seeds in failed.values())
    shown = f", shown as failed in {report}" if report else ""
    why = "; ".join(f"{name}{f' seed {seed}' if multi else ''}: {reason}"
                    for name, seeds in failed.items() for seed, reason in seeds.items())
    return (f"study {study}: {n} of {runs} runs failed{shown} ({why}); change those variants in {path} and run the "
            "study with another --out")


def _finished_line(study: str, name: str, results: Mapping[str, Any], seed: int | None = None) -> str:
    """`study: variant [seed S] done: Overall MAP 0.6130 (2.1 min)`: one line per run, also without progress bars."""
    spec = results.get("metric_spec") or {}
    primary = spec.get("primary", "score")
    col = column(spec, primary) or {}
    value = (results.get("test", {}).get("macro") or {}).get(primary)
    minutes = float(results.get("wall_seconds") or 0.0) / 60
    which = name if seed is None else f"{name} seed {seed}"
    return (f"{study}: {which} done: Overall {col.get('label', primary)} "
            f"{format_value(value, col.get('fmt', '.4f'))} ({minutes:.1f} min)")


def _cost_table(costs: Mapping[str, Mapping[str, float]], n: int = 1) -> list[list[str]]:
    rows = [["method", "parameters up", "parameters down", "MB up", "wall time" + (f" (mean, n={n})" if n > 1 else "")]]
    for name, c in costs.items():
        rows.append([name, f"{c['params_up']:,.0f}", f"{c['params_down']:,.0f}", f"{c['bytes_up'] / 1e6:.1f}",
                     f"{c['wall_seconds'] / 60:.1f} min"])
    return rows


OVERALL = "Overall = the mean over the silos every line has a value for, the same silos in every line."


def _caption(study: Mapping[str, Any]) -> str:
    seeds = study["seeds"]
    if "spread" not in study:
        return f"Test set; {MODEL_NOTE} {OVERALL}"
    return (f"Test set; {MODEL_NOTE} {OVERALL} Each cell: mean ± sd over n = {len(seeds)} seeds "
            f"({', '.join(map(str, seeds))}), {SPREAD}; the no-training reference rows do not depend on "
            "the seed and show one value.")


def _notes(study: Mapping[str, Any]) -> list[str]:
    """The notes under the table (which silos Overall leaves out; lines marked †), each a paragraph."""
    return [line for note in study.get("notes") or [] for line in (note, "")]


def _write(out: Path, settings: StudySettings, study: dict) -> None:
    n = len(study["seeds"]) if "spread" in study else 1
    checks = ([f"## Against {study['baseline']}\n", f"{study['rule']}.", "", *(f"- {line}" for line in study["checks"]), ""]
              if study.get("checks") else [])
    link = {name: {s: Path(path).relative_to(out).as_posix() for s, path in by_seed.items()}
            for name, by_seed in study["runs"].items()}  # a reused run is linked where it is
    runs = [f"- [{name}]({next(iter(link[name].values()))}/report.md)" if n == 1 else
            f"- {name}: " + ", ".join(f"[seed {s}]({path}/report.md)" for s, path in link[name].items())
            for name in study["runs"]]
    runs += [f"- {name}{f' seed {s}' if n > 1 else ''}: failed: {why}"
             for name, seeds in study.get("failed", {}).items() for s, why in seeds.items()]
    lines = [f"# {settings.title or settings.name}\n", _caption(study), "", markdown_table(study["table"]), "",
             *_notes(study), *checks, "## Cost\n", "Parameters sent over the whole run (all "
             "clients, all rounds); a silo trained alone sends nothing." + (" Mean over the seeds." if n > 1 else ""),
             "", markdown_table(_cost_table(study["costs"], n)), "", "## Runs\n", *runs, ""]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "report.md", "\n".join(lines).encode())
    atomic_write_bytes(out / "study.json", json.dumps(study, indent=1).encode())


def _print(console, settings: StudySettings, study: dict) -> None:
    n = len(study["seeds"]) if "spread" in study else 1
    title = settings.title or settings.name
    print_grid(console, title if n == 1 else f"{title} — mean ± sd over {n} seeds, {SPREAD}", study["table"])
    console.print(MODEL_NOTE, style="dim", highlight=False)
    for note in study.get("notes") or []:
        console.print(note, highlight=False)
    if study.get("checks"):
        console.print(f"Against {study['baseline']} ({study['rule']}):", highlight=False, soft_wrap=True)
        for line in study["checks"]:  # one line each, not cut at the console's width: a verdict is searched for
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    print_grid(console, "cost", _cost_table(study["costs"], n))
