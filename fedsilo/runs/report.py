"""Write a run directory's Markdown report, ``RUN/report.md``, with its plots under ``RUN/plots/``.

Works for any task and paradigm; importing this module imports neither torch nor the task code.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsilo.rundir.answers import read_answers
from fedsilo.rundir.records import (MB, best_round, column, display_name, exchange_totals, invalid_evaluations,
                                    primary_key, primary_label, privacy_spent, read_config, read_results, read_rounds,
                                    read_text, refused_for_good, registry_spec, run_directory, wall_seconds)

from .plots import client_weight, plot_bytes, plot_dev, plot_losses, plot_weights
from .tables import (MATRIX_NOTE, format_value, markdown_table, matrix_table, privacy_table, reference_tables,
                     results_table, rounds_table, table_caption)


PRIVACY_NOTE = ("Record-level DP-SGD inside each silo: (ε, δ) from the silo's own RDP accountant over every "
                "step it trained (σ the noise multiplier, q the Poisson sampling rate), as the silo reported it "
                "after its last trained round; docs/privacy.md says what it covers.")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _write_plots(rounds, plot_dir: Path, spec, best, display) -> list[tuple[str, Path]]:
    """Plots that have data to show, as (caption, path) pairs."""
    plots = []
    if any(c.get("losses") for r in rounds for c in (r.get("clients") or {}).values()):
        plot_losses(rounds, plot_dir / "losses.png", display)
        plots.append(("Training loss", plot_dir / "losses.png"))
    if any(not math.isnan(client_weight(r, c)) for r in rounds for c in r.get("clients") or {}):
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
    fmt = (column(spec, primary_key(spec)) or {}).get("fmt", ".2f")
    text = f"{best} (dev {primary_label(spec)} {format_value(score, fmt)})"
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


SHOWN_ANSWERS = 3  # per silo in report.md; every one is in answers/test.jsonl


def answers_section(root: Path, display: Mapping[str, str] | None) -> list[str]:
    """What the model answered on test (fedsilo.rundir.answers), the first few per silo, beside the gold."""
    try:
        answers = read_answers(root)
    except ValueError as err:
        return ["## Answers (test)\n", f"Not shown: {err}", ""]
    if not answers:
        return []
    out = ["## Answers (test)\n", f"Every test item's answer is in `answers/test.jsonl` ({len(answers):,} lines); "
           f"the first {SHOWN_ANSWERS} of each silo:", ""]
    by_silo: dict[str, list[dict]] = {}
    for answer in answers:
        by_silo.setdefault(answer["client"], []).append(answer)
    for silo, kept in by_silo.items():
        hits = [a.get("right") is True for a in kept]
        right = sum(1 for h in hits if h)
        out += [f"**{display_name(silo, display)}**: {right} of {len(kept)} right", "",
                markdown_table([["prompt (its end)", "gold", "answer", "right"]] +
                               [[_cell(a.get("prompt", ""), tail=True), _cell(str(a.get("gold"))),
                                 _cell(str(a.get("generated", a.get("chosen", "")))), "yes" if h else "no"]
                                for a, h in zip(kept[:SHOWN_ANSWERS], hits)]), ""]
    return out


def _cell(text: str, width: int = 160, tail: bool = False) -> str:
    """One table cell: one line, pipes escaped, cut to `width` characters (its end when `tail`)."""
    flat = " ".join(text.split()).replace("|", "\\|")
    if len(flat) <= width:
        return flat
    return "…" + flat[-width:] if tail else flat[:width] + "…"


def write_report(run_dir: str | Path, display: Mapping[str, str] | None = None) -> Path:
    """Write ``RUN/report.md`` and ``RUN/plots/*.png``; returns the report path.

    Works on unfinished runs (no results.json; a partly written last line of rounds.jsonl is
    skipped with a note) and on finetuning runs whose rounds live only in ``silos/<silo>/``."""
    root = run_directory(run_dir)
    results = read_results(root)
    if display is None and results and results.get("display"):
        display = results["display"]
    subruns = _subruns(root, results)
    has_rounds = os.path.lexists(root / "rounds.jsonl")  # a FIFO there is named by read_rounds, not missed
    trained = not results or results.get("rounds") != 0  # a zero-shot run has results and no rounds
    if not has_rounds and not subruns and trained:
        raise FileNotFoundError(f"rounds log not found: {root / 'rounds.jsonl'}")
    notes: list[str] = []
    rounds = read_rounds(root, notes) if has_rounds else []
    config = read_config(root)
    spec = (results or {}).get("metric_spec")

    sub_lines, sub_seconds = [], 0.0
    for silo, sub in subruns:
        lines, seconds, sub_spec = _subrun_section(silo, sub, root, spec, display)
        sub_lines += lines
        sub_seconds += seconds
        spec = spec or sub_spec
    if spec is None and (rounds or subruns):
        spec = registry_spec(config)

    finished = results is not None
    if has_rounds:
        best, score = best_round(rounds, results)
        best_text = _best_line(best, score, spec, finished)
    else:
        best = None
        best_text = "per silo, see below" if trained else "none: the starting model, untrained"
    recorded = (results or {}).get("wall_seconds") is not None
    wall = wall_seconds(rounds, results) if has_rounds or recorded else sub_seconds
    task = (results or {}).get("task") or (config.get("task") or {}).get("name") or "unknown"
    paradigm = (results or {}).get("paradigm") or config.get("paradigm") or "unknown"
    total = (results or {}).get("rounds") or (config.get("federation") or {}).get("rounds")
    if has_rounds:
        rounds_text = f"{len(rounds)}" + (f" of {total}" if isinstance(total, int) and total > len(rounds) else "")
    else:
        rounds_text = "per silo, see below" if trained else "0 (paradigm trains nothing)"
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
    out += answers_section(root, display)
    silo_level = [r["silo_dp"] for r in rounds if r.get("silo_dp")]
    if silo_level:
        last = silo_level[-1]
        out += ["## Silo-level privacy\n",
                f"Each silo is one user: after {len(silo_level)} round(s) the global model is (ε = {last['epsilon']:.2f}, "
                f"δ = {last['delta']:.3g})-DP with respect to any one silo's whole contribution ({last['mode']} noise, "
                f"σ = {last['noise_multiplier']:.3f}, updates clipped to C = {last['clip']:g}; docs/privacy.md).", ""]
    privacy = privacy_spent(rounds)
    if privacy:
        out += ["## Privacy\n", PRIVACY_NOTE, "", markdown_table(privacy_table(privacy, display)), ""]
        out += [f"- Refused for good: {display_name(c, display)} (round {r}): {why}"
                for c, (r, why) in refused_for_good(rounds).items()]
        if results and results.get("stopped"):
            out += [f"- The run stopped early: {results['stopped']}"]
        out += [""]
    if rounds:
        out += ["## Rounds\n", markdown_table(rounds_table(rounds, spec, display)), "",
                "## Plots\n", *_image_links(_write_plots(rounds, root / "plots", spec, best, display), root)]
    if subruns:
        out += ["## Per-silo runs\n", *sub_lines]
    if (root / "config.toml").is_file():
        out += ["## Config\n", "<details><summary>config.toml</summary>\n", "```toml",
                read_text(root / "config.toml").rstrip(), "```", "</details>\n"]
    report = root / "report.md"
    report.write_text("\n".join(out))
    return report
