"""A run never looks finished when it failed, and resume never trusts inconsistent state (issue 23,
docs/reliability.md): a diverged run stays failed (also in a study), resume refuses NaN optimiser
state, fewer rounds than done and a deployment's run directory, recovers a deleted run id; worker
counts may change on resume and checkpoint the same thing; bad names and counts are one line."""
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.config import ConfigError, load_config, validate
from fedsilo.runs.studyfile import load_study
from tests.test_bad_input import fails, toy_file
from tests.test_plugins import rounds_of, toy_config
from tests.test_study import STUDY


def ok(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory (bytes) but its lock: what a refused resume must leave as it was."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def two_round_run(tmp_path_factory) -> tuple[Path, Path]:
    """(config file, run directory) of a finished two-round toy run, copied by the tests that resume it."""
    tmp = tmp_path_factory.mktemp("two")
    config = toy_file(tmp, federation={"rounds": 2})
    assert main(["run", str(config), "--out", str(tmp / "run"), "--no-progress"]) == 0
    return config, tmp / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


# --- 1. a diverged run stays failed ---

def test_a_diverged_run_stays_failed_on_resume(tmp_path, capsys):
    config = toy_file(tmp_path, federation={"rounds": 3}, server={"lr": 1e30})
    out = str(tmp_path / "run")
    first = fails(capsys, "run", str(config), "--out", out, "--no-progress", culprit="rounds 1-3 applied no update")
    assert json.loads((tmp_path / "run" / "failed.json").read_text())["reason"] in first
    before = snapshot(tmp_path / "run")
    for more in ([], ["--set", "federation.rounds=4"], ["--set", "engine.threads=1"]):
        again = fails(capsys, "run", str(config), "--out", out, "--resume", "--no-progress", *more,
                      culprit="rounds 1-3 applied no update")
        assert "another --out" in again and "do not clear it" in again and "failed.json" in again
        assert snapshot(tmp_path / "run") == before  # no results.json, nothing rewritten
    # a fresh run into the same folder is refused too: it would leave the failure behind
    fails(capsys, "run", str(config), "--out", out, "--no-progress", culprit="already holds a run")


def test_only_a_run_that_diverged_is_recorded_as_failed():
    """Rounds in which no silo answered (a deployment's network) fail the run, but a resume may retry."""
    from fedsilo.runs.runner import RunFailed, _check_progress

    cfg = toy_config(federation={"rounds": 5})
    unreachable = [{"round": r, "applied": False, "clients": {}, "missing": ["alpha"],
                    "missing_reasons": {"alpha": "no reply"}} for r in (1, 2, 3)]
    rejected = [{"round": r, "applied": False, "clients": {"alpha": {"rejected": "non-finite values"}}}
                for r in (1, 2, 3)]
    for logged, lasting in ((unreachable, False), (rejected, True)):
        with pytest.raises(RunFailed, match="rounds 1-3 applied no update") as err:
            _check_progress(cfg, logged, 5)
        assert err.value.lasting is lasting


def test_a_study_shows_a_diverged_variant_as_failed_and_exits_2(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace("[variants.alone]\nparadigm = \"finetune\"\n",
                                  "[variants.diverged]\nserver = {lr = 1e30}\n"))
    out = tmp_path / "study"
    for attempt in range(2):  # the second time it resumes every variant
        line = fails(capsys, "study", str(path), "--out", str(out), "--no-progress", "--set", "federation.rounds=1",
                     culprit="diverged")
        assert "1 of 3 runs failed" in line and "applied no update" in line
        study = json.loads((out / "study.json").read_text())
        assert [row[0] for row in study["table"][1:]] == ["fedavg", "equal", "diverged"]
        assert study["table"][-1][1:] == ["failed"] * 4 and "applied no update" in study["failed"]["diverged"]["5"]
        assert "diverged" not in study["per_seed"] and "diverged" not in study["costs"]
        assert "| diverged | failed |" in (out / "report.md").read_text()
        assert not (out / "diverged" / "results.json").exists()


# --- 2. NaN/Inf server optimiser state ---

def test_resume_refuses_nan_server_optimiser_state(tmp_path, capsys):
    config = toy_file(tmp_path, server={"optimizer": "adam"})
    run = tmp_path / "run"
    ok(capsys, "run", str(config), "--out", str(run), "--no-progress")
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    moments = next(iter(state["server"]["optimizer"]["state"].values()))
    moments["v"].view(-1)[0] = float("inf")
    torch.save(state, run / "checkpoint.pt")
    before = snapshot(run)
    line = fails(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                 "--set", "federation.rounds=2", culprit="server optimiser state")
    assert "NaN/Inf" in line and "checkpoint.pt" in line
    assert snapshot(run) == before


# --- 3. fewer rounds than done ---

def test_resume_with_fewer_rounds_than_done_is_refused_before_writing(two_round_run, tmp_path, capsys):
    config, done = two_round_run
    run = copy_of(done, tmp_path)
    before = snapshot(run)
    line = fails(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                 "--set", "federation.rounds=1", culprit="completed 2 rounds")
    assert "federation.rounds" in line and str(run) in line
    assert snapshot(run) == before


def test_a_finetune_run_refuses_fewer_rounds_before_writing(tmp_path, capsys):
    config = toy_file(tmp_path, paradigm="finetune", federation={"rounds": 2})
    run = tmp_path / "run"
    ok(capsys, "run", str(config), "--out", str(run), "--no-progress")
    before = snapshot(run)
    fails(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
          "--set", "federation.rounds=1", culprit="completed 2 rounds")
    assert snapshot(run) == before  # the top config.toml too


# --- 4. a deployment's run directory resumed locally ---

def test_local_resume_of_a_deployments_run_directory_is_one_line(two_round_run, tmp_path, capsys):
    config, done = two_round_run
    run = copy_of(done, tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["clients"] = {"store": {"kind": "flower", "round": 2}}  # what FlowerEngine.state_dict writes
    torch.save(state, run / "checkpoint.pt")
    before = snapshot(run)
    line = fails(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                 "--set", "federation.rounds=3", culprit="Flower deployment")
    assert "fedsilo deploy" in line and "--resume" in line and "memory store" not in line
    assert snapshot(run) == before


# --- 5. engine.workers may change on resume ---

def test_engine_workers_may_change_on_resume(tmp_path):
    from fedsilo.runs.runner import run_experiment

    run = tmp_path / "run"
    run_experiment(toy_config(engine={"workers": 2}, federation={"rounds": 1}), run, show_progress=False)
    run_experiment(toy_config(engine={"workers": 1}, federation={"rounds": 2}), run, resume=True,
                   show_progress=False)
    assert [r["compute"]["workers"] for r in rounds_of(run)] == [2, 1]
    assert "workers = 1" in (run / "config.toml").read_text()


# --- 6. engine.workers must be a count ---

@pytest.mark.parametrize("value", ["true", "1.0", '"2"', "0", '"all"'])
def test_engine_workers_must_be_a_count_on_every_path(tmp_path, value):
    config = toy_file(tmp_path)
    text = config.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('workers = "auto"', f"workers = {value}"))
    assert f"workers = {value}" in bad.read_text()
    with pytest.raises(ConfigError, match=r"engine\.workers"):
        load_config(bad)  # the TOML file
    with pytest.raises(ConfigError, match=r"engine\.workers"):
        load_config(config, [f"engine.workers={value}"])  # --set
    study = tmp_path / "s.toml"
    study.write_text(STUDY + f"\n[variants.bad]\nengine = {{workers = {value}}}\n")
    with pytest.raises(ConfigError, match=r"variants\.bad.*engine\.workers"):
        load_study(study)  # a study variant


def test_engine_workers_true_is_one_line_from_the_cli(tmp_path, capsys):
    fails(capsys, "run", str(toy_file(tmp_path)), "--out", str(tmp_path / "run"), "--set", "engine.workers=true",
          culprit="engine.workers")
    assert not (tmp_path / "run").exists()


# --- 7. study variant names ---

@pytest.mark.parametrize("name", ["../../escaped", "a/b", "..", ".hidden", "a\\\\b", ""])
def test_study_variant_names_must_be_plain(tmp_path, capsys, name):
    path = tmp_path / "s.toml"
    path.write_text(STUDY + f'\n[variants."{name}"]\n')
    out = tmp_path / "a" / "b" / "study"
    line = fails(capsys, "study", str(path), "--out", str(out), "--no-progress", culprit="not a plain name")
    assert repr(name.replace("\\\\", "\\")) in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["s.toml"]  # nothing written, inside --out or out


# --- 8. a deleted run_id ---

def test_a_deleted_run_id_is_recovered_from_the_checkpoint(two_round_run, tmp_path, capsys):
    config, done = two_round_run
    run = copy_of(done, tmp_path)
    run_id = (run / "run_id").read_text()
    (run / "run_id").unlink()
    ok(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress", "--set", "federation.rounds=3")
    assert (run / "run_id").read_text() == run_id
    assert [r["round"] for r in rounds_of(run)] == [1, 2, 3]


def test_a_finished_run_kept_without_its_checkpoint_reports_its_results(two_round_run, tmp_path, capsys):
    """bench/results keeps only results.json, rounds.jsonl and config.toml in git: a re-run of the study
    on another machine reads them back; before, the resume trained from scratch over the kept rounds."""
    config, done = two_round_run
    run = copy_of(done, tmp_path)
    for name in set(p.name for p in run.iterdir()) - {"results.json", "rounds.jsonl", "config.toml"}:
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    kept = snapshot(run)
    err = ok(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress")
    assert "no checkpoint): results as recorded" in err
    assert {k: v for k, v in snapshot(run).items() if k in kept} == kept  # the records as they were
    line = fails(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                 "--set", "federation.rounds=3", culprit="no checkpoint.pt to continue to 3 from")
    assert str(run) in line and [r["round"] for r in rounds_of(run)] == [1, 2]


# --- 9. upload option errors name the full path ---

@pytest.mark.parametrize("options, where", [({"share": 1.5}, "exchange.upload_options.share: "),
                                            ({"sharez": 1}, "exchange.upload_options.sharez: unknown key")])
def test_upload_option_errors_name_the_full_path(options, where):
    with pytest.raises(ConfigError) as err:
        validate({"exchange": {"upload": "dp_l", "upload_options": options}})
    assert f"config: {where}" in str(err.value)
    with pytest.raises(ConfigError, match=r"exchange\.upload_options: the upload selector 'all' takes no options"):
        validate({"exchange": {"upload": "all", "upload_options": options}})


# --- 10. workers checkpoint what a sequential run checkpoints ---

def test_workers_checkpoint_the_uploaded_names_in_the_sequential_order(tmp_path):
    from fedsilo.runs.runner import run_experiment

    states = {}
    for workers in (1, 2):
        cfg = toy_config(engine={"workers": workers, "store": "memory"}, federation={"rounds": 1},
                         exchange={"private": ["*classifier*"]})
        run_experiment(cfg, tmp_path / f"w{workers}", show_progress=False)
        states[workers] = torch.load(tmp_path / f"w{workers}" / "checkpoint.pt", weights_only=True)

    def order(x):  # every key, in order, of a nested checkpoint
        return [(k, order(v)) for k, v in x.items()] if isinstance(x, dict) else None

    assert states[1]["server"]["uploaded"] == states[2]["server"]["uploaded"]
    assert list(states[1]["server"]["uploaded"]) == list(states[2]["server"]["uploaded"])
    assert order(states[1]) == order(states[2])


# --- 11. a killed worker process ---

def test_a_killed_worker_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    from fedsilo.client.silo import SiloClient

    config = toy_file(tmp_path, federation={"rounds": 2}, engine={"workers": 2})
    parent, fit = os.getpid(), SiloClient.fit

    def killed_in_round_two(self, round_idx, *args, **kwargs):
        if os.getpid() != parent and round_idx == 2 and self.name == "beta":
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return fit(self, round_idx, *args, **kwargs)

    monkeypatch.setattr(SiloClient, "fit", killed_in_round_two)  # forked workers inherit it
    run = tmp_path / "run"
    line = fails(capsys, "run", str(config), "--out", str(run), "--no-progress", culprit="worker process")
    assert "round 2" in line and "--resume" in line and "engine.workers=1" in line
    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 1
    assert not (run / "failed.json").exists()  # not the run's fault: it resumes
    ok(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress", "--set", "engine.workers=1")
    assert [r["round"] for r in rounds_of(run)] == [1, 2]
