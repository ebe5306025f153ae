"""Spread over seeds, and the claim rule shared by studies and bench scripts.

A cell reads `mean ± sd` with sd the sample standard deviation (n−1) over the n seeds. Whether
"a > b" is a finding is decided by significance.py (the field's tests: paired bootstrap or
randomisation over test items where per-item records exist, else Welch's t-test over the seeds,
and never below the metric's resolution); `claim` gives that verdict with its test and p, and
`claim_lines` checks each variant against a baseline on study.json's `per_seed` numbers (and the
runs' per-item records), so a bench script checks its own claims with the same rule as `fedsilo
study`. `beyond_spread` (the gap of the means exceeds the sum of the two sds) is only a display: two
seeds that agree have no spread, so any gap, even one at the metric's floor, would be "beyond" it.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from . import significance
from .significance import ALPHA, ItemsError, Metric, Unit
from .tables import format_value

__all__ = ["SPREAD", "RULE", "mean_sd", "beyond_spread", "spread_phrase", "spread_verdict", "CHANGED", "rule", "claim", "claim_marked", "spread_cell", "overall_values",
           "claim_lines"]

SPREAD = "sd = sample standard deviation (n−1)"
_RULE = ("holds / reversed = significant at p < {alpha} in that direction (paired bootstrap, sacreBLEU's, for "
        "BLEU/chrF and other corpus metrics, paired randomisation for item means, over the test items with every "
        "seed, where the runs kept per-item records; else Welch's t-test over the seeds), never for a difference "
        "not above the metric's resolution (the shown precision; one item's worth for an item mean): "
        "`undecidable`; `needs 2 seeds` without per-item records and under two seeds a side; "
        "beyond/within spread (gap vs the sum of the two sds) is shown, not judged by")


def rule(alpha: float = ALPHA) -> str:
    """RULE with the significance level filled in."""
    return _RULE.format(alpha=format(alpha, "g"))


RULE = rule()  # at the default level, 0.05


def _numbers(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation with n−1) of the numbers among `values`; sd is None below two."""
    xs = _numbers(values)
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def beyond_spread(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether mean(a) − mean(b) exceeds sd(a) + sd(b) (sample sds, n−1): a display beside the verdict.

    Not the verdict: it ignores how many test items stand behind a number, and two seeds that agree
    have no spread, so any gap is "beyond" it (0.03 ± 0.00 vs 0.02 ± 0.00 BLEU). A side with fewer
    than two values has no spread to beat."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if sa is None or sb is None:
        return False
    return ma - mb > sa + sb


def spread_phrase(a: Sequence[float], b: Sequence[float]) -> str:
    """`beyond spread` / `within spread` (either direction), the old rule kept as a display."""
    return "beyond spread" if beyond_spread(a, b) or beyond_spread(b, a) else "within spread"


def claim(a: Sequence[float], b: Sequence[float], fmt: str = ".2f", alpha: float = ALPHA) -> str:
    """The verdict on "a > b" from each seed's value (no per-item records): `holds (p = …, Welch's
    t-test …)`, `reversed (…)`, `not significant (…)`, `undecidable: …` (not above the resolution of
    `fmt`, the precision the number is shown at) or `needs 2 seeds` (significance.judge_seeds)."""
    return str(significance.judge_seeds(a, b, fmt, alpha))


def spread_verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """What the spread rule (before issue 41) said of "a > b": holds / reversed / within spread / needs 2 seeds."""
    if len(_numbers(a)) < 2 or len(_numbers(b)) < 2:
        return significance.NEEDS_SEEDS
    return "holds" if beyond_spread(a, b) else "reversed" if beyond_spread(b, a) else "within spread"


CHANGED = "the spread rule said"  # marks a verdict whose finding differs from the spread rule's


def claim_marked(a: Sequence[float], b: Sequence[float], fmt: str = ".2f", alpha: float = ALPHA) -> str:
    """`claim`, followed by `[the spread rule said: …]` where the spread rule found otherwise (one
    of the two a finding, holds or reversed, and the other not that finding): how a study doc lists
    which verdicts the significance rule changed."""
    verdict = significance.judge_seeds(a, b, fmt, alpha)
    old = spread_verdict(a, b)
    same = old == verdict.outcome or (old in ("within spread", significance.NEEDS_SEEDS)
                                      and verdict.outcome not in ("holds", "reversed"))
    return str(verdict) if same else f"{verdict} [{CHANGED}: {old}]"


def spread_cell(values: Sequence[float | None], fmt: str = ".2f") -> str:
    """`mean ± sd` over the seeds' values; one value as itself; none as `-`."""
    mean, sd = mean_sd(values)
    if mean is None:
        return "-"
    return format_value(mean, fmt) if sd is None else f"{format_value(mean, fmt)} ± {format_value(sd, fmt)}"


def overall_values(per_seed: Mapping[str, Mapping[str, Any]], metric: str) -> list[float]:
    """One variant's overall `metric` per seed, from study.json's `per_seed[variant]`."""
    return _numbers([(entry.get("overall") or {}).get(metric) for entry in per_seed.values()])


def claim_lines(per_seed: Mapping[str, Mapping[str, Any]], baseline: str, metric: str, label: str,
                fmt: str = ".4f", over: Sequence[str] | None = None, runs: Mapping[str, Mapping[str, Any]] | None = None,
                units: Sequence[Unit] | None = None, score: Metric | None = None, alpha: float = ALPHA,
                higher_is_better: bool = True) -> list[str]:
    """`variant > baseline` on the overall `metric` (`variant < baseline` where lower is better: a
    loss), one line per other variant, each with the spread (display, where both sides have two seeds)
    and the verdict with its test and p: "holds" always means the variant is better.

    `over` names the silos the Overall is taken over where it leaves some out (each line then says
    so); [] where no silo is common to every line: nothing is then judged, and each line says why.
    With `runs` (study.json's variant → seed → run directory), `units` (the (client, task) rows the
    Overall is over) and `score` (pooled stats → the metric, the task's own function), a pair whose
    runs all kept per-item records is judged over the test items (significance.judge_items); any
    other pair, or records that cannot be paired (the line says why), by the seeds' values."""
    base = overall_values(per_seed[baseline], metric)
    scope = f" over {', '.join(over)}" if over else ""
    lines = []
    for name, seeds in per_seed.items():
        if name == baseline:
            continue
        head = f"{name} {'>' if higher_is_better else '<'} {baseline} (Overall {label}{scope})"
        if over is not None and not over:
            lines.append(f"{head}: not judged: no silo has a value in every line, so their Overall is not over "
                         "the same silos")
            continue
        values = overall_values(seeds, metric)
        (ma, _), (mb, _) = mean_sd(values), mean_sd(base)
        gap = f"{ma - mb:+{fmt.lstrip('+')}}" if ma is not None and mb is not None else "-"
        verdict = _verdict(name, baseline, values, base, fmt, alpha, runs, units, score) if higher_is_better \
            else _verdict(baseline, name, base, values, fmt, alpha, runs, units, score)  # a < b is b > a
        spread = f", {spread_phrase(values, base)}" if min(len(values), len(base)) > 1 else ""  # one seed: none
        lines.append(f"{head}: {spread_cell(values, fmt)} vs {spread_cell(base, fmt)}, gap {gap}{spread}: {verdict}")
    return lines


def _verdict(name: str, baseline: str, values: Sequence[float], base: Sequence[float], fmt: str, alpha: float,
             runs: Mapping[str, Mapping[str, Any]] | None, units: Sequence[Unit] | None, score: Metric | None) -> str:
    """Over the test items where every run of both sides kept them, else over the seeds (saying why)."""
    why = "no per-item records"
    if runs is not None and units and score is not None and name in runs and baseline in runs:
        try:
            found = [[significance.read_items(path) for path in runs[side].values()] for side in (name, baseline)]
            if all(r is not None for side in found for r in side):
                return str(significance.judge_items(found[0], found[1], units, score, fmt, alpha))
        except ItemsError as err:
            why = f"per-item records not used: {err}"
    verdict = significance.judge_seeds(values, base, fmt, alpha, why)
    if verdict.outcome == significance.NEEDS_SEEDS:  # say why, and how to get a verdict
        return f"{verdict} ({why}; a test over the seeds needs 2 or more a side: run more, e.g. --seeds 0,1)"
    return str(verdict)
