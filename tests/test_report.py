"""Run reports: tables, plots and report.md built from synthetic run dirs."""
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from rich.console import Console

from fedsilo.runs import report

CLIENTS = ["advising", "geography", "yelp"]
STEPS = {"advising": 25, "geography": 10, "yelp": 40}


def _round(rnd: int, *, dev: bool = True, fallback: bool = False) -> dict:
    clients = {}
    for i, name in enumerate(CLIENTS):
        done = STEPS[name] * (rnd - 1)
        clients[name] = {
            "n_examples": 100 + i, "steps": STEPS[name],
            "losses": [[done + k, 3.0 - 0.3 * rnd - 0.01 * k] for k in (1, STEPS[name] // 2, STEPS[name])],
            "delta_loss": 0.5, "weight": None if (rnd == 2 and i == 0) else (i + 1) / 6,
            "bytes_up": 1000, "bytes_down": 2000, "seconds": 3.0,
        }
    return {
        "round": rnd, "seconds": 10.0 * rnd, "sampled": CLIENTS, "weighting": "lorar",
        "fallback": fallback, "bytes_up": 3_000_000, "bytes_down": 6_000_000,
        "clients": clients, "missing": [],
        "dev": {"score": 10.0 * rnd, "macro": 9.0 * rnd, "micro": 10.0 * rnd, "loss": 3.0 / rnd, "per_silo": {}}
        if dev else None,
    }


RESULTS = {
    "paradigm": "federated", "name": "fedopt-lorar", "best_round": 3, "best_dev": 30.0,
    "test": {
        "per_silo": {
            "advising": {"em": 10.0, "correct": 5, "n": 50, "exec": None},
            "geography": {"em": 20.0, "correct": 2, "n": 10, "exec": 30.0},
            "yelp": {"em": 33.333, "correct": 1, "n": 3, "exec": None},
        },
        "macro": 21.111, "micro": 12.698,
    },
}


def _write_run(path, *, results: dict | None = None, rounds=None):
    path.mkdir(parents=True)
    rounds = rounds if rounds is not None else [_round(1, dev=False), _round(2, fallback=True), _round(3)]
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (path / "config.toml").write_text('paradigm = "federated"\n')
    if results is not None:
        (path / "results.json").write_text(json.dumps(results))
    return path


def _no_exec(results: dict) -> dict:
    per_silo = {s: {**v, "exec": None} for s, v in results["test"]["per_silo"].items()}
    return {**results, "test": {**results["test"], "per_silo": per_silo}}


def _linked_images(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def _assert_png(path):
    assert path.stat().st_size > 0
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


# ---------------------------------------------------------------- read_rounds


def test_read_rounds_roundtrip_and_skips_blank_lines(tmp_path):
    run = _write_run(tmp_path / "run")
    with open(run / "rounds.jsonl", "a") as f:
        f.write("\n")
    rounds = report.read_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]


def test_malformed_line_names_file_and_line(tmp_path):
    run = _write_run(tmp_path / "run")
    lines = (run / "rounds.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]
    (run / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rounds\.jsonl:2\b"):
        report.read_rounds(run)


def test_non_object_line_is_rejected(tmp_path):
    run = _write_run(tmp_path / "run")
    with open(run / "rounds.jsonl", "a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(ValueError, match=r"rounds\.jsonl:4\b"):
        report.read_rounds(run)


def test_missing_run_dir_or_rounds_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        report.read_rounds(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        report.write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="rounds.jsonl"):
        report.write_report(tmp_path / "empty")


# --------------------------------------------------------------------- tables


def test_results_table_numbers_and_exec_row():
    header, em, exec_ = report.results_table(RESULTS)
    assert header == ["", "Advising", "GeoQuery", "Yelp", "MacroAvg", "MicroAvg"]
    assert em == ["EM", "10.00", "20.00", "33.33", "21.11", "12.70"]
    assert exec_ == ["Exec", "-", "30.00", "-", "-", "-"]


def test_results_table_without_exec_has_no_exec_row():
    rows = report.results_table(_no_exec(RESULTS))
    assert [r[0] for r in rows] == ["", "EM"]


def test_results_table_display_override_and_unknown_silo():
    results = {"test": {"per_silo": {"advising": {"em": 1.0, "correct": 1, "n": 1},
                                     "newsilo": {"em": 3.0, "correct": 1, "n": 3}}}}
    header, em = report.results_table(results, display={"advising": "ADV"})
    assert header[1:3] == ["ADV", "newsilo"]
    # Averages are recomputed from per-silo numbers when absent.
    assert em[-2:] == ["2.00", "50.00"]


def test_markdown_table_column_count():
    md = report.markdown_table(report.results_table(RESULTS))
    lines = md.splitlines()
    assert len(lines) == 4  # header, rule, EM, Exec
    for line in lines:
        assert line.startswith("|") and line.endswith("|")
        assert line.count("|") == 6 + 1


def test_combine_tables_one_row_per_run():
    other = {"test": {"per_silo": {"atis": {"em": 50.0, "correct": 5, "n": 10}}, "macro": 50.0, "micro": 50.0}}
    rows = report.combine_tables({"lorar": RESULTS, "fedavg": other})
    assert rows[0] == ["", "Advising", "GeoQuery", "Yelp", "ATIS", "MacroAvg", "MicroAvg"]
    assert rows[1] == ["lorar", "10.00", "20.00", "33.33", "-", "21.11", "12.70"]
    assert rows[2] == ["fedavg", "-", "-", "-", "50.00", "50.00", "50.00"]


def test_print_results_renders_with_rich():
    console = Console(record=True, width=120)
    report.print_results(RESULTS, console=console)
    text = console.export_text()
    assert "GeoQuery" in text and "21.11" in text and "Exec" in text


# ---------------------------------------------------------------------- plots


def test_plot_losses_one_axes_per_client(tmp_path):
    rounds = [_round(r) for r in (1, 2, 3)]
    fig = report.plot_losses(rounds, tmp_path / "losses.png")
    assert len(fig.axes) == len(CLIENTS)
    assert [ax.get_title() for ax in fig.axes] == ["Advising", "GeoQuery", "Yelp"]
    # Each client's curve spans all its rounds, on its own step axis.
    xs = fig.axes[2].lines[0].get_xdata()
    assert len(xs) == 9 and max(xs) == 3 * STEPS["yelp"]
    _assert_png(tmp_path / "losses.png")


def test_plot_weights_and_bytes_and_dev(tmp_path):
    rounds = [_round(1, dev=False), _round(2, fallback=True), _round(3)]
    weights = report.plot_weights(rounds, tmp_path / "w.png")
    assert len(weights.axes[0].lines) == len(CLIENTS)
    dev = report.plot_dev(rounds, tmp_path / "d.png")
    assert list(dev.axes[0].lines[0].get_xdata()) == [2, 3]
    report.plot_bytes(rounds, tmp_path / "b.png")
    for name in ("w.png", "d.png", "b.png"):
        _assert_png(tmp_path / name)


def test_plot_dev_without_evaluations(tmp_path):
    report.plot_dev([_round(1, dev=False)], tmp_path / "d.png")
    _assert_png(tmp_path / "d.png")


# --------------------------------------------------------------------- report


def test_write_report_unfinished_run(tmp_path):
    run = _write_run(tmp_path / "run")
    md_path = report.write_report(run)
    assert md_path == run / "report.md"
    md = md_path.read_text()
    assert "unfinished" in md and "Test results" not in md
    assert "Best round: 3 (dev 30.00)" in md  # derived from the dev log
    assert "Wall time: 1m 00s" in md
    images = _linked_images(md)
    assert sorted(images) == ["plots/bytes.png", "plots/dev.png", "plots/losses.png", "plots/weights.png"]
    for image in images:
        _assert_png(run / image)


def test_write_report_finished_run(tmp_path):
    run = _write_run(tmp_path / "run", results=RESULTS)
    md = report.write_report(run).read_text()
    assert "# Run report: fedopt-lorar" in md and "Paradigm: federated" in md
    assert report.markdown_table(report.results_table(RESULTS)) in md
    round_rows = [l for l in md.splitlines() if re.match(r"\| [123] \|", l)]
    assert len(round_rows) == 3
    assert "| 2 | 20.0 | lorar | yes | 20.00 | 1.500 | 3.00 | 6.00 |" in md
    assert 'paradigm = "federated"' in md


def test_write_report_finetuning_subruns(tmp_path):
    run = tmp_path / "ft"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({**RESULTS, "paradigm": "finetuning"}))
    for silo in CLIENTS:
        rounds = [{**_round(r), "clients": {silo: _round(r)["clients"][silo]}} for r in (1, 2)]
        _write_run(run / "silos" / silo, rounds=rounds)
    md = report.write_report(run).read_text()
    assert "Paradigm: finetuning" in md and "### GeoQuery" in md
    assert "Wall time: 1m 30s" in md  # 3 silos x (10 + 20) s
    images = _linked_images(md)
    assert "plots/silos/yelp/losses.png" in images
    for image in images:
        _assert_png(run / image)


def test_module_does_not_import_torch():
    code = "import sys, fedsilo.runs.report; sys.exit('torch' in sys.modules)"
    repo = Path(report.__file__).parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 0


def test_loss_row_when_every_silo_has_a_loss():
    results = {"test": {"per_silo": {"a": {"em": 0.0, "correct": 0, "n": 2, "loss": 1.25},
                                     "b": {"em": 50.0, "correct": 1, "n": 2, "loss": 0.5}},
                        "macro": 25.0, "micro": 25.0}}
    rows = report.results_table(results)
    assert rows[-1] == ["Loss", "1.250", "0.500", "-", "-"]
    del results["test"]["per_silo"]["b"]["loss"]
    assert report.results_table(results)[-1][0] == "EM"
