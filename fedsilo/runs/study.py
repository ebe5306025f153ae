"""A study: several variants of one base config, run one after another and compared in one table.

A study file is TOML with three parts:

    [study]                  name, title, metrics (the columns per client; default: the task's primary),
                             seeds (e.g. [0, 1, 2]; default: the config's own seed, run once),
                             baseline (the variant the others are checked against; default: the first)
    [base]                   a whole run config (or what changes `[study] config`, a run config file)
    [variants.NAME]          what each variant changes in the base (deep-merged), e.g. paradigm = "finetune"

Each variant runs into OUT/NAME exactly as `fedsilo run --resume` would (a finished one returns its
recorded results, an interrupted one continues; a failed one, e.g. diverged, is shown as failed, the
others are compared, and the study ends with an error). The comparison — untrained reference rankers the
task scores (e.g. BM25), then each variant — is printed and written to OUT/report.md and
OUT/study.json, with each variant's parameters sent and wall time.

Overall compares like with like: each metric's mean over the silos that every line of the table has a
value for, the same silos in every line (a variant run on fewer silos narrows it for all, and a note
under the table names the silos left out; study.json's `overall_clients` lists the silos it covers).
Where no silo is common to every line, a line shows its own mean marked † and no claim is judged on it
(`comparison`).

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

from fedsilo.config import ConfigError, RunConfig, Strict, apply_overrides, locate_files, validate
from fedsilo.errors import StudyFailed
from fedsilo.fileio import atomic_write_bytes
from fedsilo.paradigms import PARADIGMS
from fedsilo.progress import Display
from fedsilo.rundir.records import column, display_name, exchange_totals, read_rounds

from .report import write_report
from .tables import format_value, markdown_table, print_grid

__all__ = ["StudySettings", "load_study", "run_study", "comparison", "comparison_table", "common_units",
           "overall_value", "parse_seeds", "check_seeds", "mean_sd", "beyond_spread", "claim", "spread_cell",
           "seeded", "SPREAD", "RULE", "MARK"]

SAMPLE_SEEDS = "sample_seeds"  # a task's few-shot sample seeds (multitask); a study seed shifts them
SPREAD = "sd = sample standard deviation (n−1)"
RULE = "holds = the means differ by more than the sum of the two standard deviations"
MAX_SEED = 2**63  # RunConfig.seed's bound
PLAIN_NAME = re.compile(r"\w[\w.+-]*")  # a variant's name is its folder's name
FAILED = "failed"  # the cells of a variant whose run failed
MARK = "†"  # an Overall over its own silos: no silo is common to every line


class StudySettings(Strict):
    name: str
    title: str = ""
    metrics: list[str] | None = Field(None, description="metric keys shown per client; None: the task's primary")
    seeds: list[int] | None = Field(None, description="run each variant once per seed; None: the config's seed")
    baseline: str | None = Field(None, description="the variant the others are checked against; None: the first")
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


def _read_toml(path: Path, missing: str) -> dict:
    if not path.is_file():
        raise ConfigError(missing)
    try:
        return tomllib.loads(path.read_text())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def load_study(path: str | Path, assignments: Sequence[str] = (), only: Sequence[str] | None = None,
               seed: int | None = None, multi_seed: bool = False) -> tuple[StudySettings, dict[str, RunConfig]]:
    """(settings, {variant: validated config}); `assignments` (`--set`) change the base. With `seed`,
    each config is `seeded` (its name gains /seed-S when `multi_seed`)."""
    path = Path(path)
    raw = _read_toml(path, f"study file not found: {path}")
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
    base = dict(raw.get("base") or {})
    if settings.config is not None:  # a run config file as the base; [base] changes it
        source = (path.parent / settings.config).expanduser()
        own = _read_toml(source, f"{path}: [study] config: {source} is not a file")
        base = deep_merge(locate_files(own, source.parent), base)  # its paths: relative to its own folder
    base = apply_overrides(base, list(assignments))
    suffix = f"/seed-{seed}" if multi_seed else ""
    configs = {}
    for name, change in variants.items():
        merged = locate_files(deep_merge(base, change), path.parent)  # plugins, silo files: beside the study file
        cfg = validate({**merged, "name": f"{settings.name}/{name}{suffix}"}, f"{path} [variants.{name}]", warn=True)
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


# ---------------------------------------------------------------------- Overall: like with like

Unit = tuple[str, Any]  # one evaluated test row: (client, task)


def _finite(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _unit_values(results: Mapping[str, Any], metric: str) -> dict[Unit, float]:
    """One run's finite test values of `metric` by (client, task) row: the rows its macro averages."""
    return {(r["client"], r.get("task")): float(v) for r in results["test"]["rows"]
            if _finite(v := (r.get("metrics") or {}).get(metric))}


def averaged(spec: Mapping[str, Any] | None, metric: str) -> bool:
    """Whether `metric` has a macro mean over rows (a spec column with `in_macro=False` has none)."""
    return bool((column(spec, metric) or {}).get("in_macro", True))


def common_units(runs: Mapping[str, Sequence[Mapping[str, Any]]], metric: str) -> list[Unit]:
    """The (client, task) rows that every run with any value of `metric` has a value for, in the
    order first seen: the rows a like-with-like Overall averages. A run with no value at all (an
    untrained reference has no loss) shows no Overall for it and narrows nothing. [] when no row is
    common."""
    seen = [values for rs in runs.values() for res in rs if (values := _unit_values(res, metric))]
    if not seen:
        return []
    common = set.intersection(*(set(values) for values in seen))
    return [u for u in dict.fromkeys(u for values in seen for u in values) if u in common]


def overall_value(results: Mapping[str, Any], metric: str, over: Sequence[Unit]) -> float | None:
    """One run's Overall `metric` over the rows `over`: its recorded macro when its own values cover
    exactly those rows (so the same number, to the last digit), else the mean of its values on them.
    None where the run has no macro (a metric not averaged, an evaluation with non-finite scores) or
    `over` is empty (nothing common to average over)."""
    macro = (results["test"].get("macro") or {}).get(metric)
    if not _finite(macro) or not over:
        return None
    values = _unit_values(results, metric)
    if set(values) == set(over):
        return float(macro)
    return sum(values[u] for u in over) / len(over)


def comparison(named_results: Mapping[str, Mapping[str, Any] | Sequence[Mapping[str, Any]]],
               metrics: Sequence[str], display: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The comparison table, and what its Overall column is taken over.

    Overall is each metric's mean over the silos (test rows) that every line of the table has a
    value for, so every line is averaged over the same silos: a variant run on one silo beside
    six-silo ones makes Overall the mean over that one silo in every line, and a note under the
    table names the silos left out and the lines that have them. Where no silo is common to the
    lines, no like-with-like Overall exists: a line shows its own mean over its own silos, marked
    MARK, a note names them, and claims on it are not judged.

    Returns {"table": rows of strings, header first; "overall": {line: per run (seed), {metric:
    Overall}} for every metric the runs record (not only those shown); "over": {metric: the silos
    Overall is taken over, by client name ("client / task" where a client has several rows); None for
    a metric with no macro mean or no value}; "shown_over": the same by display name; "left_out":
    {metric: the silos (display names) some line has that Overall leaves out}; "marked": the lines
    marked; "notes": the lines to print under the table}."""
    runs = {name: [res] if isinstance(res, Mapping) else list(res) for name, res in named_results.items()}
    spec = next(iter(runs.values()))[0].get("metric_spec")
    units = list(dict.fromkeys((r["client"], r.get("task")) for rs in runs.values() for res in rs
                               for r in res["test"]["rows"]))
    clients = list(dict.fromkeys(c for c, _ in units))
    with_task = len(units) != len(clients)  # a client with several rows (tasks): a silo is "client / task"

    def names(us: Sequence[Unit], shown: Mapping[str, str] | None = display) -> list[str]:
        return [f"{display_name(c, shown)} / {t}" if with_task else display_name(c, shown) for c, t in us]

    keys = list(dict.fromkeys([*metrics, *(k for rs in runs.values() for res in rs
                                          for k in (res["test"].get("macro") or {}))]))
    has = {m: list(dict.fromkeys(u for rs in runs.values() for res in rs for u in _unit_values(res, m)))
           for m in keys}
    over = {m: common_units(runs, m) if averaged(spec, m) and has[m] else None for m in keys}
    overall = {name: [{m: overall_value(res, m, over[m]) if over[m] is not None else None for m in keys}
                      for res in rs] for name, rs in runs.items()}
    left_out = {m: [u for u in has[m] if u not in over[m]] if over[m] else [] for m in keys}
    alone = [m for m in metrics if over[m] == []]  # lines with values, none common to them all
    marked = [name for name, rs in runs.items()
              if any(_finite((res["test"].get("macro") or {}).get(m)) for m in alone for res in rs)]
    label = {m: (column(spec, m) or {}).get("label", m) for m in metrics}
    fmt = {m: (column(spec, m) or {}).get("fmt", ".4f") for m in metrics}
    n = max(len(rs) for rs in runs.values())

    def cell(per_seed: Sequence[Mapping[str, Any]]) -> str:
        return " / ".join(spread_cell([values.get(m) for values in per_seed], fmt[m]) for m in metrics)

    table = [[" / ".join(label[m] for m in metrics) + (f", mean ± sd (n={n})" if n > 1 else ""),
              *(display_name(c, display) for c in clients), "Overall"]]
    for name, rs in runs.items():
        by_client = [{r["client"]: r.get("metrics") or {} for r in res["test"]["rows"]} for res in rs]
        shown = overall[name]
        if name in marked:  # its own mean over its own silos, in place of the Overall it has none of
            shown = [{**values, **{m: (res["test"].get("macro") or {}).get(m) for m in alone}}
                     for values, res in zip(shown, rs)]
        table.append([name, *(cell([b.get(c, {}) for b in by_client]) for c in clients),
                      cell(shown) + (f" {MARK}" if name in marked else "")])

    notes: dict[str, list[str]] = {}  # a note → the labels of the metrics it is about
    for m in metrics:
        if left_out[m]:
            by_lines: dict[tuple[str, ...], list[Unit]] = {}
            for u in left_out[m]:
                lines = tuple(name for name, rs in runs.items() if any(u in _unit_values(res, m) for res in rs))
                by_lines.setdefault(lines, []).append(u)
            left = "; ".join(f"{', '.join(names(us))} (only {', '.join(lines)})" for lines, us in by_lines.items())
            k = len(over[m])
            notes.setdefault(f"Overall is the mean over the {k} silo{'s' * (k > 1)} every line has a value for "
                             f"({', '.join(names(over[m]))}); left out: {left}.", []).append(label[m])
    for m in alone:
        own = "; ".join(f"{name}: {', '.join(names(_own(runs[name], m))) or 'none'}" for name in marked)
        notes.setdefault(f"{MARK} No silo has a value in every line, so no Overall is over the same silos: a line "
                         f"marked {MARK} shows its own mean over its own silos ({own}); they are not comparable.",
                         []).append(label[m])
    shown_averaged = [label[m] for m in metrics if over[m] is not None]
    return {"table": table, "overall": overall,
            "over": {m: None if us is None else names(us, {}) for m, us in over.items()},
            "shown_over": {m: None if us is None else names(us) for m, us in over.items()},
            "left_out": {m: names(us) for m, us in left_out.items()}, "marked": marked,
            "notes": [text if labels == shown_averaged else f"{' / '.join(labels)}: {text}"
                      for text, labels in notes.items()]}


def _own(runs: Sequence[Mapping[str, Any]], metric: str) -> list[Unit]:
    """The silos a line has a value of `metric` for in every one of its runs."""
    sets = [_unit_values(res, metric) for res in runs]
    return [u for u in sets[0] if all(u in s for s in sets[1:])]


def comparison_table(named_results: Mapping[str, Mapping[str, Any] | Sequence[Mapping[str, Any]]],
                     metrics: Sequence[str], display: Mapping[str, str] | None = None) -> list[list[str]]:
    """One line per method (header first), one column per client, then "Overall": each metric's
    mean over the silos (the mean over silos, as the FedMatch paper reports it), over the same
    silos in every line: those every line has a value for (`comparison` says which, and marks a
    line where none are). A cell holds the metrics joined by " / " (the header's first cell names
    them). A method given a list of results (one per seed) shows `mean ± sd` per metric, and the
    header says so with n."""
    return comparison(named_results, metrics, display)["table"]


def overall_values(per_seed: Mapping[str, Mapping[str, Any]], metric: str) -> list[float]:
    """One variant's overall `metric` per seed, from study.json's `per_seed[variant]`."""
    return _numbers([(entry.get("overall") or {}).get(metric) for entry in per_seed.values()])


def claim_lines(per_seed: Mapping[str, Mapping[str, Any]], baseline: str, metric: str, label: str,
                fmt: str = ".4f", over: Sequence[str] | None = None) -> list[str]:
    """`variant > baseline` on the overall `metric`, checked with `claim`, one line per other variant.

    `over` names the silos the Overall is taken over where it leaves some out (each line then says
    so); [] where no silo is common to every line: nothing is then judged, and each line says why."""
    base = overall_values(per_seed[baseline], metric)
    scope = f" over {', '.join(over)}" if over else ""
    lines = []
    for name, seeds in per_seed.items():
        if name == baseline:
            continue
        head = f"{name} > {baseline} (Overall {label}{scope})"
        if over is not None and not over:
            lines.append(f"{head}: not judged: no silo has a value in every line, so their Overall is not over "
                         "the same silos")
            continue
        values = overall_values(seeds, metric)
        (ma, _), (mb, _) = mean_sd(values), mean_sd(base)
        gap = f"{ma - mb:+{fmt.lstrip('+')}}" if ma is not None and mb is not None else "-"
        verdict = claim(values, base)
        if verdict == "reversed":
            verdict = f"reversed ({baseline} > {name} holds)"
        lines.append(f"{head}: {spread_cell(values, fmt)} vs {spread_cell(base, fmt)}, gap {gap}: {verdict}")
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
    checks = claim_lines(per_seed, baseline, metrics[0], col.get("label", metrics[0]), col.get("fmt", ".4f"),
                         first_over if compared["left_out"][metrics[0]] or first_over == [] else None
                         ) if multi and baseline in results else []
    used = seeds or sorted({s for by_seed in results.values() for s in by_seed})
    study = {"name": settings.name, "title": settings.title, "metrics": metrics, "seeds": used,
             "table": table, "overall_clients": compared["over"], "notes": compared["notes"],
             "costs": {name: _mean_cost(c) for name, c in costs.items()},
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


OVERALL = "Overall = the mean over the silos every line has a value for, the same silos in every line."


def _caption(study: Mapping[str, Any]) -> str:
    seeds = study["seeds"]
    if "spread" not in study:
        return f"Test set; {OVERALL}"
    return (f"Test set; {OVERALL} Each cell: mean ± sd over n = {len(seeds)} seeds "
            f"({', '.join(map(str, seeds))}), {SPREAD}; the no-training reference rows do not depend on "
            "the seed and show one value.")


def _notes(study: Mapping[str, Any]) -> list[str]:
    """The notes under the table (which silos Overall leaves out; lines marked †), each a paragraph."""
    return [line for note in study.get("notes") or [] for line in (note, "")]


def _write(out: Path, settings: StudySettings, study: dict) -> None:
    n = len(study["seeds"]) if "spread" in study else 1
    checks = ([f"## Against {study['baseline']}\n", f"{RULE}.", "", *(f"- {line}" for line in study["checks"]), ""]
              if study.get("checks") else [])
    runs = [f"- [{name}]({name}/report.md)" if n == 1 else
            f"- {name}: " + ", ".join(f"[seed {s}]({name}/seed-{s}/report.md)" for s in by_seed)
            for name, by_seed in study["runs"].items()]
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
    for note in study.get("notes") or []:
        console.print(note, highlight=False)
    if study.get("checks"):
        console.print(f"Against {study['baseline']} ({RULE}):", highlight=False)
        for line in study["checks"]:
            console.print(f"  {line}", highlight=False)
    print_grid(console, "cost", _cost_table(study["costs"], n))
