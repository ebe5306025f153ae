"""A silo's own policy (fedsilo.client.policy): a hostile server config for each rule is refused by the
silo before anything leaves it — in-process, from the command line, and on a real Flower SuperNode that
reads the policy from its node config."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedsilo.cli import main
from fedsilo.client.policy import read_policy
from fedsilo.config import to_toml
from fedsilo.errors import ConfigError
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import toy_config

ROOT = Path(__file__).resolve().parents[1]


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gamma-policy.toml"
    path.write_text(text)
    return path


DP = {"client": {"dp": {"target_epsilon": 8.0}}}
SECURE = {"federation": {"secure_aggregation": {}}}


@pytest.mark.parametrize("policy,hostile,rule", [
    ('allow_tensors = ["classifier.*"]', {}, "allow_tensors: the round may send 'bert."),
    ("require_dp = true", {}, "require_dp: the round trains without record-level DP"),
    ("require_dp = true", {"client": {"dp": {"noise_multiplier": 1.0, "noise": "seeded"}}},
     'require_dp: client.dp.noise = "seeded"'),
    ("require_dp = true\nmax_epsilon = 2.0", DP, "max_epsilon: the run would take this silo to ε = "),
    ("require_secure_aggregation = true", {}, "require_secure_aggregation: the round sends the update in the clear"),
    ("max_rounds = 1", {}, "max_rounds: the run asks for 2 rounds, more than 1"),
], ids=["tensors", "dp", "seeded", "epsilon", "secure", "rounds"])
def test_each_rule_refuses_a_hostile_config_before_anything_leaves(tmp_path, policy, hostile, rule):
    path = policy_file(tmp_path, policy)
    cfg = toy_config(federation={"rounds": 2, "weighting": "size"}, **hostile)
    run_experiment(cfg, tmp_path / "run", show_progress=False, policies={"gamma": str(path)})
    for record in rounds_of(tmp_path / "run"):
        gamma = record["clients"]["gamma"]
        assert gamma["refused"].startswith(f"refused by the silo: policy {path.resolve()}: {rule}"), gamma["refused"]
        assert gamma["bytes_up"] == 0 and gamma["params_up"] == 0 and gamma["n_examples"] is None
        assert record["applied"] and {"alpha", "beta"} <= {c for c, e in record["clients"].items() if "refused" not in e}
    stored = tmp_path / "run" / "clients" / "gamma"
    assert not stored.exists() or not any(stored.iterdir())  # nothing trained: no state kept either


def test_a_config_that_meets_the_policy_trains(tmp_path):
    path = policy_file(tmp_path, 'allow_tensors = ["*"]\nrequire_dp = true\nmax_epsilon = 8.0\n'
                                 "require_secure_aggregation = true\nmax_rounds = 2\n")
    cfg = toy_config(federation={"rounds": 2, "weighting": "size", "secure_aggregation": {}}, **DP)
    run_experiment(cfg, tmp_path / "run", show_progress=False, policies={"gamma": str(path)})
    for record in rounds_of(tmp_path / "run"):
        assert "refused" not in record["clients"]["gamma"] and record["clients"]["gamma"]["privacy"]["epsilon"] <= 8.0


@pytest.mark.parametrize("text,culprit", [
    ("require_dp = yes", "gamma-policy.toml"),
    ("max_rounds = 0", "max_rounds"),
    ("allow = [\"*\"]", "allow: unknown key"),
])
def test_a_bad_policy_file_is_named(tmp_path, text, culprit):
    with pytest.raises(ConfigError, match=culprit):
        read_policy(policy_file(tmp_path, text))


def test_the_command_line_gives_each_silo_its_policy(tmp_path, capsys):
    config = tmp_path / "toy.toml"
    config.write_text(to_toml(toy_config(federation={"rounds": 1})))
    path = policy_file(tmp_path, "require_secure_aggregation = true")
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress",
                 "--policy", f"gamma={path}"]) == 0
    assert "rejected gamma: refused by the silo: policy" in capsys.readouterr().err
    assert main(["run", str(config), "--out", str(tmp_path / "other"), "--policy", f"nosuch={path}"]) == 2
    assert "'nosuch' is not a silo of this run" in capsys.readouterr().err
    assert main(["run", str(config), "--out", str(tmp_path / "other"), "--policy", "gamma"]) == 2
    assert "write SILO=FILE" in capsys.readouterr().err
    assert not (tmp_path / "other" / "rounds.jsonl").exists()


def test_a_supernode_enforces_its_own_policy_against_the_servers_config(tmp_path, monkeypatch):
    """A real deployment: gamma's SuperNode reads its policy from its node config; the server's config
    (no secure aggregation) breaks it, so gamma sends nothing, round after round."""
    from fedsilo.engines.flower.deploy import LocalDeployment, silo_nodes

    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(federation={"rounds": 2})
    config = tmp_path / "toy.toml"
    config.write_text(to_toml(cfg))
    path = policy_file(tmp_path, "require_secure_aggregation = true")
    nodes = silo_nodes(cfg.task, None)
    nodes["gamma"]["policy"] = str(path)
    with LocalDeployment(tmp_path / "fl", nodes) as dep:
        dep.run(config, tmp_path / "run", timeout=600)
    for record in rounds_of(tmp_path / "run"):
        gamma = record["clients"]["gamma"]
        assert "require_secure_aggregation" in gamma["refused"] and gamma["bytes_up"] == 0
        assert "flower_bytes_up" not in gamma and record["applied"]


def test_deploy_checks_each_policy_before_any_process_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    config = tmp_path / "toy.toml"
    config.write_text(to_toml(toy_config(federation={"rounds": 1})))
    good = policy_file(tmp_path, "require_dp = true")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_rounds = -1")
    out = ["--out", str(tmp_path / "run"), "--workdir", str(tmp_path / "work")]
    assert main(["deploy", str(config), *out, "--policy", f"nosuch={good}"]) == 2
    assert "'nosuch' is not a silo of this run" in capsys.readouterr().err
    assert main(["deploy", str(config), *out, "--policy", f"gamma={bad}"]) == 2
    assert f"silo policy {bad.resolve()}: max_rounds" in capsys.readouterr().err
    assert not (tmp_path / "work" / "processes").exists()  # no SuperLink or SuperNode was started
