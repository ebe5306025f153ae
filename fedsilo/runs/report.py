"""Turn a run directory into tables, plots and a Markdown report, for any task.

A run directory holds ``rounds.jsonl`` (one JSON object per round), an optional
``results.json`` (written when the run finishes) and, for the finetuning
paradigm, subruns under ``silos/<silo>/`` that are run directories themselves.

Nothing here knows a task: what the metrics are, their labels (with units), formats,
which one selects the model and whether a macro average is defined all come from the
task's :class:`~fedsilo.tasks.base.MetricSpec` as ``results.json`` records it
(``metric_spec``, ``MetricSpec.describe()``). An evaluation summary
(``MetricSpec.summarize()``) has one row per (client, task) pair, a ``macro`` (mean over
rows) and a ``pooled`` (from all rows' statistics together) entry, the selection
``score`` and the selection ``key``; the best round is the one
:func:`fedsilo.tasks.base.select_best` picks from the keys, exactly as the runner picks it.

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas
directly rather than through pyplot, so importing this module never switches
the caller's backend and no figure stays registered in pyplot's global state.
Importing this module imports neither torch nor the task code: the task registry
(and ``select_best``, whose module imports torch) are imported only when needed.
"""
from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table

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
AVERAGES_NOTE = "Macro = mean over rows; Pooled = computed from all rows' statistics together."

# --------------------------------------------------------------------- reading


def display_name(name: str, display: Mapping[str, str] | None = None) -> str:
    """Display name of a client; unknown names show as they are."""
    names = DISPLAY_NAMES if display is None else display
    return names.get(name, name)


def _run_dir(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory not found: {path}")
    return path


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None


def read_rounds(run_dir: str | Path, notes: list[str] | None = None) -> list[dict]:
    """Parse ``rounds.jsonl``.

    A partly written last line (no newline after it: what a crashed writer leaves) is skipped,
    and a note saying so is appended to ``notes`` when given; any other bad line raises
    ValueError naming file and line. The runner reads the log by the same rule."""
    path = _run_dir(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"rounds log not found: {path}")
    lines = _text(path).split("\n")
    rounds = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):  # no newline after it: the writer was cut off
                if notes is not None:
                    notes.append(f"{path}:{lineno}: partly written last line ({len(line)} characters, "
                                 "what an interrupted run leaves) skipped")
                break
            raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
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
    path = _run_dir(run_dir) / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(_text(path))
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


def _read_config(root: Path) -> dict:
    """config.toml as a dict; an unreadable one is left to the runner to complain about."""
    try:
        return tomllib.loads((root / "config.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def _registry_spec(config: Mapping[str, Any]) -> dict | None:
    """The task's spec from the task registry, for a run with no results.json yet (imports the
    task's code); None when the config names no importable task."""
    task = config.get("task")
    name = task.get("name") if isinstance(task, Mapping) else None
    if not isinstance(name, str):
        return None
    try:
        import importlib

        from fedsilo.tasks import TASKS
        for module in config.get("plugins") or []:
            importlib.import_module(module)
        return TASKS.get(name).spec().describe()
    except Exception:  # noqa: BLE001 - without a spec the report falls back to generic labels
        return None


# --------------------------------------------------------------- metric specs


def _columns(spec: Mapping[str, Any] | None, summary: Mapping[str, Any] | None = None) -> list[dict]:
    """The spec's columns; without a spec, one generic column per metric the summary holds."""
    if spec and spec.get("columns"):
        return [{"fmt": ".2f", "in_macro": True, **c} for c in spec["columns"]]
    keys: dict[str, None] = {}
    for part in ("pooled", "macro"):
        keys.update(dict.fromkeys((summary or {}).get(part) or {}))
    for row in (summary or {}).get("rows", []):
        keys.update(dict.fromkeys(row.get("metrics") or {}))
    return [{"key": k, "label": k, "fmt": ".2f", "in_macro": True} for k in keys]


def _column(spec: Mapping[str, Any] | None, key: str | None) -> dict | None:
    return next((c for c in _columns(spec) if c["key"] == key), None)


def _primary(spec: Mapping[str, Any] | None) -> str | None:
    return (spec or {}).get("primary")


def primary_label(spec: Mapping[str, Any] | None) -> str:
    """Label (with unit) of the metric that selects the model, e.g. ``EM %``; ``score`` without a spec."""
    col = _column(spec, _primary(spec))
    return col["label"] if col else (_primary(spec) or "score")


def _fmt(value: Any, fmt: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _nonnegative(label: str, values: Sequence[float | None]) -> tuple[bool, bool]:
    """(a percentage, cannot be negative): percentages by their label, others when every value is >= 0."""
    percent = "%" in label
    seen = [v for v in values if v is not None and not math.isnan(v)]
    return percent, percent or all(v >= 0 for v in seen)


# ---------------------------------------------------------------------- tables


def _test_summary(results: Mapping[str, Any]) -> dict:
    test = results.get("test")
    if not isinstance(test, Mapping) or not isinstance(test.get("rows"), list):
        raise ValueError("results.json: 'test' has no evaluation rows (an older fedsilo's results?)")
    return test


def _with_task(rows: Sequence[Mapping[str, Any]], task: str | None) -> bool:
    """Label rows "client / task" unless every row's task is the run's task."""
    return any(r.get("task") != task for r in rows)


def _row_label(row: Mapping[str, Any], with_task: bool, display: Mapping[str, str] | None) -> str:
    name = display_name(row["client"], display)
    return f"{name} / {row.get('task')}" if with_task else name


def row_labels(results: Mapping[str, Any], display: Mapping[str, str] | None = None) -> list[str]:
    """One label per test row: the client's display name, or "client / task" for a run whose rows
    are of several tasks (a multi-task run)."""
    rows = _test_summary(results)["rows"]
    with_task = _with_task(rows, results.get("task"))
    return [_row_label(r, with_task, display) for r in rows]


def results_table(results: Mapping[str, Any], display: Mapping[str, str] | None = None) -> list[list[str]]:
    """Test results as rows of strings, header first: one column per evaluated row, then Macro and
    Pooled; one line per metric column of the spec, labelled with the column's label (which carries
    the unit), cells in the column's format, ``-`` where a value is null. Display names: `display`,
    else the task's as recorded in the results."""
    display = display if display is not None else (results.get("display") or None)
    test = _test_summary(results)
    rows = [["", *row_labels(results, display), "Macro", "Pooled"]]
    for col in _columns(results.get("metric_spec"), test):
        key, fmt = col["key"], col["fmt"]
        rows.append([
            col["label"],
            *(_fmt((r.get("metrics") or {}).get(key), fmt) for r in test["rows"]),
            _fmt((test.get("macro") or {}).get(key), fmt),
            _fmt((test.get("pooled") or {}).get(key), fmt),
        ])
    return rows


def table_caption(results: Mapping[str, Any]) -> str:
    """What the results table's rows and columns are: the spec's description, the averages, and
    the metrics with no macro average."""
    spec = results.get("metric_spec") or {}
    parts = [spec.get("description") or "One column per evaluated (client, task) row."]
    parts.append(AVERAGES_NOTE)
    no_macro = [c["label"] for c in _columns(spec) if not c.get("in_macro", True)]
    if no_macro:
        parts.append(f"No macro average for {', '.join(no_macro)}.")
    parts.append("'-': not available.")
    return " ".join(parts)


def combine_tables(
    named_results: Mapping[str, Mapping[str, Any]], display: Mapping[str, str] | None = None
) -> list[list[str]]:
    """One line per run on its primary metric (header first), to compare methods side by side;
    rows missing from a run show as ``-``. The header's first cell is the metric's label when all
    runs share it; otherwise each run's name carries its own."""
    keys: dict[tuple[str, str | None], None] = {}
    with_task = False
    for results in named_results.values():
        rows = _test_summary(results)["rows"]
        with_task |= _with_task(rows, results.get("task"))
        keys.update(dict.fromkeys((r["client"], r.get("task")) for r in rows))
    labels = {primary_label(r.get("metric_spec")) for r in named_results.values()}
    shared = labels.pop() if len(labels) == 1 else None
    header = [shared or "", *(_row_label({"client": c, "task": t}, with_task, display) for c, t in keys),
              "Macro", "Pooled"]
    table = [header]
    for name, results in named_results.items():
        spec, test = results.get("metric_spec"), _test_summary(results)
        key = _primary(spec) or _columns(spec, test)[0]["key"]
        fmt = (_column(spec, key) or {}).get("fmt", ".2f")
        by_key = {(r["client"], r.get("task")): (r.get("metrics") or {}).get(key) for r in test["rows"]}
        table.append([
            name if shared else f"{name} ({primary_label(spec)})",
            *(_fmt(by_key.get(k), fmt) for k in keys),
            _fmt((test.get("macro") or {}).get(key), fmt),
            _fmt((test.get("pooled") or {}).get(key), fmt),
        ])
    return table


def reference_tables(results: Mapping[str, Any], display: Mapping[str, str] | None = None
                     ) -> dict[str, list[list[str]]]:
    """The results table of each untrained reference ranker the run scored beside its model (e.g.
    BM25 for answer selection), by name; {} when none."""
    return {name: results_table({**results, "test": summary}, display)
            for name, summary in (results.get("reference") or {}).items()}


def matrix_table(results: Mapping[str, Any], display: Mapping[str, str] | None = None) -> list[list[str]]:
    """The cross-domain matrix on the primary metric (header first): one line per model (the
    global one, each client's own, or each silo's model trained alone), one column per domain,
    then their mean; [] when the run has none."""
    models = (results.get("matrix") or {}).get("models") or {}
    if not models:
        return []
    display = display if display is not None else (results.get("display") or None)
    spec = results.get("metric_spec")
    key = _primary(spec) or "score"
    fmt = (_column(spec, key) or {}).get("fmt", ".2f")
    domains = list(dict.fromkeys(r["client"] for summary in models.values() for r in summary.get("rows", [])))
    table = [[f"model \\ test ({primary_label(spec)})", *(display_name(d, display) for d in domains), "Mean"]]
    for name, summary in models.items():
        by_domain = {r["client"]: (r.get("metrics") or {}).get(key) for r in summary.get("rows", [])}
        label = "global" if name == "global" else display_name(name, display)
        table.append([label, *(_fmt(by_domain.get(d), fmt) for d in domains),
                      _fmt((summary.get("macro") or {}).get(key), fmt)])
    return table


MATRIX_NOTE = ("Every model on every domain's test set (the translation paper's Tables 2-7 have this "
               "shape): the global model, then each client's own model where clients keep tensors of "
               "their own, or (finetune) each domain's model trained alone.")


def exchange_totals(rounds: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Parameters and bytes exchanged over the whole run, per direction (all clients, all rounds)."""
    return {k: float(sum((r.get(k) or 0) for r in rounds))
            for k in ("params_up", "params_down", "bytes_up", "bytes_down")}


def _numeric(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return cell == "-"
    return True


def markdown_table(rows: list[list[str]]) -> str:
    """GitHub-flavoured Markdown; the first row is the header. Columns whose
    cells are all numbers are right-aligned so decimals line up."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", r"\|") for c in cells) + " |"

    header, *body = rows
    columns = list(zip(*body)) if body else [()] * len(header)
    rule = "|" + "|".join(
        " ---: " if col and all(_numeric(str(c)) for c in col) else " --- " for col in columns
    ) + "|"
    return "\n".join([line(header), rule, *map(line, body)])


def print_results(
    results: Mapping[str, Any], console: Console | None = None, display: Mapping[str, str] | None = None
) -> None:
    """Show what the table holds, then the results table, in the terminal with rich."""
    header, *body = results_table(results, display)
    table = Table(title=results.get("name"))
    table.add_column(header[0], style="bold")
    for col in header[1:]:
        table.add_column(col, justify="right", no_wrap=True)
    for row in body:
        table.add_row(*row)
    # A table is read whole: never squeeze it into a narrow or non-terminal default width.
    console = console or Console(width=max(Console().width, 160))
    console.print(table_caption(results), style="dim", markup=False, highlight=False)
    for warning in invalid_evaluations([], results):
        console.print(f"Warning: invalid evaluation, {warning}", style="bold red", markup=False, highlight=False)
    console.print(table)
    for name, table_rows in reference_tables(results, display).items():
        _print_grid(console, f"untrained reference: {name} (test)", table_rows)
    matrix = matrix_table(results, display)
    if matrix:
        _print_grid(console, "cross-domain matrix (test)", matrix)


def _print_grid(console: Console, title: str, rows: list[list[str]]) -> None:
    """A table printed whole: wider than the console, it is printed at its own width (lines wrap in a
    narrow terminal) rather than squeezed until row names vanish and cells end in '…'."""
    grid = Table(title=title)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    grid.add_column(rows[0][0], style="bold", no_wrap=True, min_width=widths[0])
    for col in rows[0][1:]:
        grid.add_column(col, justify="right", no_wrap=True)
    for row in rows[1:]:
        grid.add_row(*row)
    width = console.width
    console.width = max(width, sum(widths) + 3 * len(widths) + 1)
    try:
        console.print(grid)
    finally:
        console.width = width


# ----------------------------------------------------------------- best round


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


# ----------------------------------------------------------------------- plots


def _clients(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """Clients in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rounds:
        seen.update(dict.fromkeys(r.get("clients") or {}))
    return list(seen)


def _save(fig: Figure, path: str | Path) -> Figure:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


def _empty(fig: Figure, title: str, message: str) -> None:
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _integer_rounds(ax, xs: Sequence[int]) -> None:
    """Round axis: whole-number ticks only, for any number of rounds (one included), with half a
    round of room on either side."""
    if xs:
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _floor_at_zero(ax, label: str, values: Sequence[float | None]) -> None:
    """Never show negative values for a metric that cannot be negative; percentages start at 0."""
    percent, nonnegative = _nonnegative(label, values)
    low, high = ax.get_ylim()
    if percent:
        ax.set_ylim(0, max(high, 1.0))
    elif nonnegative and low < 0:
        ax.set_ylim(0, high if high > 0 else 1e-3)


def _loss_curve(rounds: Sequence[Mapping[str, Any]], client: str) -> tuple[list, list, list]:
    """A client's concatenated loss curve and the step at which each of its
    rounds ended (cumulative ``steps``), for the boundary marks."""
    steps, losses, ends, done = [], [], [], 0
    for r in rounds:
        c = (r.get("clients") or {}).get(client)
        if c is None:
            continue
        for step, loss in c.get("losses") or []:
            steps.append(step)
            losses.append(loss)
        done += c.get("steps") or 0
        ends.append(done)
    return steps, losses, ends[:-1]


def plot_losses(
    rounds: Sequence[Mapping[str, Any]], path: str | Path, display: Mapping[str, str] | None = None
) -> Figure:
    """Training loss against each client's own optimiser steps, one subplot per
    client (steps differ per client, so a shared x-axis would mislead);
    dotted lines mark where a round ended. Returns the saved Figure."""
    clients = _clients(rounds)
    cols = min(3, max(1, len(clients)))
    nrows = max(1, math.ceil(len(clients) / cols))
    fig = Figure(figsize=(4.2 * cols, 3.2 * nrows + 0.4), layout="constrained")
    if not clients:
        _empty(fig, "Training loss", "no clients in rounds.jsonl")
        return _save(fig, path)
    fig.suptitle("Training loss per client")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    for ax in axes[len(clients):]:
        fig.delaxes(ax)
    for ax, client in zip(axes, clients):
        steps, losses, ends = _loss_curve(rounds, client)
        ax.plot(steps, losses, color="tab:blue", lw=1.5, label="training loss")
        for end in ends:
            ax.axvline(end, color="0.6", ls=":", lw=0.8, label="round boundary")
        ax.set_title(display_name(client, display))
        ax.set_xlabel("client step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    fig.legend(unique.values(), unique.keys(), loc="outside lower center", ncols=2)
    return _save(fig, path)


def _weight(record: Mapping[str, Any], client: str) -> float:
    weight = ((record.get("clients") or {}).get(client) or {}).get("weight")
    return math.nan if weight is None else weight


def plot_weights(
    rounds: Sequence[Mapping[str, Any]], path: str | Path, display: Mapping[str, str] | None = None
) -> Figure:
    """Aggregation weight of each client per round; gaps where a client was not
    aggregated, shading where the weighting fell back to its default."""
    clients = _clients(rounds)
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    xs = [r["round"] for r in rounds]
    for client in clients:
        ax.plot(xs, [_weight(r, client) for r in rounds], marker="o", label=display_name(client, display))
    fallback = [r["round"] for r in rounds if r.get("fallback")]
    for i, rnd in enumerate(fallback):
        ax.axvspan(rnd - 0.5, rnd + 0.5, color="tab:red", alpha=0.12, lw=0,
                   label="fallback weighting" if i == 0 else None)
    schemes = sorted({str(r["weighting"]) for r in rounds if r.get("weighting")})
    ax.set_title("Aggregation weights" + (f" ({', '.join(schemes)})" if schemes else ""))
    ax.set_xlabel("round")
    ax.set_ylabel("weight")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _integer_rounds(ax, xs)
    if clients:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _save(fig, path)


def _dev_metric(dev: Mapping[str, Any], part: str, key: str | None) -> float | None:
    value = (dev.get(part) or {}).get(key) if key else None
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def plot_dev(
    rounds: Sequence[Mapping[str, Any]], path: str | Path, spec: Mapping[str, Any] | None = None,
    best: int | None = None,
) -> Figure:
    """The primary metric on dev per evaluated round: pooled (solid, circles) and macro (dashed,
    squares) lines in their own colours, the selection score as hollow diamonds drawn over them, the
    best round as a star, and the pooled dev loss on a twin axis. ``best`` defaults to the round
    ``select_best`` picks. The y axes never go below 0 for metrics that cannot be negative
    (percentages start at 0); the round axis has whole-number ticks only. Returns the saved Figure
    (its first axes is the metric's, the second, when present, the loss's)."""
    fig = Figure(figsize=(7.5, 4.4), layout="constrained")
    evaluated = [r for r in rounds if r.get("dev")]
    if not evaluated:
        _empty(fig, "Dev score", "no evaluated rounds yet")
        return _save(fig, path)
    if best is None:
        best = best_round(evaluated)[0]
    key, label = _primary(spec), primary_label(spec)
    selection = (spec or {}).get("selection", "pooled")
    ax = fig.add_subplot()
    xs = [r["round"] for r in evaluated]
    shown: list[float | None] = []
    # Pooled solid underneath, macro dashed with hollow squares over it: both stay visible where equal.
    for part, style in (("pooled", dict(color="tab:blue", ls="-", marker="o", ms=5, lw=2.0, zorder=3)),
                        ("macro", dict(color="tab:orange", ls="--", marker="s", ms=8, mfc="none", mew=1.5,
                                       lw=1.5, zorder=4))):
        ys = [_dev_metric(r["dev"], part, key) for r in evaluated]
        if any(y is not None for y in ys):
            ax.plot(xs, _nan(ys), label=f"{part} {label}", **style)
            shown += ys
    scores = [r["dev"].get("score") for r in evaluated]
    ax.plot(xs, _nan(scores), ls="none", marker="D", ms=10, mfc="none", mec="black", mew=1.3, zorder=5,
            clip_on=False, label=f"selection score ({selection} {label})")
    shown += scores
    at_best = [s for r, s in zip(evaluated, scores) if r["round"] == best and s is not None]
    if at_best:
        ax.plot([best], at_best, ls="none", marker="*", ms=16, color="tab:red", zorder=6, clip_on=False,
                label=f"best (round {best})")
    ax.set_title(f"Dev {label} per round")
    ax.set_xlabel("round")
    ax.set_ylabel(f"dev {label}")
    ax.grid(alpha=0.3)
    _floor_at_zero(ax, label, shown)
    _integer_rounds(ax, xs)
    ax.tick_params(axis="x", pad=9)  # markers at 0 are drawn unclipped: keep the round labels clear
    losses = [_dev_metric(r["dev"], "pooled", "loss") for r in evaluated]
    if any(v is not None for v in losses):  # a graded signal while the primary metric is still flat
        twin = ax.twinx()
        twin.plot(xs, _nan(losses), color="tab:gray", ls=":", marker="x", ms=6, lw=1.2, label="dev loss (pooled)")
        loss_col = _column(spec, "loss")
        loss_label = loss_col["label"].removeprefix("test ") if loss_col else "loss"
        twin.set_ylabel(f"pooled dev {loss_label}")
        _floor_at_zero(twin, "loss", losses)
        _integer_rounds(twin, xs)
    handles, labels = [], []
    for a in fig.axes:
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize="small")
    return _save(fig, path)


def _client_bytes(rounds: Sequence[Mapping[str, Any]], client: str, direction: str) -> list[float]:
    out = []
    for r in rounds:
        value = ((r.get("clients") or {}).get(client) or {}).get(direction)
        out.append(math.nan if value is None else value / MB)
    return out


def _clients_differ(rounds: Sequence[Mapping[str, Any]]) -> bool:
    """Whether some round's clients sent or received different amounts."""
    for r in rounds:
        for direction in ("bytes_up", "bytes_down"):
            values = {c.get(direction) for c in (r.get("clients") or {}).values() if c.get(direction) is not None}
            if len(values) > 1:
                return True
    return False


def plot_bytes(
    rounds: Sequence[Mapping[str, Any]], path: str | Path, display: Mapping[str, str] | None = None
) -> Figure:
    """Communication per round in MB: the totals up and down side by side, and, when clients
    differ, a row with one panel per direction and one line per client. Returns the saved Figure
    (axes: total, then up and down per client when shown)."""
    per_client = _clients_differ(rounds)
    fig = Figure(figsize=(8, 6.8 if per_client else 4), layout="constrained")
    if per_client:
        axes = fig.subplot_mosaic([["total", "total"], ["up", "down"]])
        ax = axes["total"]
    else:
        ax = fig.add_subplot()
    xs = [r["round"] for r in rounds]
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [(r.get("bytes_up") or 0) / MB for r in rounds],
           width, label="up (clients → server)")
    ax.bar([x + width / 2 for x in xs], [(r.get("bytes_down") or 0) / MB for r in rounds],
           width, label="down (server → clients)")
    ax.set_title("Communication per round (all clients)")
    ax.set_xlabel("round")
    ax.set_ylabel("MB (10⁶ bytes)")
    ax.grid(alpha=0.3, axis="y")
    ax.margins(y=0.2)  # headroom for the legend
    ax.legend(fontsize="small", loc="upper right", ncols=2)
    _integer_rounds(ax, xs)
    if per_client:
        clients = _clients(rounds)
        for direction, title in (("up", "Up per client"), ("down", "Down per client")):
            sub = axes[direction]
            for client in clients:
                sub.plot(xs, _client_bytes(rounds, client, f"bytes_{direction}"), marker="o", ms=4,
                         label=display_name(client, display))
            sub.set_title(title)
            sub.set_xlabel("round")
            sub.set_ylabel("MB (10⁶ bytes)")
            sub.set_ylim(bottom=0)
            sub.grid(alpha=0.3)
            _integer_rounds(sub, xs)
        handles, labels = axes["up"].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(4, max(1, len(clients))),
                   fontsize="small")
    return _save(fig, path)


# ---------------------------------------------------------------------- report


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def rounds_table(
    rounds: Sequence[Mapping[str, Any]], spec: Mapping[str, Any] | None = None,
    display: Mapping[str, str] | None = None,
) -> list[list[str]]:
    """Per-round rows (header first): round, training and dev evaluation seconds, weighting,
    fallback, rejected and missing clients, the dev selection score (labelled with the primary
    metric's label), the pooled dev loss and MB up/down."""
    selection = (spec or {}).get("selection", "pooled")
    score_fmt = (_column(spec, _primary(spec)) or {}).get("fmt", ".2f")
    loss_fmt = (_column(spec, "loss") or {}).get("fmt", ".3f")
    rows = [["Round", "Train s", "Eval s", "Weighting", "Fallback", "Rejected", "Missing",
             f"Dev {primary_label(spec)} ({selection})", "Dev loss", "MB up", "MB down"]]
    for r in rounds:
        dev = r.get("dev") or {}
        clients = r.get("clients") or {}
        rejected = [display_name(c, display) for c, v in clients.items() if (v or {}).get("rejected")]
        missing = [display_name(c, display) for c in r.get("missing") or []]
        rows.append([
            str(r["round"]),
            f"{r.get('seconds') or 0:.1f}",
            _fmt(r.get("eval_seconds"), ".1f"),
            str(r.get("weighting") or "-"),
            "yes" if r.get("fallback") else "no",
            ", ".join(rejected) or "-",
            ", ".join(missing) or "-",
            _fmt(dev.get("score"), score_fmt),
            _fmt(_dev_metric(dev, "pooled", "loss"), loss_fmt),
            f"{(r.get('bytes_up') or 0) / MB:.2f}",
            f"{(r.get('bytes_down') or 0) / MB:.2f}",
        ])
    return rows


def _write_plots(rounds, plot_dir: Path, spec, best, display) -> list[tuple[str, Path]]:
    """Plots that have data to show, as (caption, path) pairs."""
    plots = []
    if any(c.get("losses") for r in rounds for c in (r.get("clients") or {}).values()):
        plot_losses(rounds, plot_dir / "losses.png", display)
        plots.append(("Training loss", plot_dir / "losses.png"))
    if any(not math.isnan(_weight(r, c)) for r in rounds for c in r.get("clients") or {}):
        plot_weights(rounds, plot_dir / "weights.png", display)
        plots.append(("Aggregation weights", plot_dir / "weights.png"))
    if any(r.get("dev") for r in rounds):
        plot_dev(rounds, plot_dir / "dev.png", spec, best)
        plots.append((f"Dev {primary_label(spec)}", plot_dir / "dev.png"))
    if any(r.get("bytes_up") or r.get("bytes_down") for r in rounds):
        plot_bytes(rounds, plot_dir / "bytes.png", display)
        plots.append(("Communication", plot_dir / "bytes.png"))
    return plots


def _image_links(plots: list[tuple[str, Path]], root: Path) -> list[str]:
    return [f"![{caption}]({path.relative_to(root).as_posix()})\n" for caption, path in plots]


def _subruns(root: Path, results: Mapping[str, Any] | None) -> list[tuple[str, Path]]:
    """(silo, directory) of each finetuning subrun: as results.json lists them, else ``silos/*``."""
    listed = (results or {}).get("subruns")
    if isinstance(listed, Mapping) and listed:
        return [(silo, root / rel) for silo, rel in listed.items()]
    silos = root / "silos"
    return [(p.name, p) for p in sorted(silos.iterdir()) if p.is_dir()] if silos.is_dir() else []


def _relative(note: str, root: Path) -> str:
    return note.replace(f"{root}/", "")


def _best_line(best: int | None, score: float | None, spec, finished: bool) -> str:
    if best is None:
        return "-" if finished else "- (no evaluated round yet)"
    fmt = (_column(spec, _primary(spec)) or {}).get("fmt", ".2f")
    text = f"{best} (dev {primary_label(spec)} {_fmt(score, fmt)})"
    return text if finished else f"{text} so far; the run is unfinished"


def _subrun_section(silo: str, sub: Path, root: Path, spec, display) -> tuple[list[str], float, dict | None]:
    """Markdown for one per-silo subrun, its wall time and its metric spec."""
    lines = [f"### {display_name(silo, display)}\n"]
    if not (sub / "rounds.jsonl").is_file():
        return lines + ["_No rounds.jsonl yet._\n"], 0.0, None
    notes: list[str] = []
    rounds = read_rounds(sub, notes)
    results = read_results(sub)
    spec = (results or {}).get("metric_spec") or spec
    best, score = best_round(rounds, results)
    seconds = wall_seconds(rounds, results)
    status = "finished" if results else "unfinished"
    lines.append(f"{len(rounds)} rounds ({status}), wall time {_duration(seconds)}, best round "
                 f"{_best_line(best, score, spec, results is not None)}\n")
    lines += [f"_Note: {_relative(n, root)}._\n" for n in notes]
    lines += [f"_Warning: invalid evaluation, {w}._\n" for w in invalid_evaluations(rounds, results)]
    plots = _write_plots(rounds, root / "plots" / "silos" / silo, spec, best, display)
    return lines + _image_links(plots, root), seconds, (results or {}).get("metric_spec")


def write_report(run_dir: str | Path, display: Mapping[str, str] | None = None) -> Path:
    """Write ``RUN/report.md`` and ``RUN/plots/*.png``; returns the report path.

    Works on unfinished runs (no results.json; a partly written last line of rounds.jsonl is
    skipped with a note) and on finetuning runs whose rounds live only in ``silos/<silo>/``."""
    root = _run_dir(run_dir)
    results = read_results(root)
    if display is None and results and results.get("display"):
        display = results["display"]
    subruns = _subruns(root, results)
    has_rounds = (root / "rounds.jsonl").is_file()
    if not has_rounds and not subruns:
        raise FileNotFoundError(f"rounds log not found: {root / 'rounds.jsonl'}")
    notes: list[str] = []
    rounds = read_rounds(root, notes) if has_rounds else []
    config = _read_config(root)
    spec = (results or {}).get("metric_spec")

    sub_lines, sub_seconds = [], 0.0
    for silo, sub in subruns:
        lines, seconds, sub_spec = _subrun_section(silo, sub, root, spec, display)
        sub_lines += lines
        sub_seconds += seconds
        spec = spec or sub_spec
    if spec is None and (rounds or subruns):
        spec = _registry_spec(config)

    finished = results is not None
    if has_rounds:
        best, score = best_round(rounds, results)
        best_text = _best_line(best, score, spec, finished)
    else:
        best = None
        best_text = "per silo, see below"
    recorded = (results or {}).get("wall_seconds") is not None
    wall = wall_seconds(rounds, results) if has_rounds or recorded else sub_seconds
    task = (results or {}).get("task") or (config.get("task") or {}).get("name") or "unknown"
    paradigm = (results or {}).get("paradigm") or config.get("paradigm") or "unknown"
    total = (results or {}).get("rounds") or (config.get("federation") or {}).get("rounds")
    if has_rounds:
        rounds_text = f"{len(rounds)}" + (f" of {total}" if isinstance(total, int) and total > len(rounds) else "")
    else:
        rounds_text = "per silo, see below"
    name = (results or {}).get("name") or root.name
    out = [
        f"# Run report: {name}\n",
        "## Summary\n",
        f"- Task: {task}",
        f"- Paradigm: {paradigm}",
        f"- Status: {'finished' if finished else 'unfinished (no results.json yet)'}",
        f"- Rounds: {rounds_text}",
        f"- Best round: {best_text}",
        f"- Wall time: {_duration(wall)} ("
        + ("training, dev and test evaluation" if finished else "training and dev evaluation so far") + ")",
        *(f"- Note: {_relative(n, root)}" for n in notes),
        *(f"- Warning: invalid evaluation, {w}" for w in invalid_evaluations(rounds, results)),
        "",
    ]
    totals = exchange_totals(rounds)
    if totals["params_up"] or totals["params_down"]:
        out.insert(-1, f"- Exchanged over the run: {totals['params_up']:,.0f} parameters up "
                       f"({totals['bytes_up'] / MB:.2f} MB), {totals['params_down']:,.0f} down "
                       f"({totals['bytes_down'] / MB:.2f} MB), all clients")
    if results:
        out += ["## Test results\n", table_caption(results), "",
                markdown_table(results_table(results, display)), ""]
        signature = (results.get("metric_spec") or {}).get("signature")
        if signature:
            out += [f"Scorer signature: `{signature}`\n"]
        for name, table_rows in reference_tables(results, display).items():
            out += [f"## Untrained reference: {name}\n", "The same test questions ranked without training.", "",
                    markdown_table(table_rows), ""]
        matrix = matrix_table(results, display)
        if matrix:
            out += ["## Cross-domain matrix\n", MATRIX_NOTE, "", markdown_table(matrix), ""]
    if rounds:
        out += ["## Rounds\n", markdown_table(rounds_table(rounds, spec, display)), "",
                "## Plots\n", *_image_links(_write_plots(rounds, root / "plots", spec, best, display), root)]
    if subruns:
        out += ["## Per-silo runs\n", *sub_lines]
    if (root / "config.toml").is_file():
        out += ["## Config\n", "<details><summary>config.toml</summary>\n", "```toml",
                _text(root / "config.toml").rstrip(), "```", "</details>\n"]
    report = root / "report.md"
    report.write_text("\n".join(out))
    return report
