"""Two runs of the same tasks, task by task: the FewFedWeight paper's performance improvement rate.

For each (client, task) row of the test results, with m the run's primary metric (each task its own):

    PIR = (m_new − m_base) / |m_base|

the paper's Eq. 6 wherever m_base > 0 (the absolute value keeps "better" positive for a metric
that can be negative, MCC); undefined where m_base = 0, and such rows are left out of the means and
counted. A client's APIR is the mean PIR over its tasks; the run's APIR is the mean over clients (the
paper: "each client has its own APIR and the APIR averaged over the four clients is reported").
Win / Lose / Tie count the rows whose metric is above / below / equal to the baseline's (equal:
within `tie` absolute, 0 by default: few-shot test sets make exact ties common).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsilo.errors import CompareError


def _metric_rows(results: Any, where: str) -> tuple[dict[tuple[str, str], float | None], str, bool]:
    """(client, task) → the primary metric, checked field by field: a hand-edited or foreign
    results.json is an error naming the file and the field, never a KeyError."""
    if not isinstance(results, Mapping):
        raise CompareError(f"{where}: expected a JSON object at the top level, got {_kind(results)}")
    test, spec = results.get("test") or {}, results.get("metric_spec") or {}
    for key, value in (("test", test), ("metric_spec", spec)):
        if not isinstance(value, Mapping):
            raise CompareError(f"{where}: {key!r} is {_kind(value)}, expected an object")
    primary, higher = spec.get("primary"), spec.get("higher_is_better", True)
    if not test.get("rows") or not primary:
        raise CompareError(f"{where}: no test results (a finished run's results.json)")
    if not isinstance(primary, str) or not isinstance(higher, bool):
        raise CompareError(f"{where}: metric_spec needs a metric name 'primary' and a true/false 'higher_is_better'")
    if not isinstance(test["rows"], list):
        raise CompareError(f"{where}: test.rows is {_kind(test['rows'])}, expected a list")
    out: dict[tuple[str, str], float | None] = {}
    for i, row in enumerate(test["rows"]):
        at = f"{where}: test.rows[{i}]"
        if not isinstance(row, Mapping):
            raise CompareError(f"{at} is {_kind(row)}, expected an object")
        for key in ("client", "task"):
            if not isinstance(row.get(key), str):
                raise CompareError(f"{at}: {'no' if row.get(key) is None else 'a non-text'} {key!r}")
        metrics = row.get("metrics") or {}
        if not isinstance(metrics, Mapping):
            raise CompareError(f"{at}: metrics is {_kind(metrics)}, expected an object")
        value = metrics.get(primary)
        if isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
            raise CompareError(f"{at}: metrics.{primary} is {_kind(value)} ({value!r}), expected a number")
        if (row["client"], row["task"]) in out:
            raise CompareError(f"{at}: a second row for client {row['client']!r}, task {row['task']!r}")
        out[(row["client"], row["task"])] = None if value is None else float(value)
    return out, primary, higher


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def check_tie(tie: float) -> None:
    """A tie margin is an absolute metric difference: NaN would make every row a win or a loss, and
    a negative one would make no difference a tie, both silently."""
    if isinstance(tie, bool) or not isinstance(tie, (int, float)) or not math.isfinite(tie) or tie < 0:
        raise CompareError(f"--tie {tie!r}: the tie margin must be a finite number ≥ 0 (metric differences up "
                           "to it count as ties)")


def pir(new: float, base: float) -> float | None:
    return None if base == 0 else (new - base) / abs(base)


def compare(results: Mapping[str, Any], baseline: Mapping[str, Any], tie: float = 0.0,
            where: tuple[str, str] = ("run", "baseline")) -> dict:
    """{rows: [{client, task, new, base, pir, outcome}], clients: {client: apir}, apir, win, lose,
    tie, undefined} for two runs' test results over the same (client, task) rows."""
    check_tie(tie)
    new, primary, higher = _metric_rows(results, where[0])
    base, base_primary, _ = _metric_rows(baseline, where[1])
    if primary != base_primary:
        raise CompareError(f"{where[0]} is scored by {primary!r}, {where[1]} by {base_primary!r}")
    if set(new) != set(base):
        missing = sorted(set(base) ^ set(new))[0]
        side = where[0] if missing not in new else where[1]
        raise CompareError(f"the runs hold different tasks: {side} has no row for client {missing[0]!r}, "
                           f"task {missing[1]!r}")
    sign = 1.0 if higher else -1.0
    rows, counts = [], {"win": 0, "lose": 0, "tie": 0, "undefined": 0}
    for key in base:
        m_new, m_base = new[key], base[key]
        for side, value in zip(where, (m_new, m_base)):
            if value is None or not math.isfinite(value):
                raise CompareError(f"{side}: client {key[0]!r}, task {key[1]!r}: no finite {primary} value ({value})")
        diff = sign * (m_new - m_base)
        outcome = "tie" if abs(diff) <= tie else ("win" if diff > 0 else "lose")
        rate = pir(m_new, m_base)
        rate = None if rate is None else sign * rate
        counts[outcome] += 1
        counts["undefined"] += rate is None
        rows.append({"client": key[0], "task": key[1], "new": m_new, "base": m_base, "pir": rate, "outcome": outcome})
    per_client: dict[str, list[float]] = {}
    for r in rows:
        per_client.setdefault(r["client"], [])
        if r["pir"] is not None:
            per_client[r["client"]].append(r["pir"])
    clients = {c: (sum(v) / len(v) if v else None) for c, v in per_client.items()}
    defined = [v for v in clients.values() if v is not None]
    return {"metric": primary, "rows": rows, "clients": clients,
            "apir": sum(defined) / len(defined) if defined else None, **counts}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def to_markdown(summary: Mapping[str, Any], name: str, baseline_name: str) -> str:
    lines = [f"# {name} vs {baseline_name}", "",
             f"APIR {_pct(summary['apir'])} · Win {summary['win']} / Lose {summary['lose']} / Tie {summary['tie']}"
             + (f" · PIR undefined (baseline 0) for {summary['undefined']} task(s)" if summary["undefined"] else ""),
             "", "| client | APIR |", "| --- | ---: |"]
    lines += [f"| {c} | {_pct(v)} |" for c, v in summary["clients"].items()]
    lines += ["", f"| client | task | {baseline_name} | {name} | PIR | |", "| --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['client']} | {r['task']} | {r['base']:.2f} | {r['new']:.2f} | {_pct(r['pir'])} | {r['outcome']} |"
              for r in summary["rows"]]
    return "\n".join(lines) + "\n"


def compare_runs(run: Path, baseline: Path, tie: float = 0.0) -> tuple[dict, Path]:
    """Compare two run directories; writes RUN/compare-<baseline>.{md,json}. Returns (summary, md path)."""
    check_tie(tie)
    run, baseline = Path(run), Path(baseline)
    summary = compare(read_results(run), read_results(baseline), tie,
                      (str(run / "results.json"), str(baseline / "results.json")))
    stem = run / f"compare-{baseline.name or 'baseline'}"
    md = stem.with_suffix(".md")
    md.write_text(to_markdown(summary, run.name, baseline.name))
    stem.with_suffix(".json").write_text(json.dumps({"baseline": str(baseline), **summary}, indent=1))
    return summary, md


def read_results(path: Path) -> dict:
    """A finished run directory's results.json (CompareError naming the file otherwise)."""
    file = path / "results.json"
    if not file.is_file():
        raise CompareError(f"{path}: no results.json (not a finished run directory)")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CompareError(f"{file}: cannot read it ({err})") from None
