"""Run reports: tables, plots and report.md built from synthetic run dirs of the new schema.

Summaries are made by a real MetricSpec (``summarize``), as the runner makes them; expected table
cells are computed by hand from the statistics, so a wrong column, format or average shows.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from rich.console import Console

from fedsilo.rundir import records
from fedsilo.runs import plots, report, tables
from fedsilo.tasks.base import Column, MetricSpec, select_best

CLIENTS = ["advising", "geography", "yelp"]
STEPS = {"advising": 25, "geography": 10, "yelp": 40}


def _pct(num, den):
    return 100.0 * num / den if den else None


def _text2sql_like(stats):
    return {"em": _pct(stats.get("correct", 0), stats.get("n")),
            "exec": _pct(stats.get("exec_correct", 0), stats.get("exec_n")),
            "loss": stats["loss_sum"] / stats["loss_n"] if stats.get("loss_n") else None,
            "fit": _pct(stats.get("fit", 0), stats.get("n"))}


DESCRIPTION = "One row per text-to-SQL silo: EM and Exec are % of its examples, loss is token CE."
SPEC = MetricSpec(
    columns=(Column("em", "EM %"), Column("exec", "Exec %", in_macro=False),
             Column("loss", "test loss (token CE)", fmt=".3f"), Column("fit", "targets within max length %")),
    compute=_text2sql_like, primary="em", tie_break="loss", selection="pooled", description=DESCRIPTION)
SPEC_DESC = json.loads(json.dumps(SPEC.describe()))

TEST_ROWS = [
    {"client": "advising", "task": "text2sql",
     "stats": {"n": 50, "correct": 5, "loss_sum": 60.0, "loss_n": 40, "fit": 45}},
    {"client": "geography", "task": "text2sql",
     "stats": {"n": 10, "correct": 2, "exec_correct": 3, "exec_n": 10, "loss_sum": 25.0, "loss_n": 10, "fit": 10}},
    {"client": "yelp", "task": "text2sql", "stats": {"n": 3, "correct": 1, "loss_sum": 3.0, "loss_n": 4, "fit": 3}},
]
RESULTS = json.loads(json.dumps({
    "name": "fedopt-lorar", "paradigm": "federated", "task": "text2sql", "rounds": 3,
    "best_round": 3, "best_dev": 30.0, "wall_seconds": 125.0, "metric_spec": SPEC.describe(),
    "test": SPEC.summarize(TEST_ROWS),
}))


def _dev(correct, loss):
    """A dev summary: ten examples per client, `correct` of them right, mean token loss `loss`."""
    rows = [{"client": c, "task": "text2sql",
             "stats": {"n": 10, "correct": k, "loss_sum": 10.0 * loss, "loss_n": 10, "fit": 10}}
            for c, k in zip(CLIENTS, correct)]
    return json.loads(json.dumps(SPEC.summarize(rows)))


def _round(rnd, *, dev=True, fallback=False, eval_seconds=5.0, differ=False, rejected=(), missing=()):
    clients = {}
    for i, name in enumerate(CLIENTS):
        done = STEPS[name] * (rnd - 1)
        clients[name] = {
            "n_examples": 100 + i, "steps": STEPS[name],
            "losses": [[done + k, 3.0 - 0.3 * rnd - 0.01 * k] for k in (1, STEPS[name] // 2, STEPS[name])],
            "terms": {"ce": 2.0}, "delta_loss": 0.5, "mean_loss": 2.0,
            "weight": None if (rnd == 2 and i == 0) else (i + 1) / 6,
            "bytes_up": 1000 * (i + 1 if differ else 1), "bytes_down": 2000, "seconds": 3.0,
            **({"rejected": "NaN in update"} if name in rejected else {}),
        }
    record = {
        "round": rnd, "seconds": 10.0 * rnd, "sampled": CLIENTS, "weighting": "lorar",
        "fallback": fallback, "bytes_up": 3_000_000, "bytes_down": 6_000_000,
        "clients": clients, "missing": list(missing),
        "dev": _dev((rnd, rnd, rnd), 3.0 / rnd) if dev else None,
    }
    if dev:
        record["eval_seconds"] = eval_seconds
    return record


def _rounds():
    return [_round(1, dev=False), _round(2, fallback=True), _round(3)]


def _write_run(path, *, results=None, rounds=None, tail="", config='paradigm = "federated"\n'):
    path.mkdir(parents=True)
    rounds = rounds if rounds is not None else _rounds()
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds) + tail)
    (path / "config.toml").write_text(config)
    if results is not None:
        (path / "results.json").write_text(json.dumps(results))
    return path


def _linked_images(md):
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def _assert_png(path):
    assert path.stat().st_size > 0
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def _visible_ticks(ax):
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


# ---------------------------------------------------------------- read_rounds


def test_read_rounds_roundtrip_and_skips_blank_lines(tmp_path):
    run = _write_run(tmp_path / "run", tail="\n")
    assert [r["round"] for r in records.read_rounds(run)] == [1, 2, 3]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    run = _write_run(tmp_path / "run")
    lines = (run / "rounds.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]
    (run / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rounds\.jsonl:2\b"):
        records.read_rounds(run)
    with pytest.raises(ValueError, match=r"rounds\.jsonl:2\b"):
        report.write_report(run)


def test_complete_bad_last_line_is_corruption_not_a_crash_remnant(tmp_path):
    # A newline after it: the writer finished the line, so it is not what a crash leaves.
    run = _write_run(tmp_path / "run", tail='{"round": 4, "cli\n')
    with pytest.raises(ValueError, match=r"rounds\.jsonl:4\b"):
        records.read_rounds(run)


def test_non_object_or_roundless_line_is_rejected(tmp_path):
    run = _write_run(tmp_path / "run", tail="[1, 2]\n")
    with pytest.raises(ValueError, match=r"rounds\.jsonl:4\b.*object"):
        records.read_rounds(run)
    run = _write_run(tmp_path / "run2", tail='{"seconds": 1.0}\n')
    with pytest.raises(ValueError, match=r"rounds\.jsonl:4\b.*round"):
        records.read_rounds(run)


def test_partial_last_line_is_skipped_with_a_note(tmp_path):
    partial = json.dumps(_round(4))[:120]  # the crash cut the write short: no newline after it
    run = _write_run(tmp_path / "run", tail=partial)
    notes = []
    assert [r["round"] for r in records.read_rounds(run, notes)] == [1, 2, 3]
    assert len(notes) == 1 and "rounds.jsonl:4" in notes[0] and "partly written" in notes[0]
    md = report.write_report(run).read_text()
    assert "- Note: rounds.jsonl:4: partly written last line" in md
    assert str(tmp_path) not in md.split("## Config")[0]  # the note names the file within the run
    assert [l.split(" | ")[0] for l in md.splitlines() if re.match(r"\| \d+ \|", l)] == ["| 1", "| 2", "| 3"]


def test_malformed_results_names_file_and_line(tmp_path):
    run = _write_run(tmp_path / "run")
    (run / "results.json").write_text('{"name": "x",\n "test": oops}')
    with pytest.raises(ValueError, match=r"results\.json:2\b"):
        records.read_results(run)
    with pytest.raises(ValueError, match=r"results\.json:2\b"):
        report.write_report(run)


def test_missing_run_dir_or_rounds_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        records.read_rounds(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        report.write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="rounds.jsonl"):
        report.write_report(tmp_path / "empty")


# --------------------------------------------------------------------- tables


def test_results_table_cells_are_the_summary_values_in_column_formats():
    header, em, exec_, loss, fit = tables.results_table(RESULTS)
    assert header == ["", "Advising", "GeoQuery", "Yelp", "Macro", "Pooled"]
    # By hand: EM 5/50, 2/10, 1/3; macro the mean of the three; pooled 8/63.
    assert em == ["EM %", "10.00", "20.00", "33.33", "21.11", "12.70"]
    # Exec: only GeoQuery has a database; no macro (in_macro=False); pooled from its counts alone.
    assert exec_ == ["Exec %", "-", "30.00", "-", "-", "30.00"]
    # Loss in its own format: 60/40, 25/10, 3/4; macro 4.75/3; pooled 88/54.
    assert loss == ["test loss (token CE)", "1.500", "2.500", "0.750", "1.583", "1.630"]
    assert fit == ["targets within max length %", "90.00", "100.00", "100.00", "96.67", "92.06"]
    # And the same cells straight from the summary, through each column's format.
    test = RESULTS["test"]
    for line, col in zip((em, exec_, loss, fit), SPEC.columns):
        values = [r["metrics"][col.key] for r in test["rows"]] + [test["macro"][col.key], test["pooled"][col.key]]
        assert line[1:] == ["-" if v is None else format(v, col.fmt) for v in values]


def test_caption_says_what_rows_and_columns_are():
    caption = tables.table_caption(RESULTS)
    assert caption.startswith(DESCRIPTION)
    assert "Macro = mean over rows; Pooled = computed from all rows' statistics together" in caption
    assert "No macro average for Exec %" in caption


def test_results_table_display_override_and_unknown_client():
    rows = [{"client": "advising", "task": "text2sql", "stats": {"n": 1, "correct": 1}},
            {"client": "newsilo", "task": "text2sql", "stats": {"n": 3, "correct": 1}}]
    results = {"task": "text2sql", "metric_spec": SPEC_DESC, "test": json.loads(json.dumps(SPEC.summarize(rows)))}
    header, em, *_ = tables.results_table(results, display={"advising": "ADV"})
    assert header == ["", "ADV", "newsilo", "Macro", "Pooled"]
    assert em == ["EM %", "100.00", "33.33", "66.67", "50.00"]


def _multitask():
    def compute(stats):
        return {"bleu": stats["b_sum"] / stats["b_n"] if stats.get("b_n") else None,
                "map": _pct(stats.get("ap_sum", 0), stats.get("q"))}
    spec = MetricSpec(columns=(Column("bleu", "BLEU", fmt=".1f"), Column("map", "MAP %")), compute=compute,
                      primary="map", tie_break=None, description="One row per (client, task) pair.")
    rows = [{"client": "alice", "task": "translation", "stats": {"b_sum": 30.0, "b_n": 2}},
            {"client": "alice", "task": "qa", "stats": {"ap_sum": 1.5, "q": 2}},
            {"client": "bob", "task": "qa", "stats": {"ap_sum": 0.5, "q": 2}}]
    return json.loads(json.dumps({"name": "mt", "paradigm": "federated", "task": "multitask",
                                  "metric_spec": spec.describe(), "test": spec.summarize(rows)}))


def test_multitask_rows_are_labelled_client_slash_task():
    results = _multitask()
    header, bleu, map_ = tables.results_table(results)
    assert header == ["", "alice / translation", "alice / qa", "bob / qa", "Macro", "Pooled"]
    assert bleu == ["BLEU", "15.0", "-", "-", "15.0", "15.0"]
    assert map_ == ["MAP %", "-", "75.00", "25.00", "50.00", "50.00"]
    console = Console(record=True, width=200)
    tables.print_results(results, console=console)
    assert "alice / translation" in console.export_text()
    # A single-task run's rows are labelled by client alone.
    assert tables.row_labels(RESULTS) == ["Advising", "GeoQuery", "Yelp"]


def test_markdown_table_shape_and_alignment():
    md = tables.markdown_table(tables.results_table(RESULTS))
    lines = md.splitlines()
    assert len(lines) == 2 + 4  # header, rule, one line per metric column
    for line in lines:
        assert line.startswith("|") and line.endswith("|") and line.count("|") == 6 + 1
    assert lines[1] == "| --- | ---: | ---: | ---: | ---: | ---: |"


def test_combine_tables_compares_runs_on_the_primary_metric():
    other = json.loads(json.dumps({
        "task": "text2sql", "metric_spec": SPEC.describe(),
        "test": SPEC.summarize([{"client": "atis", "task": "text2sql", "stats": {"n": 10, "correct": 5}}])}))
    rows = tables.combine_tables({"lorar": RESULTS, "fedavg": other})
    assert rows[0] == ["EM %", "Advising", "GeoQuery", "Yelp", "ATIS", "Macro", "Pooled"]
    assert rows[1] == ["lorar", "10.00", "20.00", "33.33", "-", "21.11", "12.70"]
    assert rows[2] == ["fedavg", "-", "-", "-", "50.00", "50.00", "50.00"]
    mixed = tables.combine_tables({"lorar": RESULTS, "mt": _multitask()})
    assert mixed[0][0] == "" and mixed[1][0] == "lorar (EM %)" and mixed[2][0] == "mt (MAP %)"
    assert "alice / qa" in mixed[0] and mixed[2][-2:] == ["50.00", "50.00"]


def test_print_results_renders_caption_and_table_with_rich():
    console = Console(record=True, width=160)
    tables.print_results(RESULTS, console=console)
    text = console.export_text()
    assert text.index("Macro = mean over rows") < text.index("GeoQuery")  # said above the table
    assert "EM %" in text and "21.11" in text and "1.630" in text and "Exec %" in text


def test_legacy_results_are_a_clear_error():
    with pytest.raises(ValueError, match="no evaluation rows"):
        tables.results_table({"test": {"per_silo": {"atis": {"em": 1.0}}}})


# ----------------------------------------------------------------- best round


def _tie_rounds():
    """Rounds 2 and 3 tie on pooled EM (10 %); round 3 has the lower dev loss."""
    return [_round(1, dev=False), {**_round(2), "dev": _dev((1, 1, 1), 2.0)},
            {**_round(3), "dev": _dev((0, 1, 2), 1.5)}]


def test_best_round_agrees_with_select_best_on_a_score_tie(tmp_path):
    rounds = _tie_rounds()
    assert rounds[1]["dev"]["key"] == [10.0, -2.0] and rounds[2]["dev"]["key"] == [10.0, -1.5]
    assert rounds[1]["dev"]["score"] == rounds[2]["dev"]["score"] == 10.0
    picked = select_best(records.dev_candidates(rounds))["round"]
    assert picked == 3
    assert records.best_round(rounds) == (3, 10.0)
    run = _write_run(tmp_path / "run", rounds=rounds)
    md = report.write_report(run).read_text()
    assert "- Best round: 3 (dev score 10.00) so far; the run is unfinished" in md
    fig = plots.plot_dev(rounds, tmp_path / "dev.png", SPEC_DESC)
    star = [l for l in fig.axes[0].lines if l.get_label().startswith("best")]
    assert len(star) == 1 and list(star[0].get_xdata()) == [3] and star[0].get_label() == "best (round 3)"


def test_finished_run_best_round_comes_from_results(tmp_path):
    run = _write_run(tmp_path / "run", rounds=_tie_rounds(), results={**RESULTS, "best_round": 2, "best_dev": 10.0})
    md = report.write_report(run).read_text()
    assert "- Best round: 2 (dev EM % 10.00)\n" in md and "unfinished" not in md.split("## Config")[0]


# ---------------------------------------------------------------------- plots


@pytest.mark.parametrize("n_rounds", [1, 7])
def test_dev_plot_floor_at_zero_and_integer_round_ticks(tmp_path, n_rounds):
    # EM flat at 0 (early training): autoscaling alone would show negative percentages.
    rounds = [{**_round(r), "dev": _dev((0, 0, 0), 3.0 - 0.1 * r)} for r in range(1, n_rounds + 1)]
    fig = plots.plot_dev(rounds, tmp_path / "dev.png", SPEC_DESC)
    metric_ax, loss_ax = fig.axes
    assert metric_ax.get_ylim()[0] == 0 and metric_ax.get_ylim()[1] > 0
    assert loss_ax.get_ylim()[0] >= 0 and "dev loss" in loss_ax.get_ylabel()
    assert list(loss_ax.lines[0].get_ydata()) == pytest.approx([3.0 - 0.1 * r for r in range(1, n_rounds + 1)])
    ticks = _visible_ticks(metric_ax)
    assert all(float(t).is_integer() for t in ticks)
    assert sorted(ticks) == list(range(1, n_rounds + 1))
    assert "EM %" in metric_ax.get_ylabel()
    _assert_png(tmp_path / "dev.png")


def test_dev_plot_lines_are_distinguishable(tmp_path):
    fig = plots.plot_dev(_rounds(), tmp_path / "dev.png", SPEC_DESC)
    lines = {l.get_label(): l for l in fig.axes[0].lines}
    macro, pooled = lines["macro EM %"], lines["pooled EM %"]
    score = lines["selection score (pooled EM %)"]
    assert list(pooled.get_xdata()) == [2, 3] and list(pooled.get_ydata()) == [20.0, 30.0]
    assert list(score.get_ydata()) == [20.0, 30.0]  # the score is the pooled EM: drawn over it, hollow
    assert macro.get_color() != pooled.get_color() and macro.get_marker() != pooled.get_marker()
    assert macro.get_linestyle() != pooled.get_linestyle()
    assert score.get_linestyle() == "None" and score.get_markerfacecolor() == "none"
    assert score.get_zorder() > max(macro.get_zorder(), pooled.get_zorder())


def test_plot_dev_without_evaluations(tmp_path):
    plots.plot_dev([_round(1, dev=False)], tmp_path / "d.png")
    _assert_png(tmp_path / "d.png")


def test_plot_losses_one_axes_per_client(tmp_path):
    fig = plots.plot_losses([_round(r) for r in (1, 2, 3)], tmp_path / "losses.png")
    assert [ax.get_title() for ax in fig.axes] == ["Advising", "GeoQuery", "Yelp"]
    xs = fig.axes[2].lines[0].get_xdata()
    assert len(xs) == 9 and max(xs) == 3 * STEPS["yelp"]
    _assert_png(tmp_path / "losses.png")


def test_plot_weights_gap_and_integer_ticks(tmp_path):
    fig = plots.plot_weights(_rounds(), tmp_path / "w.png")
    ax = fig.axes[0]
    assert len(ax.lines) == len(CLIENTS)
    advising = list(ax.lines[0].get_ydata())
    assert advising[0] == pytest.approx(1 / 6) and advising[1] != advising[1]  # NaN: not aggregated
    assert sorted(_visible_ticks(ax)) == [1, 2, 3]
    _assert_png(tmp_path / "w.png")


def test_plot_bytes_adds_a_per_client_row_only_when_clients_differ(tmp_path):
    same = plots.plot_bytes(_rounds(), tmp_path / "same.png")
    assert len(same.axes) == 1
    rounds = [_round(r, differ=True) for r in (1, 2)]
    fig = plots.plot_bytes(rounds, tmp_path / "differ.png")
    total, up, down = fig.axes
    assert [p.get_height() for p in total.patches[:2]] == [3.0, 3.0]  # MB up per round
    assert [l.get_label() for l in up.lines] == ["Advising", "GeoQuery", "Yelp"]
    assert list(up.lines[2].get_ydata()) == [0.003, 0.003] and list(down.lines[2].get_ydata()) == [0.002, 0.002]
    assert sorted(_visible_ticks(up)) == [1, 2]
    _assert_png(tmp_path / "differ.png")


# ------------------------------------------------------------- rounds, time


def test_rounds_table_columns_and_values():
    rounds = [_round(1, dev=False), _round(2, fallback=True, eval_seconds=4.25, rejected=["yelp"],
                                           missing=["geography"])]
    header, one, two = tables.rounds_table(rounds, SPEC_DESC)
    assert header == ["Round", "Train s", "Eval s", "Weighting", "Fallback", "Rejected", "Missing",
                      "Dev EM % (pooled)", "Dev loss", "MB up", "MB down"]
    assert one == ["1", "10.0", "-", "lorar", "no", "-", "-", "-", "-", "3.00", "6.00"]
    assert two == ["2", "20.0", "4.2", "lorar", "yes", "Yelp", "GeoQuery", "20.00", "1.500", "3.00", "6.00"]


def test_wall_time_includes_evaluation(tmp_path):
    rounds = _rounds()  # training 10 + 20 + 30 s, dev evaluation 5 + 5 s
    assert records.wall_seconds(rounds) == 70.0
    assert records.wall_seconds(rounds, RESULTS) == 125.0  # the runner's whole-run clock wins
    unfinished = _write_run(tmp_path / "u")
    assert "- Wall time: 1m 10s (training and dev evaluation so far)" in report.write_report(unfinished).read_text()
    finished = _write_run(tmp_path / "f", results=RESULTS)
    assert "- Wall time: 2m 05s (training, dev and test evaluation)" in report.write_report(finished).read_text()


# --------------------------------------------------------------------- report


def test_write_report_unfinished_run(tmp_path):
    run = _write_run(tmp_path / "run")
    md_path = report.write_report(run)
    assert md_path == run / "report.md"
    md = md_path.read_text()
    assert "unfinished" in md and "Test results" not in md
    # No results.json and no task in config.toml: generic labels, best round by select_best.
    assert "- Best round: 3 (dev score 30.00) so far; the run is unfinished" in md
    images = _linked_images(md)
    assert sorted(images) == ["plots/bytes.png", "plots/dev.png", "plots/losses.png", "plots/weights.png"]
    for image in images:
        _assert_png(run / image)


def test_unfinished_run_takes_labels_from_the_task_registry(tmp_path):
    run = _write_run(tmp_path / "run", config='paradigm = "federated"\n[task]\nname = "text2sql"\n'
                                              '[federation]\nrounds = 5\n')
    md = report.write_report(run).read_text()
    assert "- Task: text2sql" in md and "- Rounds: 3 of 5" in md
    assert "| Dev EM % (pooled) |" in md and "(dev EM % 30.00) so far" in md


def test_write_report_finished_run(tmp_path):
    run = _write_run(tmp_path / "run", results=RESULTS)
    md = report.write_report(run).read_text()
    assert "# Run report: fedopt-lorar" in md and "- Paradigm: federated" in md and "- Task: text2sql" in md
    table = tables.markdown_table(tables.results_table(RESULTS))
    caption = tables.table_caption(RESULTS)
    assert table in md and caption in md and md.index(caption) < md.index(table)
    round_rows = [l for l in md.splitlines() if re.match(r"\| [123] \|", l)]
    assert len(round_rows) == 3
    assert "| 2 | 20.0 | 5.0 | lorar | yes | - | - | 20.00 | 1.500 | 3.00 | 6.00 |" in md
    assert "- Best round: 3 (dev EM % 30.00)\n" in md
    assert 'paradigm = "federated"' in md


def _finetune_run(tmp_path, *, finished):
    run = tmp_path / "ft"
    run.mkdir()
    for silo in CLIENTS:
        rounds = [{**_round(r), "clients": {silo: _round(r)["clients"][silo]}} for r in (1, 2)]
        sub_results = {**RESULTS, "name": f"ft/{silo}", "best_round": 2, "best_dev": 20.0, "wall_seconds": 50.0}
        _write_run(run / "silos" / silo, rounds=rounds, results=sub_results if finished else None)
    if finished:
        (run / "results.json").write_text(json.dumps({
            **RESULTS, "paradigm": "finetune", "best_round": None, "best_dev": None, "wall_seconds": 150.0,
            "subruns": {s: f"silos/{s}" for s in CLIENTS}}))
    return run


def test_write_report_finetune_subruns(tmp_path):
    run = _finetune_run(tmp_path, finished=True)
    md = report.write_report(run).read_text()
    assert "Paradigm: finetune" in md and "### GeoQuery" in md and "- Best round: per silo, see below" in md
    assert "- Wall time: 2m 30s" in md
    assert md.count("best round 2 (dev EM % 20.00)") == 3
    assert tables.markdown_table(tables.results_table(RESULTS)) in md
    images = _linked_images(md)
    assert "plots/silos/yelp/losses.png" in images and "plots/silos/geography/dev.png" in images
    for image in images:
        _assert_png(run / image)


def test_unfinished_finetune_wall_time_sums_subruns_with_evaluation(tmp_path):
    run = _finetune_run(tmp_path, finished=False)
    md = report.write_report(run).read_text()
    assert "- Wall time: 2m 00s" in md  # 3 silos x (10 + 20 s training + 5 + 5 s dev evaluation)
    assert md.count("so far; the run is unfinished") == 3


def test_module_does_not_import_torch():
    code = "import sys, fedsilo.runs.report; sys.exit('torch' in sys.modules)"
    repo = Path(report.__file__).parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 0


def test_a_table_wider_than_the_console_prints_whole(tmp_path):
    """mean ± sd cells made the study table wider than the console: rich squeezed the method column to
    nothing and cut cells to '0.…'. Now the table prints at its own width and the console's is kept."""
    cell = "0.4720 ± 0.0048 / 0.4850 ± 0.0094"
    rows = [["MAP / MRR, mean ± sd (n=2)", *(f"silo{i}" for i in range(6))],
            ["fedmatch", *([cell] * 6)]]
    with open(tmp_path / "out.txt", "w") as out:
        console = Console(width=80, file=out)
        tables.print_grid(console, "study", rows)
        assert console.width == 80
    text = (tmp_path / "out.txt").read_text()
    line = next(x for x in text.splitlines() if "fedmatch" in x)
    assert line.count(cell) == 6 and "…" not in text
