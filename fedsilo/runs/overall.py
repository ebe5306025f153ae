"""The comparison table of a study: one line per method, one column per silo, and an Overall that
compares like with like.

Overall is each metric's mean over the silos that every line of the table has a value for, the same
silos in every line (a variant run on fewer silos narrows it for all, and a note under the table
names the silos left out; study.json's `overall_clients` lists the silos it covers). Where no silo
is common to every line, a line shows its own mean marked † and no claim is judged on it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedsilo.rundir.records import column, display_name

from .spread import spread_cell

__all__ = ["MARK", "Unit", "averaged", "common_units", "overall_value", "comparison", "comparison_table"]

MARK = "†"  # an Overall over its own silos: no silo is common to every line


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
