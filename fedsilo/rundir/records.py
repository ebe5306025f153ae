"""Read and validate a run directory's files, and look things up in what they hold.

A run directory holds ``rounds.jsonl`` (one JSON object per round), an optional
``results.json`` (written when the run finishes), ``config.toml`` and, for the finetuning
paradigm, subruns under ``silos/<silo>/`` that are run directories themselves. A malformed
file fails on reading, naming file, line and key.

Nothing here knows a task: what the metrics are, their labels (with units), formats,
which one selects the model and whether a macro average is defined all come from the
task's :class:`~fedsilo.tasks.base.MetricSpec` as ``results.json`` records it
(``metric_spec``, ``MetricSpec.describe()``). An evaluation summary
(``MetricSpec.summarize()``) has one row per (client, task) pair, a ``macro`` (mean over
rows) and a ``pooled`` (from all rows' statistics together) entry, the selection
``score`` and the selection ``key``; the best round is the one
:func:`fedsilo.tasks.base.select_best` picks from the keys, exactly as the runner picks it.

Importing this module imports neither torch nor the task code: the task registry
(and ``select_best``, whose module imports torch) are imported only when needed.
"""
from __future__ import annotations

import importlib
import json
import os
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsilo.fileio import atomic_write_bytes, not_readable, read_jsonl

# Display names of the text-to-SQL silos (the paper's spelling); any other name shows as it is.
DISPLAY_NAMES: dict[str, str] = {
    "advising": "Advising",
    "atis": "ATIS",
    "geography": "GeoQuery",
    "restaurants": "Restaurants",
    "scholar": "Scholar",
    "academic": "Academic",
    "imdb": "IMDB",
    "yelp": "Yelp",
}

MB = 1e6


# --------------------------------------------------------------------- reading


def display_name(name: str, display: Mapping[str, str] | None = None) -> str:
    """Display name of a client; unknown names show as they are."""
    names = DISPLAY_NAMES if display is None else display
    return names.get(name, name)


def run_directory(run_dir: str | Path) -> Path:
    """`run_dir` as a Path; FileNotFoundError when it is not a directory."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory not found: {path}")
    return path


def read_text(path: Path) -> str:
    """A file's text; ValueError naming the file when it is not text, or not a regular file (a FIFO would
    block the reader for ever); FileNotFoundError when nothing is there."""
    why = not_readable(path)
    if why and why != "not found":
        raise ValueError(f"{path} is {why}")
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None


def read_rounds(run_dir: str | Path, notes: list[str] | None = None) -> list[dict]:
    """Parse ``rounds.jsonl``.

    A partly written last line (no newline after it: what a crashed writer leaves) is skipped,
    and a note saying so is appended to ``notes`` when given; any other bad line raises
    ValueError naming file and line. The runner reads the log by the same rule."""
    path = run_directory(run_dir) / "rounds.jsonl"
    if not os.path.lexists(path):
        raise FileNotFoundError(f"rounds log not found: {path}")
    parsed, partial = read_jsonl(read_text(path), str(path))
    if partial and notes is not None:
        notes.append(partial)
    rounds = []
    for lineno, record in parsed:
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        if not isinstance(record.get("round"), int):
            raise ValueError(f"{path}:{lineno}: not a round record (no integer 'round')")
        _check_round(record, f"{path}:{lineno}")
        rounds.append(record)
    return rounds


def read_results(run_dir: str | Path) -> dict | None:
    """``results.json`` if the run has finished, else ``None``; malformed JSON raises ValueError
    naming file and line."""
    path = run_directory(run_dir) / "results.json"
    if not os.path.lexists(path):
        return None
    try:
        results = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}:1: expected a JSON object, got {type(results).__name__}")
    _check_results(results, str(path))
    return results


# What the report reads from a record, by type: a hand-edited or foreign file fails on reading,
# naming file, line and key, never deep inside a table or a plot.
_NUM = (int, float)
_KIND = {_NUM: "a number", int: "an integer", str: "a string", list: "a list", dict: "an object"}
_ROUND = {"seconds": _NUM, "eval_seconds": _NUM, "bytes_up": _NUM, "bytes_down": _NUM, "clients": dict,
          "missing": list, "dev": dict}
_CLIENT = {"weight": _NUM, "steps": _NUM, "losses": list, "bytes_up": _NUM, "bytes_down": _NUM}
_SUMMARY = {"score": _NUM, "key": list, "macro": dict, "pooled": dict, "rows": list, "nonfinite": _NUM}
_RESULTS = {"name": str, "task": str, "paradigm": str, "rounds": int, "best_round": int, "best_dev": _NUM,
            "wall_seconds": _NUM, "metric_spec": dict, "display": dict, "test": dict, "subruns": dict,
            "reference": dict}
_SPEC = {"columns": list, "primary": str, "selection": str, "description": str, "tie_break": str}


def _typed(obj: Mapping[str, Any], fields: Mapping[str, Any], where: str) -> None:
    """Each key of `fields` is absent or null in `obj`, or of its type."""
    for key, kind in fields.items():
        value = obj.get(key)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{where}: {key!r} must be {_KIND[kind]}, got {type(value).__name__}")


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _numbers(values: Mapping[str, Any], where: str) -> None:
    for key, value in values.items():
        if value is not None and not isinstance(value, _NUM):
            raise ValueError(f"{where}: {key!r} must be a number or null, got {type(value).__name__}")


def _check_round(record: Mapping[str, Any], where: str) -> None:
    _typed(record, _ROUND, where)
    for name, client in (record.get("clients") or {}).items():
        client = _object(client, f"{where}: clients.{name}")
        _typed(client, _CLIENT, f"{where}: clients.{name}")
        if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, _NUM) for x in p)
                   for p in client.get("losses") or []):
            raise ValueError(f"{where}: clients.{name}: 'losses' must be a list of [step, loss] pairs")
    if record.get("dev") is not None:
        _check_summary(record["dev"], f"{where}: dev")


def _check_summary(summary: Mapping[str, Any], where: str) -> None:
    _typed(summary, _SUMMARY, where)
    for part in ("macro", "pooled"):
        _numbers(summary.get(part) or {}, f"{where}.{part}")
    if not all(isinstance(k, _NUM) for k in summary.get("key") or []):
        raise ValueError(f"{where}: 'key' must be a list of numbers")
    for i, row in enumerate(summary.get("rows") or []):
        row = _object(row, f"{where}.rows[{i}]")
        if not isinstance(row.get("client"), str):
            raise ValueError(f"{where}.rows[{i}]: 'client' must be a string")
        _typed(row, {"metrics": dict}, f"{where}.rows[{i}]")
        _numbers(row.get("metrics") or {}, f"{where}.rows[{i}].metrics")


def _check_results(results: Mapping[str, Any], where: str) -> None:
    _typed(results, _RESULTS, where)
    spec = results.get("metric_spec") or {}
    _typed(spec, _SPEC, f"{where}: metric_spec")
    for i, col in enumerate(spec.get("columns") or []):
        col_where = f"{where}: metric_spec.columns[{i}]"
        _typed(_object(col, col_where), {"fmt": str}, col_where)
        if not isinstance(col.get("key"), str) or not isinstance(col.get("label"), str):
            raise ValueError(f"{col_where}: 'key' and 'label' must be strings")
        try:
            format(0.0, col.get("fmt") or ".2f")
        except ValueError:
            raise ValueError(f"{col_where}: 'fmt' {col['fmt']!r} is not a number format") from None
    if results.get("test") is not None:
        _check_summary(results["test"], f"{where}: test")
    for part in ("display", "subruns"):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (results.get(part) or {}).items()):
            raise ValueError(f"{where}: {part!r} must map names to strings")
    if any(Path(k).name != k or ".." in Path(v).parts or Path(v).is_absolute()
           for k, v in (results.get("subruns") or {}).items()):
        raise ValueError(f"{where}: 'subruns' must name folders inside the run directory")


def read_config(root: Path) -> dict:
    """config.toml as a dict; an unreadable one is left to the runner to complain about."""
    try:
        return tomllib.loads(read_text(root / "config.toml"))
    except (OSError, ValueError):  # TOMLDecodeError is a ValueError
        return {}


def registry_spec(config: Mapping[str, Any]) -> dict | None:
    """The task's spec from the task registry, for a run with no results.json yet (imports the
    task's code); None when the config names no importable task."""
    task = config.get("task")
    name = task.get("name") if isinstance(task, Mapping) else None
    if not isinstance(name, str):
        return None
    try:
        from fedsilo import builtins  # noqa: F401  (the built-in tasks)
        from fedsilo.tasks import TASKS
        for module in config.get("plugins") or []:
            importlib.import_module(module)
        return TASKS.get(name).spec().describe()
    except Exception:  # noqa: BLE001 - without a spec the report falls back to generic labels
        return None


# ------------------------------------------------------------------ test items

ITEMS_FOLDER = "items"
_ITEM_KEYS = {"client", "task", "split", "ids", "stats"}


def items_path(run_dir: str | Path, split: str = "test") -> Path:
    """Where a run directory keeps the per-item stats of its final `split` evaluation."""
    return Path(run_dir) / ITEMS_FOLDER / f"{split}.jsonl"


def item_records(rows: Sequence[Mapping[str, Any]], split: str = "test") -> list[dict]:
    """The items file's lines from evaluation rows that carry `items` (`fedsilo.tasks.base.ItemStats`):
    {client, task, split, ids, stats}, in the rows' order (results.json's)."""
    return [{"client": r["client"], "task": r.get("task"), "split": split, "ids": list(r["items"]["ids"]),
             "stats": list(r["items"]["stats"])} for r in rows if r.get("items") is not None]


def write_items(run_dir: str | Path, records: Sequence[Mapping[str, Any]], split: str = "test") -> Path | None:
    """`items/<split>.jsonl`, written atomically (temporary file, fsync, rename) before results.json,
    so a run that reports a test result has its items. Nothing is written without records (a task
    that keeps no per-item stats). Ids are hashes and stats numbers: no silo text."""
    if not records:
        return None
    path = items_path(run_dir, split)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())
    return path


def read_items(run_dir: str | Path, split: str = "test") -> list[dict] | None:
    """The items file's records (see `write_items`), or None when the run has none; a malformed one
    raises ValueError naming file, line and what is wrong (what a significance test pairs must be
    the run's own numbers)."""
    path = items_path(run_directory(run_dir), split)
    if not os.path.lexists(path):
        return None
    parsed, partial = read_jsonl(read_text(path), str(path))
    if partial:  # written atomically: a cut line is not a crash's, the file was altered
        raise ValueError(partial.replace(" skipped", ""))
    records = []
    for lineno, record in parsed:
        where = f"{path}:{lineno}"
        if not isinstance(record, dict) or set(record) != _ITEM_KEYS:
            raise ValueError(f"{where}: expected an object with keys {', '.join(sorted(_ITEM_KEYS))}")
        ids, stats = record["ids"], record["stats"]
        if not isinstance(ids, list) or not all(isinstance(i, str) and len(i) == 16 and
                                                all(c in "0123456789abcdef" for c in i) for i in ids):
            raise ValueError(f"{where}: 'ids' must be a list of 16-hex-digit hashes")
        if not isinstance(stats, list) or len(stats) != len(ids):
            raise ValueError(f"{where}: 'stats' must be a list of one object per id ({len(ids)})")
        for i, item in enumerate(stats):
            item = _object(item, f"{where}: stats[{i}]")
            bad = next((k for k, v in item.items() if not _numeric(v)), None)
            if bad is not None:
                raise ValueError(f"{where}: stats[{i}][{bad!r}] must be a number or a list of numbers")
        records.append(record)
    return records


def _numeric(value: Any) -> bool:
    if isinstance(value, list):
        return all(_numeric(v) for v in value)
    return isinstance(value, _NUM) and not isinstance(value, bool)


# ---------------------------------------------------------------- metric specs


def metric_columns(spec: Mapping[str, Any] | None, summary: Mapping[str, Any] | None = None) -> list[dict]:
    """The spec's columns; without a spec, one generic column per metric the summary holds."""
    if spec and spec.get("columns"):
        return [{"fmt": ".2f", "in_macro": True, **c} for c in spec["columns"]]
    keys: dict[str, None] = {}
    for part in ("pooled", "macro"):
        keys.update(dict.fromkeys((summary or {}).get(part) or {}))
    for row in (summary or {}).get("rows", []):
        keys.update(dict.fromkeys(row.get("metrics") or {}))
    return [{"key": k, "label": k, "fmt": ".2f", "in_macro": True} for k in keys]


def column(spec: Mapping[str, Any] | None, key: str | None) -> dict | None:
    """The spec's column for metric `key` (label, format, in_macro), or None."""
    return next((c for c in metric_columns(spec) if c["key"] == key), None)


def higher_is_better(spec: Mapping[str, Any] | None, key: str) -> bool:
    """Which way a claim about metric `key` points: its column's own direction (results.json since
    issue 50), else the spec's for its primary metric and higher for any other (older runs)."""
    col = column(spec, key) or {}
    if "higher_is_better" in col:
        return bool(col["higher_is_better"])
    return key != (spec or {}).get("primary") or bool((spec or {}).get("higher_is_better", True))


def primary_key(spec: Mapping[str, Any] | None) -> str | None:
    """Key of the metric that selects the model; None without a spec."""
    return (spec or {}).get("primary")


def primary_label(spec: Mapping[str, Any] | None) -> str:
    """Label (with unit) of the metric that selects the model, e.g. ``EM %``; ``score`` without a spec."""
    col = column(spec, primary_key(spec))
    return col["label"] if col else (primary_key(spec) or "score")


def dev_metric(dev: Mapping[str, Any], part: str, key: str | None) -> float | None:
    """A dev summary's `part` (pooled or macro) value of metric `key`; None where missing or NaN."""
    value = (dev.get(part) or {}).get(key) if key else None
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def exchange_totals(rounds: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Parameters and bytes exchanged over the whole run, per direction (all clients, all rounds)."""
    return {k: float(sum((r.get(k) or 0) for r in rounds))
            for k in ("params_up", "params_down", "bytes_up", "bytes_down")}


# ------------------------------------------------------------------ best round


def dev_candidates(rounds: Sequence[Mapping[str, Any]]) -> list[dict]:
    """``{round, key, score}`` per evaluated round, in log order, for ``select_best``."""
    return [{"round": r["round"], "key": r["dev"].get("key"), "score": r["dev"].get("score")}
            for r in rounds if r.get("dev")]


def invalid_evaluations(rounds: Sequence[Mapping[str, Any]], results: Mapping[str, Any] | None = None
                        ) -> list[str]:
    """One line per evaluation in which the model scored items NaN/Inf (its summary's ``nonfinite``):
    its metrics are None and it is never the best round, which the tables alone show only as '-'."""
    lines = [f"round {r['round']} dev: {r['dev']['nonfinite']:.0f} item(s) scored NaN/Inf by the model; "
             f"invalid, never selected as best" for r in rounds if (r.get("dev") or {}).get("nonfinite")]
    test = (results or {}).get("test") or {}
    if test.get("nonfinite"):
        lines.append(f"test: {test['nonfinite']:.0f} item(s) scored NaN/Inf by the model; its metrics are invalid")
    return lines


def best_round(
    rounds: Sequence[Mapping[str, Any]], results: Mapping[str, Any] | None = None
) -> tuple[int | None, float | None]:
    """(best round, its dev score): as results.json records it once the run has finished, else the
    round :func:`fedsilo.tasks.base.select_best` picks from the evaluated rounds' selection keys
    (the runner's own rule: primary metric, then its tie-break), or (None, None)."""
    if results is not None and "best_round" in results:
        return results.get("best_round"), results.get("best_dev")
    from fedsilo.tasks.base import select_best  # imports torch: only when needed

    best = select_best(dev_candidates(rounds))
    return (best["round"], best["score"]) if best else (None, None)


def wall_seconds(rounds: Sequence[Mapping[str, Any]], results: Mapping[str, Any] | None = None) -> float:
    """The run's wall time: results.json's ``wall_seconds`` (training and dev and test evaluation)
    when recorded, else the logged rounds' training plus dev evaluation seconds."""
    if results is not None and results.get("wall_seconds") is not None:
        return float(results["wall_seconds"])
    return float(sum((r.get("seconds") or 0) + (r.get("eval_seconds") or 0) for r in rounds))


def spent_silos(logged: list[dict]) -> set[str]:
    """The silos that refused a round for good (their privacy budget is spent)."""
    return {c for record in logged for c, e in record.get("clients", {}).items() if e.get("final")}


def privacy_spent(logged: list[dict]) -> dict[str, dict]:
    """Each DP silo's accountant as of its last trained round (ε, δ, σ, q, steps)."""
    out = {}
    for record in logged:
        for client, entry in record.get("clients", {}).items():
            if entry.get("privacy"):
                out[client] = {**entry["privacy"], "round": record["round"]}
    return out


def refused_for_good(logged: list[dict]) -> dict[str, tuple[int, str]]:
    """Each silo that refused a round for good: (that round, its reason), the first time."""
    out: dict[str, tuple[int, str]] = {}
    for record in logged:
        for client, entry in record.get("clients", {}).items():
            if entry.get("final") and client not in out:
                out[client] = (record["round"], entry.get("refused", ""))
    return out
