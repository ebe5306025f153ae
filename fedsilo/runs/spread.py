"""Spread over seeds and the one rule for a claim, shared by studies and bench scripts.

A cell reads `mean ± sd` with sd the sample standard deviation (n−1) over the n seeds. "a > b" holds
when the gap of the means exceeds the sum of the two standard deviations (`beyond_spread`); `claim`
gives the verdict, and `claim_lines` checks each variant against a baseline on study.json's
`per_seed` numbers, so a bench script checks its own claims with the same rule as `fedsilo study`.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .tables import format_value

__all__ = ["SPREAD", "RULE", "mean_sd", "beyond_spread", "claim", "spread_cell", "overall_values", "claim_lines"]

SPREAD = "sd = sample standard deviation (n−1)"
RULE = "holds = the means differ by more than the sum of the two standard deviations"


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
