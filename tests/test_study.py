"""`fedsilo study`: variants deep-merged over a base config, run resumably, compared in one table."""
import json

import pytest

from fedsilo.cli import main
from fedsilo.config import ConfigError
from fedsilo.runs.study import deep_merge, load_study, run_study

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
