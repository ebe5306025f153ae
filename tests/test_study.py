"""`fedsilo study`: variants deep-merged over a base config, run resumably, compared in one table."""
import json
import shutil
import statistics

import pytest

from fedsilo.cli import main
from fedsilo.config import ConfigError
from fedsilo.runs.study import (beyond_spread, claim, comparison_table, deep_merge, load_study, mean_sd, parse_seeds,
                                run_study, seeded)

STUDY = '''
[study]
name = "toy-study"
title = "toy comparison"
metrics = ["map", "mrr"]

[base]
plugins = ["tests.toytask"]
seed = 5
[base.task]
name = "toyrank"
n_train = 8
n_eval = 4
[base.model]
d_model = 32
d_ff = 64
num_layers = 1
num_heads = 2
[base.client]
lr = 1e-3
batch_size = 4
optimizer = "adamw"
[base.federation]
rounds = 2

[variants.alone]
paradigm = "finetune"
[variants.fedavg]
[variants.equal]
federation = {weighting = "equal"}
'''


def test_deep_merge_merges_tables_and_replaces_values():
    base = {"a": {"x": 1, "y": {"z": 2}}, "b": [1, 2]}
    assert deep_merge(base, {"a": {"y": {"w": 3}}, "b": [3]}) == {"a": {"x": 1, "y": {"z": 2, "w": 3}}, "b": [3]}
    assert base == {"a": {"x": 1, "y": {"z": 2}}, "b": [1, 2]}  # untouched


def test_load_study_validates_each_variant_and_names_the_culprit(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    settings, configs = load_study(path, ["federation.rounds=1"])
    assert list(configs) == ["alone", "fedavg", "equal"]
    assert configs["alone"].paradigm == "finetune" and configs["equal"].federation.weighting == "equal"
    assert all(c.federation.rounds == 1 for c in configs.values()) and configs["fedavg"].name == "toy-study/fedavg"
    path.write_text(STUDY + "\n[variants.bad]\nfederation = {roundz = 2}\n")
    with pytest.raises(ConfigError, match=r"variants\.bad.*federation\.roundz: unknown key"):
        load_study(path)
    with pytest.raises(ConfigError, match="--only 'nope'"):
        load_study(tmp_path / "s.toml", only=["nope"])
    path.write_text(STUDY.replace("[study]", "[studdy]"))
    with pytest.raises(ConfigError, match="studdy: unknown section"):
        load_study(path)


def test_a_study_runs_its_variants_and_compares_them(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    out = tmp_path / "study"
    study = run_study(path, out, show_progress=False)
    table = study["table"]
    assert table[0] == ["MAP % / MRR %", "alpha", "beta", "gamma", "Overall"]
    assert [row[0] for row in table[1:]] == ["alone", "fedavg", "equal"]
    fedavg = json.loads((out / "fedavg" / "results.json").read_text())["test"]
    assert table[2][-1] == f"{fedavg['macro']['map']:.2f} / {fedavg['macro']['mrr']:.2f}"
    assert study["costs"]["alone"]["params_up"] == 0 and study["costs"]["fedavg"]["params_up"] > 0
    assert "| fedavg |" in (out / "report.md").read_text()
    # a second call finds every variant finished: the same table, nothing trained again
    mtime = (out / "fedavg" / "checkpoint.pt").stat().st_mtime_ns
    assert run_study(path, out, show_progress=False)["table"] == table
    assert (out / "fedavg" / "checkpoint.pt").stat().st_mtime_ns == mtime


def test_study_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["study", str(tmp_path / "missing.toml")]) == 2
    assert "study file not found" in capsys.readouterr().err


def test_no_progress_prints_a_line_per_round_and_per_variant(tmp_path, capsys):
    """`fedsilo study --no-progress` (make study's logs): no bars, but each finished round and
    variant is one plain line, so a long study never looks hung."""
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    assert main(["study", str(path), "--out", str(tmp_path / "study"), "--only", "alone,fedavg",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    err, out = captured.err, captured.out
    assert err.count("fedsilo: round 1/2 done") == 4 and err.count("fedsilo: round 2/2 done") == 4  # 3 silos + fedavg
    assert err.count("fedsilo: finetuning ") == 3
    fedavg = json.loads((tmp_path / "study" / "fedavg" / "results.json").read_text())["test"]["macro"]["map"]
    assert f"toy-study: fedavg done: Overall MAP % {fedavg:.2f}" in out
    assert "toy-study: alone done: Overall MAP %" in out
    assert "━" not in err  # no progress bar


def _macro(run_dir):
    return json.loads((run_dir / "results.json").read_text())["test"]["macro"]


def test_a_study_runs_every_seed_and_shows_mean_and_spread(tmp_path, capsys):
    """Two seeds: OUT/NAME/seed-S each; a cell is mean ± sample sd of the two runs, recomputed here."""
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('title = "toy comparison"', 'title = "toy comparison"\nbaseline = "fedavg"'))
    out = tmp_path / "study"
    assert main(["study", str(path), "--out", str(out), "--only", "alone,fedavg", "--seeds", "0,1",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    study = json.loads((out / "study.json").read_text())
    assert study["seeds"] == [0, 1] and not (out / "fedavg" / "results.json").exists()
    runs = {s: _macro(out / "fedavg" / f"seed-{s}") for s in (0, 1)}
    assert runs[0]["map"] != runs[1]["map"]  # the seed reached the run
    assert json.loads((out / "fedavg" / "seed-1" / "results.json").read_text())["name"] == "toy-study/fedavg/seed-1"
    cell = " / ".join(f"{statistics.mean([runs[0][m], runs[1][m]]):.2f} ± "
                      f"{statistics.stdev([runs[0][m], runs[1][m]]):.2f}" for m in ("map", "mrr"))
    table = study["table"]
    assert table[0][0] == "MAP % / MRR %, mean ± sd (n=2)"
    assert [row[0] for row in table[1:]] == ["alone", "fedavg"] and table[2][-1] == cell
    assert study["per_seed"]["fedavg"]["1"]["overall"]["map"] == runs[1]["map"]
    assert set(study["per_seed"]["alone"]["0"]["clients"]) == {"alpha", "beta", "gamma"}
    assert "sample standard deviation (n−1)" in (out / "report.md").read_text()
    # the check against the named baseline, with the shared rule
    alone = [_macro(out / "alone" / f"seed-{s}")["map"] for s in (0, 1)]
    verdict = claim(alone, [runs[0]["map"], runs[1]["map"]])
    assert study["baseline"] == "fedavg" and f": {verdict}" in study["checks"][0]
    assert "alone > fedavg (Overall MAP %)" in printed and verdict in printed
    for s in (0, 1):  # a finished line per variant per seed
        assert f"toy-study: fedavg seed {s} done: Overall MAP % {runs[s]['map']:.2f}" in printed
    # costs: the mean over the seeds; parameters sent are the same for both
    per = [study["per_seed"]["fedavg"][s]["cost"] for s in ("0", "1")]
    assert per[0]["params_up"] == per[1]["params_up"] > 0
    wall = (per[0]["wall_seconds"] + per[1]["wall_seconds"]) / 2
    assert study["costs"]["fedavg"]["wall_seconds"] == pytest.approx(wall)


def test_one_seed_keeps_the_layout_and_resume_runs_only_missing_seeds(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    one = run_study(path, tmp_path / "one", only=["fedavg"], show_progress=False, seeds=[3])
    assert (tmp_path / "one" / "fedavg" / "results.json").is_file()
    assert not (tmp_path / "one" / "fedavg" / "seed-3").exists()
    assert "seed = 3" in (tmp_path / "one" / "fedavg" / "config.toml").read_text().splitlines()
    assert one["table"][0][0] == "MAP % / MRR %" and " ± " not in one["table"][1][-1] and "checks" not in one
    recorded = json.loads((tmp_path / "one" / "fedavg" / "results.json").read_text())
    assert recorded["name"] == "toy-study/fedavg" and recorded["test"]["macro"]["map"] is not None
    assert one["per_seed"]["fedavg"]["3"]["overall"] == recorded["test"]["macro"]
    # seeds from the file; a study stopped after seed 0 runs seed 1 only
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map", "mrr"]\nseeds = [0, 1]'))
    out = tmp_path / "multi"
    assert run_study(path, out, only=["fedavg"], show_progress=False)["seeds"] == [0, 1]
    shutil.rmtree(out / "fedavg" / "seed-1")
    kept = (out / "fedavg" / "seed-0" / "checkpoint.pt").stat().st_mtime_ns
    again = run_study(path, out, only=["fedavg"], show_progress=False)
    assert (out / "fedavg" / "seed-0" / "checkpoint.pt").stat().st_mtime_ns == kept  # not trained again
    assert (out / "fedavg" / "seed-1" / "results.json").is_file() and again["table"][0][0].endswith("(n=2)")


@pytest.mark.parametrize("text, message", [
    ("", "no seeds"), (" , ", "no seeds"), ("0,x", "'x' is not an integer"), ("1.5", "'1.5' is not an integer"),
    ("-1", "-1 is out of range"), ("0,-2", "-2 is out of range"), ("0,1,0", "seed 0 is given twice"),
])
def test_bad_seeds_are_one_line_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    with pytest.raises(ConfigError, match=message):
        parse_seeds(text)
    assert main(["study", str(path), "--out", str(tmp_path / "out"), "--seeds", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: --seeds: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # nothing ran


def test_bad_seeds_in_the_study_file_name_it(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map", "mrr"]\nseeds = [1, 1]'))
    with pytest.raises(ConfigError, match=r"\[study\] seeds: seed 1 is given twice"):
        load_study(path)
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map", "mrr"]\nbaseline = "nope"'))
    with pytest.raises(ConfigError, match="baseline 'nope': no such variant"):
        load_study(path)


def test_beyond_spread_needs_a_gap_larger_than_both_spreads():
    a, b = [10.0, 12.0], [7.0, 8.0]  # means 11 and 7.5, sds √2 ≈ 1.41 and √0.5 ≈ 0.71: gap 3.5 > 2.12
    assert mean_sd(a) == (11.0, pytest.approx(2 ** 0.5)) and beyond_spread(a, b) and not beyond_spread(b, a)
    assert claim(a, b) == "holds" and claim(b, a) == "reversed"
    # gap 1.5 beats the larger sd (1.41) but not the sum (2.12): within spread either way
    assert not beyond_spread(a, [9.0, 10.0]) and claim(a, [9.0, 10.0]) == "within spread"
    assert not beyond_spread([5.0, 5.0], [5.0, 5.0])  # equal: never holds
    assert beyond_spread([5.1, 5.1], [5.0, 5.0])  # no spread at all: any gap holds
    assert not beyond_spread([100.0], [1.0, 2.0]) and claim([100.0], [1.0, 2.0]) == "needs 2 seeds"
    assert mean_sd([None, 3.0, float("nan")]) == (3.0, None)


def test_a_seed_shifts_the_few_shot_sample_unless_the_variant_fixes_it(tmp_path):
    from fedsilo.config import validate
    cfg = validate({"task": {"name": "multitask", "sample_seeds": [100, 13]}})
    assert seeded(cfg, 2).seed == 2 and seeded(cfg, 2).task.sample_seeds == [102, 15]
    assert seeded(cfg, 2, vary_sample=False).task.sample_seeds == [100, 13]
    path = tmp_path / "s.toml"
    path.write_text(STUDY)  # toyrank has no sample seeds: only `seed` changes
    assert load_study(path, seed=7)[1]["fedavg"].seed == 7


def test_reference_rows_show_once_and_variants_show_mean_and_sd():
    def results(alpha, beta):
        return {"test": {"rows": [{"client": "alpha", "metrics": {"map": alpha}},
                                  {"client": "beta", "metrics": {"map": beta}}],
                         "macro": {"map": (alpha + beta) / 2}}}
    table = comparison_table({"bm25 (no training)": results(0.5, 0.25),
                              "fedavg": [results(0.6, 0.2), results(0.7, 0.4), results(0.8, 0.3)]}, ["map"], {})
    assert table[0] == ["map, mean ± sd (n=3)", "alpha", "beta", "Overall"]
    assert table[1] == ["bm25 (no training)", "0.5000", "0.2500", "0.3750"]
    assert table[2] == ["fedavg", "0.7000 ± 0.1000", "0.3000 ± 0.1000", "0.5000 ± 0.0866"]  # macros .40 .55 .55
