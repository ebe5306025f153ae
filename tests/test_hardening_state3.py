"""Issue 41, corrupt state and privacy settings: an edited silo-level DP accountant in checkpoint.pt (DP07,
DP07b) and an edited checkpoint under DP-SGD; `fedsilo export` of a NaN or another run's best.pt (EX03,
EX03c); a DP target no noise reaches (DP01, DP11); a policy's integer fields given a bool (PO03c)."""
from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.client.policy import SiloPolicy, read_policy
from fedsilo.config import ConfigError, to_toml
from fedsilo.errors import RunDirError
from fedsilo.privacy.accountant import Budget
from fedsilo.runs.runner import run_experiment
from tests.test_lora import lora_config
from tests.test_plugins import rounds_of, toy_config


def one_error_line(err: str) -> str:
    """The single `fedsilo: error:` line of stderr (and no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("fedsilo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run directory but its lock (whose holder's token changes with each command)."""
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != ".lock"}


# ---- DP07 / DP07b: the federation's accountant is rebuilt from rounds.jsonl, not taken from the checkpoint

SILO_DP = {"clip": 1.0, "noise_multiplier": 2.0, "target_epsilon": 3.5}  # ε 2.17, 3.19, 4.01 after 1, 2, 3 rounds


def _emptied(meta: dict) -> dict:
    return {**meta, "history": []}


def _target_raised(meta: dict) -> dict:
    return {**meta, "target_epsilon": 1e9}


def _less_noise_counted(meta: dict) -> dict:  # the history claims a larger σ than the round released with
    return {**meta, "history": [[sigma * 10, q, n] for sigma, q, n in meta["history"]]}


def _dropped(meta: dict) -> None:
    return None


@pytest.mark.parametrize("edit", [_emptied, _target_raised, _less_noise_counted, _dropped],
                         ids=["history emptied", "target raised", "sigma raised", "accountant removed"])
def test_an_edited_silo_dp_accountant_is_refused_and_an_honest_resume_stops_at_the_target(tmp_path, capsys, edit):
    whole = run_experiment(toy_config(federation={"rounds": 5, "silo_dp": SILO_DP}), tmp_path / "whole",
                           show_progress=False)
    assert whole["rounds"] == 2  # the uninterrupted run stops before round 3 (ε 4.01 > 3.5)
    run = tmp_path / "run"
    run_experiment(toy_config(federation={"rounds": 1, "silo_dp": SILO_DP}), run, show_progress=False)
    honest = (run / "checkpoint.pt").read_bytes()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    meta = edit(json.loads(state["server"]["silo_dp"]))
    if meta is None:
        del state["server"]["silo_dp"]
    else:
        state["server"]["silo_dp"] = json.dumps(meta)
    torch.save(state, run / "checkpoint.pt")
    before = snapshot(run)
    config = tmp_path / "five.toml"
    config.write_text(to_toml(toy_config(federation={"rounds": 5, "silo_dp": SILO_DP})))

    assert main(["run", str(config), "--out", str(run), "--resume", "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{run / 'checkpoint.pt'} cannot be resumed" in line and "silo-level DP accountant" in line
    assert snapshot(run) == before  # nothing trained, nothing rewritten

    (run / "checkpoint.pt").write_bytes(honest)  # the honest checkpoint: the same ε, and the target still stops it
    assert main(["run", str(config), "--out", str(run), "--resume", "--no-progress"]) == 0
    resumed = json.loads((run / "results.json").read_text())
    assert resumed["rounds"] == 2 and "round 3 would take the federation to ε = 4.012 > target ε = 3.5" in \
        resumed["stopped"]
    assert [r["silo_dp"]["epsilon"] for r in rounds_of(run)] == \
        [r["silo_dp"]["epsilon"] for r in rounds_of(tmp_path / "whole")]


def test_an_edited_rounds_log_is_refused_too(tmp_path):
    """The records are the authority only together with the checkpoint: a rounds.jsonl whose DP record was
    edited (a release dropped from the count) disagrees with it and is refused the same way."""
    run = tmp_path / "run"
    run_experiment(toy_config(federation={"rounds": 2, "silo_dp": SILO_DP}), run, show_progress=False)
    records = rounds_of(run)
    del records[1]["silo_dp"]
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(RunDirError, match="silo-level DP accountant .* disagrees with rounds.jsonl"):
        run_experiment(toy_config(federation={"rounds": 3, "silo_dp": SILO_DP}), run, resume=True,
                       show_progress=False)


def test_an_edited_checkpoint_cannot_lower_a_dp_sgd_silos_epsilon(tmp_path):
    """DP-SGD's accountant is each silo's privacy ledger, not the checkpoint: the checkpoint holds no
    accountant to edit, and one rolled back a round (round 1's, after round 2 released) re-runs round 2
    as a provable re-send: the same ε as the uninterrupted run, no budget spent twice, none forgotten."""
    dp = {"client": {"dp": {"noise_multiplier": 1.0, "target_epsilon": 30.0}},
          "engine": {"store": "memory", "threads": 1}}  # every client state inside the checkpoint
    run_experiment(toy_config(**dp, federation={"rounds": 3}), tmp_path / "whole", show_progress=False)
    run = tmp_path / "run"
    run_experiment(toy_config(**dp, federation={"rounds": 1}), run, show_progress=False)
    round_one = (run / "checkpoint.pt").read_bytes()
    run_experiment(toy_config(**dp, federation={"rounds": 2}), run, resume=True, show_progress=False)
    text = repr(torch.load(run / "checkpoint.pt", weights_only=True))
    assert "epsilon" not in text and "noise_multiplier" not in text  # no accountant kept there
    (run / "checkpoint.pt").write_bytes(round_one)
    run_experiment(toy_config(**dp, federation={"rounds": 3}), run, resume=True, show_progress=False)

    def privacy(path):
        return [{c: e["privacy"] for c, e in r["clients"].items()} for r in rounds_of(path)]
    assert privacy(run) == privacy(tmp_path / "whole")
    assert all(e > 0 for r in privacy(run) for e in (p["epsilon"] for p in r.values()))


# ---- EX03 / EX03c: export takes only this run's finite best.pt, and writes nothing otherwise

@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    for name in ("run", "other"):
        run_experiment(lora_config(rounds=1), root / name, show_progress=False)
    return root


def _export(run: Path, out: Path, capsys) -> tuple[int, str]:
    rc = main(["export", str(run), "--out", str(out)])
    return rc, capsys.readouterr().err


def test_export_refuses_a_best_pt_holding_nan_naming_the_file_and_tensor(lora_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_runs / "run", run)
    state = torch.load(run / "best.pt", weights_only=True)
    name = next(k for k, t in state["server"]["params"].items() if t.is_floating_point())
    state["server"]["params"][name].view(-1)[:3] = float("nan")
    torch.save(state, run / "best.pt")
    rc, err = _export(run, tmp_path / "adapter", capsys)
    line = one_error_line(err)
    assert rc == 2 and f"{run / 'best.pt'}: tensor {name!r} holds 3 NaN/Inf values" in line
    assert not (tmp_path / "adapter").exists()


def test_export_refuses_another_runs_best_pt(lora_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_runs / "run", run)
    shutil.copy(lora_runs / "other" / "best.pt", run / "best.pt")  # same config, another run
    rc, err = _export(run, tmp_path / "adapter", capsys)
    assert rc == 2 and f"{run / 'best.pt'} belongs to another run" in one_error_line(err)
    assert not (tmp_path / "adapter").exists()
    state = torch.load(lora_runs / "run" / "best.pt", weights_only=True)
    state["config"] = "0" * 64  # this run's id, another config's hash
    torch.save(state, run / "best.pt")
    rc, err = _export(run, tmp_path / "adapter", capsys)
    assert rc == 2 and "was trained under another config" in one_error_line(err)
    assert not (tmp_path / "adapter").exists()
    shutil.copy(lora_runs / "run" / "best.pt", run / "best.pt")  # its own: exported
    assert _export(run, tmp_path / "adapter", capsys)[0] == 0 and (tmp_path / "adapter" / "adapter_config.json").is_file()


# ---- DP01 / DP11: a target no σ reaches is refused naming the smallest ε; a recorded ε is never negative

def test_epsilon_is_never_negative_and_the_floor_is_the_conversions_limit():
    from fedsilo.privacy.accountant import smallest_epsilon

    huge = Budget(1e5, 1.0, 1 / 80)
    huge.spend(1)
    assert huge.epsilon() == 0.0  # Opacus's conversion gives a negative bound for δ > 1/256: (0, δ) holds
    assert smallest_epsilon(1 / 80) == 0.0
    tight = Budget(1e5, 1.0, 1e-5)
    tight.spend(1)
    assert smallest_epsilon(1e-5) == pytest.approx(tight.epsilon(), rel=1e-6) and smallest_epsilon(1e-5) > 0.019


def test_a_tiny_dp_sgd_target_records_no_negative_epsilon(tmp_path):
    run_experiment(toy_config(client={"dp": {"target_epsilon": 0.005}}, federation={"rounds": 1}), tmp_path / "run",
                   show_progress=False)
    eps = [e["privacy"]["epsilon"] for r in rounds_of(tmp_path / "run") for e in r["clients"].values()]
    assert len(eps) == 3 and all(0.0 <= e <= 0.005 for e in eps)


def _config_file(tmp_path: Path, **sections) -> Path:
    """A valid toy config with `sections` laid over it, written as TOML without validating the result."""
    import tomli_w

    raw = toy_config(federation={"rounds": 1}).model_dump(exclude_none=True, mode="json")
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "cfg.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


@pytest.mark.parametrize("sections,culprit", [
    ({"federation": {"rounds": 1, "silo_dp": {"clip": 1.0, "target_epsilon": 0.01}}},
     "federation.silo_dp: target_epsilon = 0.01 cannot be reached at δ = 1e-05: even unbounded noise leaves ε = 0.01949"),
    ({"client": {"dp": {"target_epsilon": 0.001, "delta": 1e-3}}},
     "target_epsilon = 0.001 cannot be reached at δ = 0.001"),
    ({"task": {"n_train": 100}, "client": {"dp": {"target_epsilon": 0.001}}},  # δ = 1/(10·n): known per silo
     "silo alpha's dp (n = 100 examples): target_epsilon = 0.001 cannot be reached at δ = 0.001"),
], ids=["silo-level", "dp-sgd, delta given", "dp-sgd, delta from the silo's size"])
def test_an_unreachable_target_is_one_line_naming_it_and_the_smallest_reachable_epsilon(tmp_path, capsys, sections,
                                                                                        culprit):
    config = _config_file(tmp_path, **sections)
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert culprit in line and "set target_epsilon above" in line
    assert not (tmp_path / "run" / "rounds.jsonl").exists()


# ---- PO03c: a policy's integer fields take integers only

INT_FIELDS = [name for name, f in SiloPolicy.model_fields.items() if int in typing.get_args(f.annotation)
              or f.annotation is int]


@pytest.mark.parametrize("value", ["true", "1.0", '"3"'])
@pytest.mark.parametrize("field", INT_FIELDS)
def test_a_policys_integer_field_refuses_a_bool_a_float_and_a_string(tmp_path, field, value):
    path = tmp_path / "policy.toml"
    path.write_text(f"{field} = {value}\n")
    with pytest.raises(ConfigError, match=rf"silo policy {path.resolve()}: {field}: Input should be a valid integer"):
        read_policy(path)


def test_max_rounds_true_is_one_line_from_the_cli(tmp_path, capsys):
    assert "max_rounds" in INT_FIELDS  # the field list the test above covers is found from the model
    policy = tmp_path / "gamma.toml"
    policy.write_text("max_rounds = true\n")
    config = _config_file(tmp_path)
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--policy", f"gamma={policy}"]) == 2
    assert f"silo policy {policy.resolve()}: max_rounds" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "rounds.jsonl").exists()
