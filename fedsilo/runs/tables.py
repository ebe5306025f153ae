"""A run's tables as lists of rows of strings (header first), rendered as Markdown or printed with rich."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fedsilo.rundir.records import (MB, column, dev_metric, display_name, invalid_evaluations, metric_columns,
                                    primary_key, primary_label)


AVERAGES_NOTE = "Macro = mean over rows; Pooled = computed from all rows' statistics together."
MODEL_NOTE = ("A silo's cell: the model that silo ends with, on its own test set: the global model under "
              "federated training (with the silo's own tensors where the recipe keeps some per silo), the silo's "
              "model trained alone under finetune, the one pooled model under centralized; the cross-domain "
              "matrix has every model on every domain.")


def format_value(value: Any, fmt: str = ".2f") -> str:
    """`value` in format `fmt`; ``-`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


# --------------------------------------------------------------------- results


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
    for col in metric_columns(results.get("metric_spec"), test):
        key, fmt = col["key"], col["fmt"]
        rows.append([
            col["label"],
            *(format_value((r.get("metrics") or {}).get(key), fmt) for r in test["rows"]),
            format_value((test.get("macro") or {}).get(key), fmt),
            format_value((test.get("pooled") or {}).get(key), fmt),
        ])
    return rows


def table_caption(results: Mapping[str, Any]) -> str:
    """What the results table's rows and columns are: the spec's description, the averages, and
    the metrics with no macro average."""
    spec = results.get("metric_spec") or {}
    parts = [spec.get("description") or "One column per evaluated (client, task) row."]
    parts.append(MODEL_NOTE)
    parts.append(AVERAGES_NOTE)
    no_macro = [c["label"] for c in metric_columns(spec) if not c.get("in_macro", True)]
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
        key = primary_key(spec) or metric_columns(spec, test)[0]["key"]
        fmt = (column(spec, key) or {}).get("fmt", ".2f")
        by_key = {(r["client"], r.get("task")): (r.get("metrics") or {}).get(key) for r in test["rows"]}
        table.append([
            name if shared else f"{name} ({primary_label(spec)})",
            *(format_value(by_key.get(k), fmt) for k in keys),
            format_value((test.get("macro") or {}).get(key), fmt),
            format_value((test.get("pooled") or {}).get(key), fmt),
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
    key = primary_key(spec) or "score"
    fmt = (column(spec, key) or {}).get("fmt", ".2f")
    domains = list(dict.fromkeys(r["client"] for summary in models.values() for r in summary.get("rows", [])))
    table = [[f"model \\ test ({primary_label(spec)})", *(display_name(d, display) for d in domains), "Mean"]]
    for name, summary in models.items():
        by_domain = {r["client"]: (r.get("metrics") or {}).get(key) for r in summary.get("rows", [])}
        label = "global" if name == "global" else display_name(name, display)
        table.append([label, *(format_value(by_domain.get(d), fmt) for d in domains),
                      format_value((summary.get("macro") or {}).get(key), fmt)])
    return table


MATRIX_NOTE = ("Every model on every domain's test set (the translation paper's Tables 2-7 have this "
               "shape): the global model, then each client's own model where clients keep tensors of "
               "their own, or (finetune) each domain's model trained alone.")


def rounds_table(
    rounds: Sequence[Mapping[str, Any]], spec: Mapping[str, Any] | None = None,
    display: Mapping[str, str] | None = None,
) -> list[list[str]]:
    """Per-round rows (header first): round, training and dev evaluation seconds, weighting,
    fallback, rejected and missing clients, the dev selection score (labelled with the primary
    metric's label), the pooled dev loss and MB up/down."""
    selection = (spec or {}).get("selection", "pooled")
    score_fmt = (column(spec, primary_key(spec)) or {}).get("fmt", ".2f")
    loss_fmt = (column(spec, "loss") or {}).get("fmt", ".3f")
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
            format_value(r.get("eval_seconds"), ".1f"),
            str(r.get("weighting") or "-"),
            "yes" if r.get("fallback") else "no",
            ", ".join(rejected) or "-",
            ", ".join(missing) or "-",
            format_value(dev.get("score"), score_fmt),
            format_value(dev_metric(dev, "pooled", "loss"), loss_fmt),
            f"{(r.get('bytes_up') or 0) / MB:.2f}",
            f"{(r.get('bytes_down') or 0) / MB:.2f}",
        ])
    return rows


# ------------------------------------------------------------------- rendering


def _numeric(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return cell == "-"
    return True


def privacy_table(privacy: Mapping[str, Mapping], display: Mapping[str, str] | None = None) -> list[list[str]]:
    """One row per DP silo: its accountant after its last trained round."""
    rows = [["silo", "ε", "δ", "target ε", "σ", "q", "steps", "last round"]]
    for silo, p in privacy.items():
        target = p.get("target_epsilon")
        rows.append([display_name(silo, display), f"{p['epsilon']:.2f}", f"{p['delta']:.3g}",
                     "-" if target is None else f"{target:g}", f"{p['noise_multiplier']:.3f}",
                     f"{p['sample_rate']:.3g}", f"{int(p['steps'])}", str(p["round"])])
    return rows


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
        print_grid(console, f"untrained reference: {name} (test)", table_rows)
    matrix = matrix_table(results, display)
    if matrix:
        print_grid(console, "cross-domain matrix (test)", matrix)


def print_grid(console: Console, title: str, rows: list[list[str]]) -> None:
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
