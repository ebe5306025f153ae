"""A run's matplotlib figures: training loss, aggregation weights, dev metric and communication per round.

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas
directly rather than through pyplot, so importing this module never switches
the caller's backend and no figure stays registered in pyplot's global state.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedsilo.rundir.records import MB, best_round, column, dev_metric, display_name, primary_key, primary_label


def _nonnegative(label: str, values: Sequence[float | None]) -> tuple[bool, bool]:
    """(a percentage, cannot be negative): percentages by their label, others when every value is >= 0."""
    percent = "%" in label
    seen = [v for v in values if v is not None and not math.isnan(v)]
    return percent, percent or all(v >= 0 for v in seen)


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


def client_weight(record: Mapping[str, Any], client: str) -> float:
    """A client's aggregation weight in a round record; NaN where it has none."""
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
        ax.plot(xs, [client_weight(r, client) for r in rounds], marker="o", label=display_name(client, display))
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
    key, label = primary_key(spec), primary_label(spec)
    selection = (spec or {}).get("selection", "pooled")
    ax = fig.add_subplot()
    xs = [r["round"] for r in evaluated]
    shown: list[float | None] = []
    # Pooled solid underneath, macro dashed with hollow squares over it: both stay visible where equal.
    for part, style in (("pooled", dict(color="tab:blue", ls="-", marker="o", ms=5, lw=2.0, zorder=3)),
                        ("macro", dict(color="tab:orange", ls="--", marker="s", ms=8, mfc="none", mew=1.5,
                                       lw=1.5, zorder=4))):
        ys = [dev_metric(r["dev"], part, key) for r in evaluated]
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
    losses = [dev_metric(r["dev"], "pooled", "loss") for r in evaluated]
    if any(v is not None for v in losses):  # a graded signal while the primary metric is still flat
        twin = ax.twinx()
        twin.plot(xs, _nan(losses), color="tab:gray", ls=":", marker="x", ms=6, lw=1.2, label="dev loss (pooled)")
        loss_col = column(spec, "loss")
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
