"""Whether "a > b" is a finding: the field's significance tests over test items and seeds.

A claim compares two methods on one number (e.g. Overall MAP). It is judged in three steps:

1. **Resolution.** A difference no larger than what the number can resolve is never a finding,
   however well the seeds agree: `undecidable`. The resolution is one unit of the last digit
   the tables show (BLEU `.2f` → 0.01, MAP `.4f` → 0.0001) and, with per-item records, for an
   item-mean metric (MAP, MRR, P@1, accuracy, EM, F1: the metric of pooled items equals the mean of
   the items' own values) also *one item's worth*: the range of the items' values over the
   silos' items, (max − min) / (K · N_min) for an Overall over K silos whose smallest holds
   N_min scored items: what one item moving from worst to best can change.
2. **A test that accounts for how many items and seeds stand behind the number.**
   - With per-item records (`<run>/items/test.jsonl` in every run of both sides, equal item ids
     per silo): the statistic is T = mean over seeds of Overall(a) − mean over seeds of
     Overall(b), each Overall recomputed by the task's own metric function from pooled item
     statistics. Items are resampled (or swapped) *jointly*: the same draw for every seed and
     both sides, silo by silo (the test split is the same across seeds; `ids` are checked).
     - corpus metrics (BLEU, chrF, macro-F1, MCC: not a mean of item values): sacreBLEU's
       paired bootstrap (`paired_bs`: seed 12345, 1000 resamples, its p-value and 95% interval
       functions), which it equals exactly on one silo and one seed;
     - item-mean metrics: paired approximate randomisation (sacreBLEU's draws, seed 12345,
       10000 trials; p counts trials at least as extreme, so the many exact ties of accuracy-type
       metrics count against the claim), exact (every swap enumerated) when 2^items ≤ trials.
   - Without them (every committed study record): Welch's t-test over the seeds' values (scipy),
     which accounts for n seeds per side but not for test-set sampling, and needs 2 seeds per side.
3. **The level.** p < alpha (0.05, `[study] alpha`) in the claimed direction: `holds`; in the
   other: `reversed`; else `not significant`.

The verdict names its test and p beside the outcome, e.g. "holds (p = 0.003, paired bootstrap
over 750 test items × 3 seeds)"; spread.py's `beyond_spread` stays a display, not the verdict.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ALPHA", "Verdict", "ItemsError", "display_unit", "judge_seeds", "judge_items", "read_items",
           "paired_bootstrap", "paired_randomisation", "is_item_mean", "stack"]

ALPHA = 0.05
SEED = 12345             # sacreBLEU's default SACREBLEU_SEED
BOOTSTRAP_SAMPLES = 1000  # sacreBLEU's paired_bs default
AR_TRIALS = 10000         # sacreBLEU's paired_ar default
ITEMS = Path("items") / "test.jsonl"

HOLDS, REVERSED, NOT_SIGNIFICANT, UNDECIDABLE, NEEDS_SEEDS = (
    "holds", "reversed", "not significant", "undecidable", "needs 2 seeds")

Unit = tuple[str, Any]  # (client, task): one evaluated test row
ItemRow = tuple[list[str], list[dict]]  # (item ids, item stats)
Metric = Callable[[Mapping[str, Any]], "float | None"]  # pooled stats → the metric (the task's own function)


class ItemsError(ValueError):
    """Per-item records that cannot be used: unreadable, or not the same items on both sides."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of "a > b", with the test and p (or why no test was run)."""
    outcome: str
    difference: float | None = None
    p: float | None = None
    test: str = ""
    resolution: float | None = None
    interval: float | None = None  # half width of the difference's 95% bootstrap interval
    fmt: str = ".2f"

    def __str__(self) -> str:
        if self.outcome == NEEDS_SEEDS:
            return NEEDS_SEEDS
        if self.outcome == UNDECIDABLE:
            return (f"undecidable: difference {_num(abs(self.difference), self.fmt, 1)} not above the metric's "
                    f"resolution {_num(self.resolution, self.fmt, 1)} ({self.test})")
        ci = f", 95% interval ±{_num(self.interval, self.fmt, 1)}" if self.interval is not None else ""
        return f"{self.outcome} ({_p(self.p)}{ci}, {self.test})"


def _decimals(fmt: str) -> int | None:
    found = re.search(r"\.(\d+)[fe%]?$", fmt or "")
    return int(found.group(1)) if found else None


def display_unit(fmt: str) -> float:
    """One unit of the last digit a `fmt` (".2f", ",.0f", "+.4f") shows; 0 when it fixes none."""
    d = _decimals(fmt)
    return 0.0 if d is None else 10.0 ** -d


def _num(x: float | None, fmt: str, extra: int = 0) -> str:
    d = _decimals(fmt)
    return "-" if x is None else f"{x:.{(d or 0) + extra}f}"


def _p(p: float | None) -> str:
    return "p = -" if p is None else "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _decide(diff: float, p: float, alpha: float) -> str:
    if p < alpha and diff != 0:
        return HOLDS if diff > 0 else REVERSED
    return NOT_SIGNIFICANT


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


# ---------------------------------------------------------------- without per-item records: seeds only

def _flat(xs: Sequence[float]) -> bool:
    return max(xs) - min(xs) <= 1e-12 * max(1.0, max(abs(x) for x in xs))


def judge_seeds(a: Sequence[float | None], b: Sequence[float | None], fmt: str = ".2f", alpha: float = ALPHA,
                why: str = "no per-item records") -> Verdict:
    """"a > b" from each seed's value: Welch's t-test (unequal variances, scipy) over the seeds, after
    the display resolution. Both sides without spread (every seed the same) and apart: p = 0."""
    xs, ys = _finite(a), _finite(b)
    if len(xs) < 2 or len(ys) < 2:
        return Verdict(NEEDS_SEEDS, fmt=fmt)
    diff = float(np.mean(xs) - np.mean(ys))
    test = f"Welch's t-test over {len(xs)} vs {len(ys)} seeds; {why}"
    resolution = display_unit(fmt)
    if abs(diff) <= resolution:
        return Verdict(UNDECIDABLE, diff, test=test, resolution=resolution, fmt=fmt)
    if _flat(xs) and _flat(ys):  # no spread on either side (to rounding): the gap is all there is
        p = 0.0
    else:
        import warnings

        from scipy import stats

        with warnings.catch_warnings():  # nearly equal seeds: scipy warns of cancellation, its p stands
            warnings.simplefilter("ignore", RuntimeWarning)
            p = float(stats.ttest_ind(xs, ys, equal_var=False).pvalue)
    return Verdict(_decide(diff, p, alpha), diff, p, test, resolution, fmt=fmt)


# ---------------------------------------------------------------- per-item records

def read_items(run: Path) -> dict[Unit, ItemRow] | None:
    """A finished run's per-item test statistics by (client, task); an "alone" run's from its
    per-silo sub-runs (results.json's `subruns`). None when a run has none (older records);
    ItemsError naming the file when one is unreadable."""
    run = Path(run)
    paths = [run / ITEMS]
    if not paths[0].is_file():
        try:
            subruns = json.loads((run / "results.json").read_text()).get("subruns") or {}
        except (OSError, ValueError, AttributeError):
            subruns = {}
        paths = [run / str(p) / ITEMS for p in subruns.values()] if isinstance(subruns, Mapping) else []
        if not paths or not all(p.is_file() for p in paths):
            return None
    rows: dict[Unit, ItemRow] = {}
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ItemsError(f"{path}: cannot read it ({err})") from None
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                unit = (record["client"], record.get("task"))
                ids, stats = [str(i) for i in record["ids"]], list(record["stats"])
            except (ValueError, KeyError, TypeError) as err:
                raise ItemsError(f"{path}: line {number}: not a per-item record ({err})") from None
            if len(ids) != len(stats) or not all(isinstance(s, Mapping) for s in stats):
                raise ItemsError(f"{path}: line {number}: {len(ids)} ids for {len(stats)} item stats")
            rows[unit] = (ids, stats)
    return rows


@dataclass(frozen=True)
class _Layout:
    """Where each stats key sits in a flat vector, and a column counting the items that have it
    (so a pooled resample has a key exactly when `pool` would give it one)."""
    keys: tuple[tuple[str, int, int, int], ...]  # (key, start, length (0: a number), presence column)
    width: int

    @staticmethod
    def of(stats: Sequence[Mapping[str, Any]]) -> _Layout:
        shapes: dict[str, int] = {}
        for s in stats:
            for key, value in s.items():
                length = len(value) if isinstance(value, (list, tuple)) else 0
                if shapes.setdefault(key, length) != length:
                    raise ItemsError(f"item stats {key!r}: vectors of length {shapes[key]} and {length}")
        keys, at = [], 0
        for key, length in shapes.items():
            keys.append((key, at, length, at + max(length, 1)))
            at += max(length, 1) + 1
        return _Layout(tuple(keys), at)

    def matrix(self, stats: Sequence[Mapping[str, Any]]) -> np.ndarray:
        out = np.zeros((len(stats), self.width))
        for i, s in enumerate(stats):
            for key, start, length, present in self.keys:
                if key in s:
                    out[i, start:start + max(length, 1)] = s[key] if length else float(s[key])
                    out[i, present] = 1.0
        return out

    def stats(self, vector: np.ndarray) -> dict:
        return {key: (vector[start:start + length].tolist() if length else float(vector[start]))
                for key, start, length, present in self.keys if vector[present] > 0}


def stack(runs: Sequence[Mapping[Unit, ItemRow]], units: Sequence[Unit]) -> tuple[list[list[np.ndarray]], _Layout,
                                                                                  list[int]]:
    """Per run, per unit, an items × stats matrix in one layout; ItemsError where a unit is missing or
    its item ids differ between runs (they cannot be paired). Returns (matrices, layout, items per unit)."""
    for unit in units:
        have = [r.get(unit) for r in runs]
        if any(h is None for h in have):
            raise ItemsError(f"silo {_unit_name(unit)}: a run has no per-item record of it")
        if any(h[0] != have[0][0] for h in have[1:]):
            raise ItemsError(f"silo {_unit_name(unit)}: the runs' test items differ (ids), so they cannot be paired")
    layout = _Layout.of([s for r in runs for u in units for s in r[u][1]])
    return [[layout.matrix(r[u][1]) for u in units] for r in runs], layout, [len(runs[0][u][0]) for u in units]


def _unit_name(unit: Unit) -> str:
    return unit[0] if unit[1] is None else f"{unit[0]} / {unit[1]}"


def _value(metric: Metric, layout: _Layout, vector: np.ndarray) -> float:
    value = metric(layout.stats(vector))
    return math.nan if value is None else float(value)


def _overall(metric: Metric, layout: _Layout, pooled: Sequence[np.ndarray]) -> np.ndarray:
    """Per draw, the mean over units of the metric of each unit's pooled (draws × width) statistics."""
    return np.mean([[_value(metric, layout, v) for v in unit] for unit in pooled], axis=0)


def _side(metric: Metric, layout: _Layout, runs: Sequence[Sequence[np.ndarray]],
          weights: Sequence[np.ndarray]) -> np.ndarray:
    """Per draw, the mean over a side's seeds of its Overall; `weights[u]` (draws × items) says how
    often each item of unit u is taken."""
    return np.mean([_overall(metric, layout, [w @ x for w, x in zip(weights, run)]) for run in runs], axis=0)


@dataclass(frozen=True)
class BootstrapResult:
    difference: float
    p: float
    interval: float             # half width of the difference's 95% interval (sacreBLEU's estimate_ci)
    a: tuple[float, float]      # (bootstrap mean, 95% half width) of side a, as sacreBLEU reports a system
    b: tuple[float, float]


def paired_bootstrap(a: Sequence[Sequence[np.ndarray]], b: Sequence[Sequence[np.ndarray]], metric: Metric,
                     layout: _Layout, samples: int = BOOTSTRAP_SAMPLES, seed: int = SEED) -> BootstrapResult:
    """sacreBLEU's paired bootstrap (`_paired_bs_test`), over seeds (a[s][u]: seed s, unit u) and units.

    Its draws (default_rng(seed).choice(N, (samples, N)) per unit in order), its statistic (|a − b|
    per resample, centred on its mean, against the real |a − b|) and its p and interval functions,
    so one unit and one seed give its numbers exactly."""
    from sacrebleu.significance import _compute_p_value, estimate_ci

    rng = np.random.default_rng(seed)
    weights = []
    for x in a[0]:
        n = x.shape[0]
        idx = rng.choice(n, size=(samples, n), replace=True)
        counts = np.zeros((samples, n))
        np.add.at(counts, (np.arange(samples)[:, None], idx), 1.0)
        weights.append(counts)
    ones = [np.ones((1, x.shape[0])) for x in a[0]]
    real = float(_side(metric, layout, a, ones)[0] - _side(metric, layout, b, ones)[0])
    sa, sb = _side(metric, layout, a, weights), _side(metric, layout, b, weights)
    diffs = np.abs(sa - sb)
    p = float(_compute_p_value(diffs - diffs.mean(), abs(real)))
    return BootstrapResult(real, p, float(estimate_ci(sa - sb)[1]), tuple(map(float, estimate_ci(sa))),
                           tuple(map(float, estimate_ci(sb))))


def paired_randomisation(a: Sequence[Sequence[np.ndarray]], b: Sequence[Sequence[np.ndarray]], metric: Metric,
                         layout: _Layout, trials: int = AR_TRIALS, seed: int = SEED) -> tuple[float, float, bool]:
    """Paired approximate randomisation: each item's statistics swapped between a and b (in every seed
    at once) with probability ½, sacreBLEU's draws (default_rng(seed).integers(2, (trials, N), bool)
    per unit). Returns (difference, p, exact): p = (#{|t*| ≥ |t|} + 1) / (trials + 1), or, when
    2^items ≤ trials, the exact share over every swap pattern."""
    sizes = [x.shape[0] for x in a[0]]
    exact = 2 ** sum(sizes) <= trials
    if exact:
        patterns = np.array(list(product((False, True), repeat=sum(sizes))), dtype=bool).reshape(-1, sum(sizes))
        masks = np.split(patterns, np.cumsum(sizes)[:-1], axis=1)
    else:
        rng = np.random.default_rng(seed)
        masks = [rng.integers(2, size=(trials, n), dtype=bool) for n in sizes]
    ones = [np.ones((1, n)) for n in sizes]
    real = float(_side(metric, layout, a, ones)[0] - _side(metric, layout, b, ones)[0])
    swap = [m.astype(float) for m in masks]
    keep = [1.0 - m for m in swap]
    sa = np.mean([_overall(metric, layout, [k @ xa + s @ xb for k, s, xa, xb in zip(keep, swap, ra, rb)])
                  for ra, rb in zip(a, b)], axis=0)
    sb = np.mean([_overall(metric, layout, [s @ xa + k @ xb for k, s, xa, xb in zip(keep, swap, ra, rb)])
                  for ra, rb in zip(a, b)], axis=0)
    extreme = int(np.sum(np.abs(sa - sb) >= abs(real) - 1e-12 * max(1.0, abs(real))))
    p = extreme / len(sa) if exact else (extreme + 1) / (len(sa) + 1)
    return real, float(p), exact


def is_item_mean(metric: Metric, layout: _Layout, units: Sequence[np.ndarray]) -> bool:
    """Whether the metric of pooled items is the mean of the items' own values (MAP, accuracy, EM)
    on every unit given, rather than a corpus score from pooled counts (BLEU, chrF, macro-F1)."""
    for x in units:
        own = [v for v in (_value(metric, layout, row) for row in x) if not math.isnan(v)]
        pooled = _value(metric, layout, x.sum(axis=0))
        if not own or math.isnan(pooled) or not math.isclose(pooled, float(np.mean(own)), rel_tol=1e-9,
                                                               abs_tol=1e-12):
            return False
    return True


def _item_unit(metric: Metric, layout: _Layout, runs: Sequence[Sequence[np.ndarray]]) -> float:
    """One item's worth of an item-mean Overall: the items' value range over (K · the smallest unit's count)."""
    values, smallest = [], math.inf
    for run in runs:
        for x in run:
            own = [v for v in (_value(metric, layout, row) for row in x) if not math.isnan(v)]
            values += own
            smallest = min(smallest, len(own) or math.inf)
    if not values or smallest == math.inf:
        return 0.0
    return (max(values) - min(values)) / (len(runs[0]) * smallest)


def judge_items(a: Sequence[Mapping[Unit, ItemRow]], b: Sequence[Mapping[Unit, ItemRow]], units: Sequence[Unit],
                metric: Metric, fmt: str = ".2f", alpha: float = ALPHA) -> Verdict:
    """"a > b" on the Overall (mean over `units`) of `metric`, from each side's per-seed item records
    (a[s]: seed s's run). ItemsError where the records cannot be paired."""
    if not a or not b or not units:
        raise ItemsError("no runs or no silos to pair")
    mats, layout, sizes = stack([*a, *b], units)
    xa, xb = mats[:len(a)], mats[len(a):]
    items = f"{sum(sizes)} test items × {len(a)}{'' if len(a) == len(b) else f' vs {len(b)}'} seed" + \
        ("s" if max(len(a), len(b)) > 1 else "")
    resolution = display_unit(fmt)
    if is_item_mean(metric, layout, xa[0]):
        resolution = max(resolution, _item_unit(metric, layout, mats))
        if len(a) != len(b):  # a swap needs a partner in the same seed
            raise ItemsError(f"{len(a)} vs {len(b)} seeds: a randomisation test pairs seed with seed")
        diff, p, exact = paired_randomisation(xa, xb, metric, layout)
        test = (f"exact paired randomisation over {items}" if exact else
                f"paired randomisation ({AR_TRIALS} trials) over {items}")
        interval = None
    else:
        result = paired_bootstrap(xa, xb, metric, layout)
        diff, p, interval = result.difference, result.p, result.interval
        test = f"paired bootstrap ({BOOTSTRAP_SAMPLES} resamples, sacreBLEU's) over {items}"
    if abs(diff) <= resolution:
        return Verdict(UNDECIDABLE, diff, test=test, resolution=resolution, fmt=fmt)
    return Verdict(_decide(diff, p, alpha), diff, p, test, resolution, interval, fmt)
