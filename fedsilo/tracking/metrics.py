"""A run's records as a tracker's metrics and parameters: one name per number, the same in every backend.

Names (docs/tracking.md): a round's own numbers as they are (`bytes_up`, `seconds`, `eval_seconds`,
`applied`), its dev evaluation under `dev/` (`dev/score`, `dev/<metric>` over the silos), and each silo's
numbers under `silo/<name>/` (`mean_loss`, `weight`, `bytes_up`, `phase_seconds/<phase>`,
`privacy/epsilon` with DP, `dev/<metric>`); the final results under `test/` and `silo/<name>/test/`.
Only numbers are taken: no string of a record (a reason, a silo's answer) becomes a metric.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

ROUND = "round"  # the metric every logged round has: how far a run's rounds go in a tracker
_UNSAFE = re.compile(r"[^\w.\- ]")  # what MLflow refuses in a name part (a slash separates parts)


def part(name: str) -> str:
    """One part of a metric name: a silo's name with its separators and odd characters made `_`."""
    cleaned = _UNSAFE.sub("_", str(name)).replace("..", "__").strip()
    return cleaned or "_"


def numbers(node: Any, prefix: str) -> dict[str, float]:
    """Every number (and boolean, as 0/1) under `node`, named `prefix/key/...`; lists and strings left out."""
    if isinstance(node, (int, float)):  # a bool too: float(True) is 1.0
        return {prefix: float(node)}
    if isinstance(node, Mapping):
        out: dict[str, float] = {}
        for key, value in node.items():
            out.update(numbers(value, f"{prefix}/{part(key)}" if prefix else part(key)))
        return out
    return {}


def summary(summary: Mapping[str, Any] | None, prefix: str) -> dict[str, float]:
    """An evaluation summary (spec.summarize's): the silos' mean under `prefix/`, each silo's under
    `silo/<name>/prefix/`, and its score."""
    if not summary:
        return {}
    out = numbers(summary.get("macro") or {}, prefix)
    if isinstance(summary.get("score"), (int, float)):
        out[f"{prefix}/score"] = float(summary["score"])
    for row in summary.get("rows") or []:
        out.update(numbers(row.get("metrics") or {}, f"silo/{part(row.get('client', '_'))}/{prefix}"))
    return out


def round_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """One rounds.jsonl record as metrics at step `record["round"]`."""
    top = {k: v for k, v in record.items() if k not in ("clients", "dev", "compute", "round")}
    out = {ROUND: float(record["round"]), **numbers(top, "")}
    for silo, entry in (record.get("clients") or {}).items():
        out.update(numbers(entry, f"silo/{part(silo)}"))
    out.update(summary(record.get("dev"), "dev"))
    return out


def result_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """results.json as metrics: the test summary, the untrained references (`reference/<name>/`), each
    DP silo's ε spent (`silo/<name>/privacy/`), the best round and the wall time."""
    out = summary(results.get("test"), "test")
    for name, ref in (results.get("reference") or {}).items():
        out.update(numbers((ref or {}).get("macro") or {}, f"reference/{part(name)}"))
    for silo, spent in (results.get("privacy") or {}).items():
        out.update(numbers(spent, f"silo/{part(silo)}/privacy"))
    for key in ("best_round", "best_dev", "wall_seconds"):
        if isinstance(results.get(key), (int, float)) and not isinstance(results.get(key), bool):
            out[key] = float(results[key])
    return out


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A config as `section.key` → value text (lists and free-form tables as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
        elif isinstance(value, str):
            out[name] = value
        else:
            out[name] = json.dumps(value, sort_keys=True)
    return out
