"""`fedsilo study`: variants deep-merged over a base config, run resumably, compared in one table."""
import json
import shutil
import statistics

import pytest

from fedsilo.cli import main
from fedsilo.config import ConfigError
from fedsilo.runs.overall import comparison_table
from fedsilo.runs.spread import beyond_spread, claim, mean_sd, spread_phrase
from fedsilo.runs.study import run_study
from fedsilo.runs.studyfile import deep_merge, load_study, parse_seeds, seeded

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
    assert study["overall_clients"]["map"] == ["alpha", "beta", "gamma"] and study["notes"] == []  # every silo
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
    # the check against the named baseline, with the shared rule: over the test items where the runs
    # kept per-item records, else over the two seeds' values
    alone = [_macro(out / "alone" / f"seed-{s}")["map"] for s in (0, 1)]
    kept = all((out / name / f"seed-{s}" / "items" / "test.jsonl").is_file() for name in ("fedavg", "alone")
               for s in (0, 1))
    verdict = ("paired randomisation" if kept else claim(alone, [runs[0]["map"], runs[1]["map"]], ".2f"))
    assert study["baseline"] == "fedavg" and verdict in study["checks"][0] and study["alpha"] == 0.05
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
    """The old rule, kept as a display beside the verdict (tests/test_significance.py has the verdict)."""
    a, b = [10.0, 12.0], [7.0, 8.0]  # means 11 and 7.5, sds √2 ≈ 1.41 and √0.5 ≈ 0.71: gap 3.5 > 2.12
    assert mean_sd(a) == (11.0, pytest.approx(2 ** 0.5)) and beyond_spread(a, b) and not beyond_spread(b, a)
    assert spread_phrase(a, b) == spread_phrase(b, a) == "beyond spread"
    # gap 1.5 beats the larger sd (1.41) but not the sum (2.12): within spread either way
    assert not beyond_spread(a, [9.0, 10.0]) and spread_phrase(a, [9.0, 10.0]) == "within spread"
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


# ---------------------------------------------------------------- Overall over the same silos in every line

SPEC = {"primary": "map", "columns": [{"key": "map", "label": "MAP", "fmt": ".4f"},
                                      {"key": "questions", "label": "questions", "fmt": ".0f", "in_macro": False}]}


def fake(values, spec=SPEC):
    """A results.json on the silos of `values` (client → MAP), its macro the mean over them as the task takes it."""
    rows = [{"client": c, "task": "toyrank", "metrics": {"map": v, "questions": 4.0}} for c, v in values.items()]
    return {"paradigm": "federated", "metric_spec": spec, "wall_seconds": 1.0,
            "test": {"rows": rows, "macro": {"map": sum(values.values()) / len(values), "questions": None}}}


def test_overall_is_taken_over_the_silos_every_line_has():
    """A line on two silos beside three-silo lines: Overall over those two in every line, and a note says so."""
    from fedsilo.runs.overall import comparison
    lines = {"bm25 (no training)": fake({"alpha": 0.5, "beta": 0.3, "gamma": 0.4}),
             "fedavg": [fake({"alpha": 0.6, "beta": 0.2, "gamma": 0.9}),
                        fake({"alpha": 0.8, "beta": 0.4, "gamma": 0.1})],
             "two": [fake({"alpha": 0.7, "beta": 0.5}), fake({"alpha": 0.5, "beta": 0.5})]}
    got = comparison(lines, ["map", "questions"])
    table = got["table"]
    assert table[0] == ["MAP / questions, mean ± sd (n=2)", "alpha", "beta", "gamma", "Overall"]
    # by hand, over alpha and beta: bm25 (0.5 + 0.3) / 2 = 0.4 (its own macro 0.4 too);
    # fedavg seeds (0.6 + 0.2) / 2 = 0.4 and (0.8 + 0.4) / 2 = 0.6 (their own macros: 0.5667, 0.4333)
    assert table[1][-1] == "0.4000 / -"
    assert table[2][-1] == f"0.5000 ± {statistics.stdev([0.4, 0.6]):.4f} / -"
    assert table[3][-1] == f"0.5500 ± {statistics.stdev([0.6, 0.5]):.4f} / -"  # its own silos: its macro
    assert got["over"]["map"] == ["alpha", "beta"] and got["over"]["questions"] is None  # not averaged
    assert [v["map"] for v in got["overall"]["fedavg"]] == pytest.approx([0.4, 0.6])
    assert got["left_out"]["map"] == ["gamma"] and got["marked"] == [] and "†" not in str(table)
    assert got["notes"] == ["Overall is the mean over the 2 silos every line has a value for (alpha, beta); "
                            "left out: gamma (only bm25 (no training), fedavg)."]
    # every line on the same silos: Overall is each run's recorded macro, to the last digit, and no note
    same = comparison({"a": fake({"alpha": 0.1, "beta": 0.7}), "b": fake({"alpha": 0.3, "beta": 0.3})}, ["map"])
    assert same["overall"]["a"][0]["map"] == fake({"alpha": 0.1, "beta": 0.7})["test"]["macro"]["map"]
    assert same["notes"] == [] and same["left_out"]["map"] == []


def test_no_common_silo_marks_each_line_and_judges_nothing():
    from fedsilo.runs.overall import comparison
    from fedsilo.runs.spread import claim_lines
    got = comparison({"news": [fake({"alpha": 0.8}), fake({"alpha": 0.6})],
                      "law": [fake({"beta": 0.2}), fake({"beta": 0.4})]}, ["map"])
    assert got["table"][1][-1] == f"0.7000 ± {statistics.stdev([0.8, 0.6]):.4f} †"  # its own mean, marked
    assert got["table"][2][-1].endswith(" †") and got["marked"] == ["news", "law"] and got["over"]["map"] == []
    assert got["notes"] == ["† No silo has a value in every line, so no Overall is over the same silos: a line "
                            "marked † shows its own mean over its own silos (news: alpha; law: beta); they are not "
                            "comparable."]
    per_seed = {name: {str(s): {"overall": o} for s, o in enumerate(runs)} for name, runs in got["overall"].items()}
    assert claim_lines(per_seed, "news", "map", "MAP", over=[]) == [
        "law > news (Overall MAP): not judged: no silo has a value in every line, so their Overall is not over the "
        "same silos"]


def test_a_study_on_different_silos_compares_over_the_common_ones(tmp_path, monkeypatch, capsys):
    """Through `run_study` (runs faked): a variant on alpha and beta beside two on three silos; two seeds."""
    import fedsilo.runs.runner as runner
    silos = {"alone": {0: {"alpha": 0.30, "beta": 0.50}, 1: {"alpha": 0.34, "beta": 0.52}},
             "fedavg": {0: {"alpha": 0.60, "beta": 0.70, "gamma": 0.10},
                        1: {"alpha": 0.62, "beta": 0.72, "gamma": 0.90}},
             "equal": {0: {"alpha": 0.50, "beta": 0.60, "gamma": 0.90}, 1: {"alpha": 0.52, "beta": 0.60, "gamma": 0.2}}}
    monkeypatch.setattr(runner, "run_experiment",
                        lambda cfg, out, **_: fake(silos[cfg.name.split("/")[1]][cfg.seed]))
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map"]\nbaseline = "fedavg"'))
    out = tmp_path / "study"
    study = run_study(path, out, show_progress=False, seeds=[0, 1])
    printed = capsys.readouterr().out

    def cell(name):  # by hand: the mean over alpha and beta, per seed, then mean ± sd
        per = [(silos[name][s]["alpha"] + silos[name][s]["beta"]) / 2 for s in (0, 1)]
        return per, f"{statistics.mean(per):.4f} ± {statistics.stdev(per):.4f}"

    table = {row[0]: row[-1] for row in study["table"][1:]}
    assert {name: table[name] for name in silos} == {name: cell(name)[1] for name in silos}
    assert cell("fedavg")[1] == "0.6600 ± 0.0141"  # its own three-silo means would read 0.4667 and 0.7467
    assert study["overall_clients"]["map"] == ["alpha", "beta"] and study["overall_clients"]["questions"] is None
    fedavg = study["per_seed"]["fedavg"]["1"]
    assert fedavg["overall"]["map"] == pytest.approx(0.67) and fedavg["macro"]["map"] == pytest.approx(2.24 / 3)
    note = ("Overall is the mean over the 2 silos every line has a value for (alpha, beta); left out: gamma "
            "(only fedavg, equal).")
    assert study["notes"] == [note] and note in printed and note in (out / "report.md").read_text()
    # the claims are over the same two silos, and say so
    expected = []
    for name in ("alone", "equal"):
        verdict = claim(cell(name)[0], cell("fedavg")[0], ".4f")
        gap = statistics.mean(cell(name)[0]) - statistics.mean(cell("fedavg")[0])
        expected.append(f"{name} > fedavg (Overall MAP over alpha, beta): {cell(name)[1]} vs {cell('fedavg')[1]}, "
                        f"gap {gap:+.4f}, {spread_phrase(cell(name)[0], cell('fedavg')[0])}: {verdict}")
    assert study["checks"] == expected and ", beyond spread: reversed (p = 0.009, Welch's t-test" in expected[0]
    assert all(line in printed for line in expected)
    # over each one's own silos the same runs would have read "within spread": not like with like
    own = {name: [study["per_seed"][name][s]["macro"]["map"] for s in ("0", "1")] for name in ("equal", "fedavg")}
    assert spread_phrase(own["equal"], own["fedavg"]) == "within spread" and "beyond spread: reversed" in expected[1]
    assert json.loads((out / "study.json").read_text())["overall_clients"]["map"] == ["alpha", "beta"]


def test_a_study_takes_a_run_config_file_as_its_base(tmp_path):
    """`[study] config`: the file `fedsilo init` wrote is the base (its paths relative to its own
    folder), [base] changes it, each variant changes that."""
    from fedsilo.runs.studyfile import load_study

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "qa.toml").write_text(
        'name = "mine"\n[task]\nname = "matching"\nsilos = ["bank"]\nmax_length = 64\n'
        '[task.sources.bank]\npath = "data/bank.csv"\nsplit = {dev = 0.1, test = 0.1}\n'
        '[federation]\nrounds = 3\n')
    study = tmp_path / "study.toml"
    study.write_text('[study]\nname = "s"\nconfig = "cfg/qa.toml"\n[base.federation]\nrounds = 2\n'
                     '[variants.alone]\nparadigm = "finetune"\n[variants.fed]\n')
    _, configs = load_study(study)
    for name, cfg in configs.items():
        assert cfg.federation.rounds == 2 and cfg.task.max_length == 64 and cfg.name == f"s/{name}"
        assert cfg.task.sources["bank"].path == str(tmp_path / "cfg" / "data" / "bank.csv")
    assert configs["alone"].paradigm == "finetune" and configs["fed"].paradigm == "federated"
    study.write_text('[study]\nname = "s"\nconfig = "missing.toml"\n[variants.a]\n')
    with pytest.raises(ConfigError, match="config: .*missing.toml is not a file"):
        load_study(study)
