"""A study: several variants of one base config, run one after another and compared in one table.

A study file is TOML with three parts:

    [study]                  name, title, metrics (the columns per client; default: the task's primary),
                             seeds (e.g. [0, 1, 2]; default: the config's own seed, run once),
                             baseline (the variant the others are checked against; default: the first)
    [base]                   a whole run config
    [variants.NAME]          what each variant changes in the base (deep-merged), e.g. paradigm = "finetune"

Each variant runs into OUT/NAME exactly as `fedsilo run --resume` would (a finished one returns its
recorded results, an interrupted one continues; a failed one, e.g. diverged, is shown as failed, the
others are compared, and the study ends with an error). The comparison — untrained reference rankers the
task scores (e.g. BM25), then each variant — is printed and written to OUT/report.md and
OUT/study.json, with each variant's parameters sent and wall time.

Several seeds (`--seeds 0,1,2` or `[study] seeds`; the command line wins) run every variant once per
seed, into OUT/NAME/seed-S, all variants of one seed before the next seed (so an interrupted study
already holds a whole comparison). One seed keeps today's layout, OUT/NAME. Seed S sets the run's
`seed` (model init, data order, dropout, client sampling) and, for a task with a few-shot sample
seed (multitask's `task.sample_seeds`), draws another sample too: each configured sample seed plus S,
so seed 0 keeps the configured sample. Both move a result between runs of one method, so both
belong in its spread. A variant that sets `task.sample_seeds` itself keeps it for every seed, and
`[study] vary_sample = false` keeps the sample fixed everywhere (training noise only).

A cell then reads `mean ± sd` with sd the sample standard deviation (n−1) over the n seeds; reference
rows (untrained rankers) do not depend on the seed and show one value. Under the table, each variant is
checked against the baseline on the first metric overall with `claim` (see `beyond_spread`: the gap
must exceed the sum of the two standard deviations). study.json keeps every seed's numbers in
`per_seed` so bench scripts can check their own claims with the same rule.
"""
from __future__ import annotations

import copy
import json
import math
import re
import statistics
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from fedsilo.config import ConfigError, RunConfig, Strict, apply_overrides, validate
from fedsilo.errors import StudyFailed
from fedsilo.fileio import atomic_write_bytes
from fedsilo.paradigms import PARADIGMS
from fedsilo.progress import Display

from .records import column, display_name, exchange_totals, read_rounds
from .report import write_report
from .tables import format_value, markdown_table, print_grid

__all__ = ["StudySettings", "load_study", "run_study", "comparison_table", "parse_seeds", "check_seeds",
           "mean_sd", "beyond_spread", "claim", "spread_cell", "seeded", "SPREAD", "RULE"]

SAMPLE_SEEDS = "sample_seeds"  # a task's few-shot sample seeds (multitask); a study seed shifts them
SPREAD = "sd = sample standard deviation (n−1)"
RULE = "holds = the means differ by more than the sum of the two standard deviations"
MAX_SEED = 2**63  # RunConfig.seed's bound
PLAIN_NAME = re.compile(r"\w[\w.+-]*")  # a variant's name is its folder's name
FAILED = "failed"  # the cells of a variant whose run failed


class StudySettings(Strict):
    name: str
    title: str = ""
    metrics: list[str] | None = Field(None, description="metric keys shown per client; None: the task's primary")
    seeds: list[int] | None = Field(None, description="run each variant once per seed; None: the config's seed")
    baseline: str | None = Field(None, description="the variant the others are checked against; None: the first")
    vary_sample: bool = Field(True, description="a seed also shifts the task's few-shot sample seeds")


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


def load_study(path: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
               seed: int | None = None, multi_seed: bool = False) -> tuple[StudySettings, dict[str, RunConfig]]:
    """(settings, {variant: validated config}); `assignments` (`--set`) change the base. With `seed`,
    each config is `seeded` (its name gains /seed-S when `multi_seed`)."""
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
    base = apply_overrides(dict(raw.get("base") or {}), list(assignments))
    suffix = f"/seed-{seed}" if multi_seed else ""
    configs = {}
    for name, change in variants.items():
        cfg = validate({**deep_merge(base, change), "name": f"{settings.name}/{name}{suffix}"},
                       f"{path} [variants.{name}]")
        if seed is not None:  # a variant's own sample seeds are held fixed: it asked for that sample
            cfg = seeded(cfg, seed, settings.vary_sample and SAMPLE_SEEDS not in (change.get("task") or {}))
        configs[name] = cfg
    return settings, configs


# ---------------------------------------------------------------------- spread and claims


def _numbers(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation with n−1) of the numbers among `values`; sd is None below two."""
    xs = _numbers(values)
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def beyond_spread(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether "a > b" holds: mean(a) − mean(b) exceeds sd(a) + sd(b) (sample sds, n−1).

    The sum, not the larger sd: with 2–3 seeds an sd is itself uncertain by about half, and the sum
    also bounds the spread of a difference of two single runs (√(sa² + sb²) ≤ sa + sb). A side with
    fewer than two values has no spread to beat, so nothing holds on it. The one rule for every
    claim a study or a bench script makes."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if sa is None or sb is None:
        return False
    return ma - mb > sa + sb


def claim(a: Sequence[float], b: Sequence[float]) -> str:
    """The verdict on "a > b": `holds`, `reversed` (b > a holds), `within spread`, or `needs 2 seeds`."""
    if len(_numbers(a)) < 2 or len(_numbers(b)) < 2:
        return "needs 2 seeds"
    return "holds" if beyond_spread(a, b) else "reversed" if beyond_spread(b, a) else "within spread"


def spread_cell(values: Sequence[float | None], fmt: str = ".2f") -> str:
    """`mean ± sd` over the seeds' values; one value as itself; none as `-`."""
    mean, sd = mean_sd(values)
    if mean is None:
        return "-"
    return format_value(mean, fmt) if sd is None else f"{format_value(mean, fmt)} ± {format_value(sd, fmt)}"


def comparison_table(named_results: Mapping[str, Mapping[str, Any] | Sequence[Mapping[str, Any]]],
                     metrics: Sequence[str], display: Mapping[str, str] | None = None) -> list[list[str]]:
    """One line per method (header first), one column per client, then "Overall": each metric's
    macro mean over clients (the mean over silos, as the FedMatch paper reports it). A cell holds
    the metrics joined by " / " (the header's first cell names them). A method given a list of
    results (one per seed) shows `mean ± sd` per metric, and the header says so with n."""
    runs = {name: [res] if isinstance(res, Mapping) else list(res) for name, res in named_results.items()}
    clients = list(dict.fromkeys(r["client"] for rs in runs.values() for res in rs for r in res["test"]["rows"]))
    spec = next(iter(runs.values()))[0].get("metric_spec")
    label = " / ".join((column(spec, m) or {}).get("label", m) for m in metrics)
    fmt = {m: (column(spec, m) or {}).get("fmt", ".4f") for m in metrics}
    n = max(len(rs) for rs in runs.values())

    def cell(per_seed: Sequence[Mapping[str, Any]]) -> str:
        return " / ".join(spread_cell([values.get(m) for values in per_seed], fmt[m]) for m in metrics)

    table = [[label + (f", mean ± sd (n={n})" if n > 1 else ""),
              *(display_name(c, display) for c in clients), "Overall"]]
    for name, rs in runs.items():
        by_client = [{r["client"]: r.get("metrics") or {} for r in res["test"]["rows"]} for res in rs]
        table.append([name, *(cell([b.get(c, {}) for b in by_client]) for c in clients),
                      cell([res["test"].get("macro") or {} for res in rs])])
    return table


def overall_values(per_seed: Mapping[str, Mapping[str, Any]], metric: str) -> list[float]:
    """One variant's overall `metric` per seed, from study.json's `per_seed[variant]`."""
    return _numbers([(entry.get("overall") or {}).get(metric) for entry in per_seed.values()])


def claim_lines(per_seed: Mapping[str, Mapping[str, Any]], baseline: str, metric: str, label: str,
                fmt: str = ".4f") -> list[str]:
    """`variant > baseline` on the overall `metric`, checked with `claim`, one line per other variant."""
    base = overall_values(per_seed[baseline], metric)
    lines = []
    for name, seeds in per_seed.items():
        if name == baseline:
            continue
        values = overall_values(seeds, metric)
        (ma, _), (mb, _) = mean_sd(values), mean_sd(base)
        gap = f"{ma - mb:+{fmt.lstrip('+')}}" if ma is not None and mb is not None else "-"
        verdict = claim(values, base)
        if verdict == "reversed":
            verdict = f"reversed ({baseline} > {name} holds)"
        lines.append(f"{name} > {baseline} (Overall {label}): {spread_cell(values, fmt)} vs "
                     f"{spread_cell(base, fmt)}, gap {gap}: {verdict}")
    return lines


# ---------------------------------------------------------------------- running


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


def run_study(path: str | Path, out: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
              show_progress: Display = True, console=None, seeds: Sequence[int] | None = None) -> dict:
    """Run every variant for every seed (resumable), then print and write the comparison. `seeds`
    (the CLI's --seeds) wins over `[study] seeds`. Returns study.json's content."""
    from rich.console import Console

    from .runner import RunFailed, run_experiment

    settings, _ = load_study(path, assignments, only)
    seeds = check_seeds(seeds, "--seeds") if seeds is not None else settings.seeds
    multi = seeds is not None and len(seeds) > 1
    out = Path(out)
    console = console or Console(width=max(Console().width, 160))
    plan = {seed: load_study(path, assignments, only, seed, multi)[1] for seed in (seeds or [None])}
    names = list(next(iter(plan.values())))
    results: dict[str, dict[int, dict]] = {name: {} for name in names}
    costs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, dict[str, str]] = {}  # variant → seed → why its run failed
    for seed, configs in plan.items():
        for name, cfg in configs.items():
            target = run_dir(out, name, seed, multi)
            console.print(f"[bold]{settings.name}: {name}{f' seed {seed}' if multi else ''}[/bold] → {target}")
            try:
                done = run_experiment(cfg, target, resume=True, show_progress=show_progress)
            except RunFailed as err:  # the other runs go on; this variant is shown as failed
                failed.setdefault(name, {})[str(cfg.seed)] = str(err)
                console.print(f"{settings.name}: {name}{f' seed {seed}' if multi else ''} failed: {err}",
                              highlight=False)
                continue
            write_report(target)
            console.print(_finished_line(settings.name, name, done, seed if multi else None), highlight=False)
            results[name][cfg.seed] = done
            costs[name].append(_cost(target, done))
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
    table = comparison_table(rows, metrics, display)
    table += [[name, *[FAILED] * (len(table[0]) - 1)] for name in failed]
    per_seed = {name: {str(seed): {"overall": res["test"].get("macro") or {},
                                   "clients": {r["client"]: r.get("metrics") or {} for r in res["test"]["rows"]},
                                   "cost": cost}
                       for (seed, res), cost in zip(by_seed.items(), costs[name])}
                for name, by_seed in results.items()}
    baseline = settings.baseline or names[0]
    col = column(spec, metrics[0]) or {}
    checks = claim_lines(per_seed, baseline, metrics[0], col.get("label", metrics[0]),
                         col.get("fmt", ".4f")) if multi and baseline in results else []
    used = seeds or sorted({s for by_seed in results.values() for s in by_seed})
    study = {"name": settings.name, "title": settings.title, "metrics": metrics, "seeds": used,
             "table": table, "costs": {name: _mean_cost(c) for name, c in costs.items()},
             "variants": {name: str(out / name) for name in results},
             "runs": {name: {str(seed): str(run_dir(out, name, seed, multi)) for seed in by_seed}
                      for name, by_seed in results.items()},
             "per_seed": per_seed}
    if multi:
        study.update({"spread": SPREAD, "rule": RULE, "baseline": baseline, "checks": checks})
    if failed:
        study["failed"] = failed
    _write(out, settings, study)
    _print(console, settings, study)
    if failed:
        raise StudyFailed(_failed_line(settings.name, failed, len(plan) * len(names), multi, path, out / "report.md"))
    return study


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


def _caption(study: Mapping[str, Any]) -> str:
    seeds = study["seeds"]
    if "spread" not in study:
        return "Test set; Overall = the mean over silos."
    return (f"Test set; Overall = the mean over silos. Each cell: mean ± sd over n = {len(seeds)} seeds "
            f"({', '.join(map(str, seeds))}), {SPREAD}; the no-training reference rows do not depend on "
            "the seed and show one value.")


def _write(out: Path, settings: StudySettings, study: dict) -> None:
    n = len(study["seeds"]) if "spread" in study else 1
    checks = ([f"## Against {study['baseline']}\n", f"{RULE}.", "", *(f"- {line}" for line in study["checks"]), ""]
              if study.get("checks") else [])
    runs = [f"- [{name}]({name}/report.md)" if n == 1 else
            f"- {name}: " + ", ".join(f"[seed {s}]({name}/seed-{s}/report.md)" for s in by_seed)
            for name, by_seed in study["runs"].items()]
    runs += [f"- {name}{f' seed {s}' if n > 1 else ''}: failed: {why}"
             for name, seeds in study.get("failed", {}).items() for s, why in seeds.items()]
    lines = [f"# {settings.title or settings.name}\n", _caption(study), "",
             markdown_table(study["table"]), "", *checks, "## Cost\n", "Parameters sent over the whole run (all "
             "clients, all rounds); a silo trained alone sends nothing." + (" Mean over the seeds." if n > 1 else ""),
             "", markdown_table(_cost_table(study["costs"], n)), "", "## Runs\n", *runs, ""]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "report.md", "\n".join(lines).encode())
    atomic_write_bytes(out / "study.json", json.dumps(study, indent=1).encode())


def _print(console, settings: StudySettings, study: dict) -> None:
    n = len(study["seeds"]) if "spread" in study else 1
    title = settings.title or settings.name
    print_grid(console, title if n == 1 else f"{title} — mean ± sd over {n} seeds, {SPREAD}", study["table"])
    if study.get("checks"):
        console.print(f"Against {study['baseline']} ({RULE}):", highlight=False)
        for line in study["checks"]:
            console.print(f"  {line}", highlight=False)
    print_grid(console, "cost", _cost_table(study["costs"], n))
