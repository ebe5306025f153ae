"""Turn a run directory into tables, plots and a Markdown report.

A run directory holds ``rounds.jsonl`` (one JSON object per round), an optional
``results.json`` (written when the run finishes) and, for the finetuning
paradigm, subruns under ``silos/<silo>/`` that are run directories themselves.

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas
directly rather than through pyplot, so importing this module never switches
the caller's backend and no figure stays registered in pyplot's global state.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table

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


def display_name(silo: str, display: Mapping[str, str] | None = None) -> str:
    """Paper-style name of a silo; unknown silos keep their own name."""
    names = DISPLAY_NAMES if display is None else display
    return names.get(silo, silo)


def _run_dir(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory not found: {path}")
    return path


def read_rounds(run_dir: str | Path) -> list[dict]:
    """Parse ``rounds.jsonl``; a bad line names file and line so a crashed
    writer's truncated tail is easy to locate."""
    path = _run_dir(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"rounds log not found: {path}")
    rounds = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        rounds.append(record)
    return rounds


def read_results(run_dir: str | Path) -> dict | None:
    """``results.json`` if the run has finished, else ``None``."""
    path = _run_dir(run_dir) / "results.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: malformed JSON ({err})") from err


# ---------------------------------------------------------------------- tables


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _averages(test: dict) -> tuple[float | None, float | None]:
    """Macro/micro EM as recorded; recomputed from per-silo counts only when
    the results file predates those fields."""
    per_silo = test.get("per_silo", {})
    macro, micro = test.get("macro"), test.get("micro")
    if macro is None and per_silo:
        macro = sum(s["em"] for s in per_silo.values()) / len(per_silo)
    total = sum(s.get("n", 0) for s in per_silo.values())
    if micro is None and total:
        micro = 100.0 * sum(s.get("correct", 0) for s in per_silo.values()) / total
    return macro, micro


def _header(silos: list[str], display: Mapping[str, str] | None) -> list[str]:
    return ["", *(display_name(s, display) for s in silos), "MacroAvg", "MicroAvg"]


def results_table(results: dict, display: Mapping[str, str] | None = None) -> list[list[str]]:
    """Test scores as rows of strings (header first): an EM row, plus an Exec
    row when any silo reports execution accuracy (the paper's Table 2 layout)."""
    test = results["test"]
    per_silo = test["per_silo"]
    silos = list(per_silo)
    macro, micro = _averages(test)
    rows = [
        _header(silos, display),
        ["EM", *(_num(per_silo[s]["em"]) for s in silos), _num(macro), _num(micro)],
    ]
    if any(per_silo[s].get("exec") is not None for s in silos):
        rows.append(["Exec", *(_num(per_silo[s].get("exec")) for s in silos), "-", "-"])
    if all(per_silo[s].get("loss") is not None for s in silos):
        rows.append(["Loss", *(f"{per_silo[s]['loss']:.3f}" for s in silos), "-", "-"])
    return rows


def combine_tables(
    named_results: Mapping[str, dict], display: Mapping[str, str] | None = None
) -> list[list[str]]:
    """One EM row per run, to compare methods side by side; silos missing
    from a run show as ``-``."""
    silos: list[str] = []
    for results in named_results.values():
        silos += [s for s in results["test"]["per_silo"] if s not in silos]
    rows = [_header(silos, display)]
    for name, results in named_results.items():
        per_silo = results["test"]["per_silo"]
        macro, micro = _averages(results["test"])
        ems = (_num(per_silo[s]["em"]) if s in per_silo else "-" for s in silos)
        rows.append([name, *ems, _num(macro), _num(micro)])
    return rows


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
    results: dict, console: Console | None = None, display: Mapping[str, str] | None = None
) -> None:
    """Show the results table in the terminal with rich."""
    header, *body = results_table(results, display)
    table = Table(title=results.get("name"))
    table.add_column(header[0], style="bold")
    for col in header[1:]:
        table.add_column(col, justify="right", no_wrap=True)
    for row in body:
        table.add_row(*row)
    # A table is read whole: never squeeze it into a narrow or non-terminal default width.
    (console or Console(width=max(Console().width, 160))).print(table)


# ----------------------------------------------------------------------- plots


def _clients(rounds: list[dict]) -> list[str]:
    """Clients in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rounds:
        seen.update(dict.fromkeys(r.get("clients", {})))
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


def _loss_curve(rounds: list[dict], client: str) -> tuple[list, list, list]:
    """A client's concatenated loss curve and the step at which each of its
    rounds ended (cumulative ``steps``), for the boundary marks."""
    steps, losses, ends, done = [], [], [], 0
    for r in rounds:
        c = r.get("clients", {}).get(client)
        if c is None:
            continue
        for step, loss in c.get("losses", []):
            steps.append(step)
            losses.append(loss)
        done += c.get("steps", 0)
        ends.append(done)
    return steps, losses, ends[:-1]


def plot_losses(
    rounds: list[dict], path: str | Path, display: Mapping[str, str] | None = None
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


def _fallback_rounds(rounds: list[dict]) -> list[int]:
    return [r["round"] for r in rounds if r.get("fallback")]


def plot_weights(
    rounds: list[dict], path: str | Path, display: Mapping[str, str] | None = None
) -> Figure:
    """Aggregation weight of each client per round; gaps where a client was not
    aggregated, shading where the weighting fell back to its default."""
    clients = _clients(rounds)
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    xs = [r["round"] for r in rounds]
    for client in clients:
        ys = [_weight(r, client) for r in rounds]
        ax.plot(xs, ys, marker="o", label=display_name(client, display))
    for i, rnd in enumerate(_fallback_rounds(rounds)):
        ax.axvspan(rnd - 0.5, rnd + 0.5, color="tab:red", alpha=0.12, lw=0,
                   label="fallback weighting" if i == 0 else None)
    schemes = sorted({str(r["weighting"]) for r in rounds if r.get("weighting")})
    ax.set_title("Aggregation weights" + (f" ({', '.join(schemes)})" if schemes else ""))
    ax.set_xlabel("round")
    ax.set_ylabel("weight")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _integer_rounds(ax)
    if clients:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _save(fig, path)


def _weight(record: dict, client: str) -> float:
    weight = record.get("clients", {}).get(client, {}).get("weight")
    return math.nan if weight is None else weight


def _integer_rounds(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _dev_rounds(rounds: list[dict]) -> list[dict]:
    return [r for r in rounds if r.get("dev")]


def plot_dev(rounds: list[dict], path: str | Path) -> Figure:
    """Dev score per evaluated round (macro/micro too when logged), with the
    best round marked since that checkpoint is the one tested."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    evaluated = _dev_rounds(rounds)
    if not evaluated:
        _empty(fig, "Dev score", "no evaluated rounds yet")
        return _save(fig, path)
    ax = fig.add_subplot()
    xs = [r["round"] for r in evaluated]
    # score is drawn last and thickest: it often equals micro and must stay visible.
    for key, style, lw in (("macro", "--", 1.2), ("micro", ":", 1.5), ("score", "-o", 2.2)):
        ys = [r["dev"].get(key) for r in evaluated]
        if any(y is not None for y in ys):
            ax.plot(xs, [math.nan if y is None else y for y in ys], style, lw=lw, label=key)
    best = max(evaluated, key=lambda r: r["dev"]["score"])
    ax.plot([best["round"]], [best["dev"]["score"]], "*", ms=14, color="tab:red",
            label=f"best (round {best['round']})")
    ax.set_title("Dev score per round")
    ax.set_xlabel("round")
    ax.set_ylabel("dev score")
    ax.grid(alpha=0.3)
    _integer_rounds(ax)
    handles, labels = ax.get_legend_handles_labels()
    losses = [r["dev"].get("loss") for r in evaluated]
    if any(v is not None for v in losses):  # graded signal while exact match is still flat
        twin = ax.twinx()
        twin.plot(xs, [math.nan if v is None else v for v in losses], "-s", color="tab:gray", lw=1.2,
                  label="dev loss")
        twin.set_ylabel("dev loss (token cross-entropy)")
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels)
    return _save(fig, path)


def plot_bytes(rounds: list[dict], path: str | Path) -> Figure:
    """Total communication per round in MB, uplink and downlink side by side."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    xs = [r["round"] for r in rounds]
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [r.get("bytes_up", 0) / MB for r in rounds],
           width, label="up (clients → server)")
    ax.bar([x + width / 2 for x in xs], [r.get("bytes_down", 0) / MB for r in rounds],
           width, label="down (server → clients)")
    ax.set_title("Communication per round")
    ax.set_xlabel("round")
    ax.set_ylabel("MB (10⁶ bytes)")
    ax.grid(alpha=0.3, axis="y")
    _integer_rounds(ax)
    fig.legend(loc="outside lower center", ncols=2)
    return _save(fig, path)


# ---------------------------------------------------------------------- report


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _best(rounds: list[dict], results: dict | None) -> tuple[object, object]:
    """Best round and dev score: recorded in results.json once finished,
    otherwise the best evaluated round so far."""
    if results and "best_round" in results:
        return results["best_round"], results.get("best_dev")
    evaluated = _dev_rounds(rounds)
    if not evaluated:
        return None, None
    best = max(evaluated, key=lambda r: r["dev"]["score"])
    return best["round"], best["dev"]["score"]


def rounds_table(rounds: list[dict]) -> list[list[str]]:
    """Per-round summary rows (header first) for the report."""
    rows = [["Round", "Seconds", "Weighting", "Fallback", "Dev score", "Dev loss", "MB up", "MB down"]]
    for r in rounds:
        dev = r.get("dev") or {}
        rows.append([
            str(r["round"]),
            f"{r.get('seconds', 0):.1f}",
            str(r.get("weighting") or "-"),
            "yes" if r.get("fallback") else "no",
            _num(dev.get("score")),
            "-" if dev.get("loss") is None else f"{dev['loss']:.3f}",
            f"{r.get('bytes_up', 0) / MB:.2f}",
            f"{r.get('bytes_down', 0) / MB:.2f}",
        ])
    return rows


def _write_plots(rounds: list[dict], plot_dir: Path, display) -> list[tuple[str, Path]]:
    """Plots that have data to show, as (caption, path) pairs."""
    plots = []
    if any(c.get("losses") for r in rounds for c in r.get("clients", {}).values()):
        plot_losses(rounds, plot_dir / "losses.png", display)
        plots.append(("Training loss", plot_dir / "losses.png"))
    if any(not math.isnan(_weight(r, c)) for r in rounds for c in r.get("clients", {})):
        plot_weights(rounds, plot_dir / "weights.png", display)
        plots.append(("Aggregation weights", plot_dir / "weights.png"))
    if _dev_rounds(rounds):
        plot_dev(rounds, plot_dir / "dev.png")
        plots.append(("Dev score", plot_dir / "dev.png"))
    if any(r.get("bytes_up") or r.get("bytes_down") for r in rounds):
        plot_bytes(rounds, plot_dir / "bytes.png")
        plots.append(("Communication", plot_dir / "bytes.png"))
    return plots


def _image_links(plots: list[tuple[str, Path]], root: Path) -> list[str]:
    return [f"![{caption}]({path.relative_to(root).as_posix()})\n" for caption, path in plots]


def _subruns(run_dir: Path) -> list[Path]:
    silos = run_dir / "silos"
    return sorted(p for p in silos.iterdir() if p.is_dir()) if silos.is_dir() else []


def _subrun_section(sub: Path, root: Path, display) -> tuple[list[str], float]:
    """Markdown for one per-silo subrun and its wall time."""
    lines = [f"### {display_name(sub.name, display)}\n"]
    if not (sub / "rounds.jsonl").is_file():
        return lines + ["_No rounds.jsonl yet._\n"], 0.0
    rounds = read_rounds(sub)
    seconds = sum(r.get("seconds", 0) for r in rounds)
    best_round, best_dev = _best(rounds, read_results(sub))
    lines.append(f"{len(rounds)} rounds, {_duration(seconds)}, best round {best_round}"
                 f" (dev {_num(best_dev)})\n")
    plots = _write_plots(rounds, root / "plots" / "silos" / sub.name, display)
    return lines + _image_links(plots, root), seconds


def write_report(run_dir: str | Path, display: Mapping[str, str] | None = None) -> Path:
    """Write ``RUN/report.md`` and ``RUN/plots/*.png``; returns the report path.

    Works on unfinished runs (no results.json) and on finetuning runs whose
    rounds live only in ``silos/<silo>/`` subruns."""
    root = _run_dir(run_dir)
    subruns = _subruns(root)
    has_rounds = (root / "rounds.jsonl").is_file()
    if not has_rounds and not subruns:
        raise FileNotFoundError(f"rounds log not found: {root / 'rounds.jsonl'}")
    rounds = read_rounds(root) if has_rounds else []
    results = read_results(root)

    sub_lines, sub_seconds = [], 0.0
    for sub in subruns:
        lines, seconds = _subrun_section(sub, root, display)
        sub_lines += lines
        sub_seconds += seconds

    best_round, best_dev = _best(rounds, results)
    wall = sum(r.get("seconds", 0) for r in rounds) + sub_seconds
    name = (results or {}).get("name") or root.name
    out = [
        f"# Run report: {name}\n",
        "## Summary\n",
        f"- Paradigm: {(results or {}).get('paradigm', 'unknown')}",
        f"- Status: {'finished' if results else 'unfinished (no results.json yet)'}",
        f"- Rounds: {len(rounds) if has_rounds else 'per silo, see below'}",
        f"- Best round: {best_round if best_round is not None else '-'}"
        f" (dev {_num(best_dev)})",
        f"- Wall time: {_duration(wall)}\n",
    ]
    if results:
        out += ["## Test results (EM)\n", markdown_table(results_table(results, display)), ""]
    if rounds:
        out += ["## Rounds\n", markdown_table(rounds_table(rounds)), "",
                "## Plots\n", *_image_links(_write_plots(rounds, root / "plots", display), root)]
    if subruns:
        out += ["## Per-silo runs\n", *sub_lines]
    if (root / "config.toml").is_file():
        out += ["## Config\n", "<details><summary>config.toml</summary>\n", "```toml",
                (root / "config.toml").read_text().rstrip(), "```", "</details>\n"]
    report = root / "report.md"
    report.write_text("\n".join(out))
    return report
