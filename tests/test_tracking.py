"""Runs and studies mirrored into MLflow and TensorBoard, read back with their own readers: MLflow's
client (parameters, per-step metrics, nested runs, artifacts) and TensorBoard's EventAccumulator."""
import json
import math

import pytest

from fedsilo.cli import main
from fedsilo.config import ConfigError, validate
from fedsilo.config import config_warnings
from fedsilo.rundir.layout import config_hash
from fedsilo.runs.runner import run_experiment
from fedsilo.tracking.metrics import result_metrics, round_metrics
from tests.synth import tiny_config, write_silos

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def mlflow_run(run_dir):
    """(client, run) of the MLflow run a run directory's tracking.json names."""
    state = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


def scalars(folder, key):
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def artifacts(client, run_id, path=None):
    """Every artifact file's path under `path`, folders opened."""
    out = []
    for item in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return out


# ---- names: numbers only, one name per number ---------------------------------------------------

def test_a_round_record_becomes_numbers_under_the_documented_names_and_no_string_leaves():
    record = {"round": 4, "applied": True, "bytes_up": 1200, "seconds": 2.5, "sampled": ["a/b", "c"],
              "missing_reasons": {"c": "SECRET reply text"},
              "clients": {"a/b": {"mean_loss": 0.75, "weight": 0.5, "phase_seconds": {"training": 1.25},
                                  "privacy": {"epsilon": 3.5, "delta": 1e-5}, "refused": "SECRET why"}},
              "dev": {"score": 0.4, "macro": {"em": 0.4, "loss": None},
                      "rows": [{"client": "a/b", "metrics": {"em": 0.3}, "stats": {"n": 10}}]}}
    metrics = round_metrics(record)
    assert metrics == {"round": 4.0, "applied": 1.0, "bytes_up": 1200.0, "seconds": 2.5,
                       "silo/a_b/mean_loss": 0.75, "silo/a_b/weight": 0.5, "silo/a_b/phase_seconds/training": 1.25,
                       "silo/a_b/privacy/epsilon": 3.5, "silo/a_b/privacy/delta": 1e-5,
                       "dev/em": 0.4, "dev/score": 0.4, "silo/a_b/dev/em": 0.3}
    results = {"rounds": 4, "wall_seconds": 9.0, "best_round": 3, "best_dev": 0.4,
               "test": {"score": 0.5, "macro": {"em": 0.5}, "rows": [{"client": "a/b", "metrics": {"em": 0.5}}]},
               "privacy": {"a/b": {"epsilon": 3.5, "round": 4}}}
    assert result_metrics(results) == {"test/em": 0.5, "test/score": 0.5, "silo/a_b/test/em": 0.5,
                                       "silo/a_b/privacy/epsilon": 3.5, "silo/a_b/privacy/round": 4.0,
                                       "best_round": 3.0, "best_dev": 0.4, "wall_seconds": 9.0}


def test_the_tracking_section_is_validated_like_every_other(tmp_path):
    raw = tiny_config(tmp_path)
    with pytest.raises(ConfigError, match=r"tracking.backend: 'wandb' is not a choice: 'off', 'both', 'mlflow'"):
        validate({**raw, "tracking": {"backend": "wandb"}})
    with pytest.raises(ConfigError, match="tracking.uri: must not be empty"):
        validate({**raw, "tracking": {"backend": "mlflow", "uri": " "}})
    with pytest.raises(ConfigError, match="tracking.colour: unknown key"):
        validate({**raw, "tracking": {"colour": "blue"}})
    cfg = validate({**raw, "tracking": {"backend": "tensorboard", "uri": "http://x:5000"}})
    assert cfg.tracking.backends == ("tensorboard",)
    assert any("tracking.uri = \"http://x:5000\" has no effect" in w for w in config_warnings(cfg))
    assert validate({**raw, "tracking": {"backend": "both"}}).tracking.backends == ("mlflow", "tensorboard")
    # where a run is mirrored is not what it trains: a resume may turn tracking on
    assert config_hash(validate(raw)) == config_hash(validate({**raw, "tracking": {"backend": "both"}}))


def test_a_tracker_whose_package_is_missing_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fedsilo.tracking.settings.PACKAGES", {"mlflow": "no_such_package_xyz", "tensorboard": "x"})
    (tmp_path / "c.toml").write_text('name = "t"\n')
    assert main(["run", str(tmp_path / "c.toml"), "--tracking", "mlflow", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("fedsilo: error: tracking.backend = 'mlflow' needs the no_such_package_xyz package, which this "
                       "Python lacks: pip install 'fedsilo[tracking]' (or --tracking off)")
    assert not (tmp_path / "r").exists()


# ---- one run, tracked in both, then resumed ------------------------------------------------------

@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-round run with tracking = both, resumed to 3 rounds: (run dir, its results after each part)."""
    root = tmp_path_factory.mktemp("tracked")
    data = write_silos(root / "data")
    run = root / "runs" / "r"
    first = run_experiment(validate(tiny_config(data, tracking={"backend": "both"})), run, show_progress=False)
    rounds3 = tiny_config(data, tracking={"backend": "both", "export": True}, federation={"rounds": 3})
    again = run_experiment(validate(rounds3), run, resume=True, show_progress=False)
    return run, first, again, validate(rounds3)


def test_a_run_logs_its_config_tags_and_every_round_once_in_mlflow(tracked):
    run, first, again, cfg = tracked
    client, logged = mlflow_run(run)
    assert logged.info.status == "FINISHED" and logged.info.run_name == "r"
    assert logged.data.params["federation.weighting"] == "lorar" and logged.data.params["client.lr"] == "0.01"
    assert logged.data.params["task.silos"] == json.dumps(["restaurants", "academic", "yelp"])
    assert logged.data.params["federation.rounds"] == "2"  # as started: MLflow never changes a parameter
    tags = logged.data.tags
    assert tags["fedsilo.resumed_with.federation.rounds"] == "3"
    assert tags["fedsilo.config_hash"] == config_hash(cfg) and tags["fedsilo.run_dir"] == str(run.resolve())
    assert tags["fedsilo.version"] and tags["fedsilo.task"] == "text2sql"
    assert (run / "tracking.json").exists() and json.loads((run / "tracking.json").read_text())["mlflow"][
        "tracking_uri"] == f"sqlite:///{run.parent.resolve() / 'mlflow.db'}"  # beside the run: `mlflow ui` there
    # the resume continued the same MLflow run: one run in the experiment, every round once
    assert len(client.search_runs([logged.info.experiment_id])) == 1
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert steps(client, logged.info.run_id, "round") == [1, 2, 3]
    for silo in ("restaurants", "academic", "yelp"):
        history = client.get_metric_history(logged.info.run_id, f"silo/{silo}/mean_loss")
        assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["clients"][silo]["mean_loss"]))
                                                        for r in rounds]
        assert steps(client, logged.info.run_id, f"silo/{silo}/phase_seconds/training") == [1, 2, 3]
    bytes_up = client.get_metric_history(logged.info.run_id, "bytes_up")
    assert [m.value for m in bytes_up] == [r["bytes_up"] for r in rounds]
    # the final results, once per finished length (2 rounds, then 3)
    test = client.get_metric_history(logged.info.run_id, "test/em")
    assert [(m.step, m.value) for m in test] == [(2, pytest.approx(first["test"]["macro"]["em"])),
                                                 (3, pytest.approx(again["test"]["macro"]["em"]))]


def test_a_run_logs_its_report_plots_and_results_as_artifacts(tracked):
    run, _, again, _ = tracked
    client, logged = mlflow_run(run)
    files = artifacts(client, logged.info.run_id)
    assert {"report.md", "results.json"} <= set(files)
    assert sorted(f for f in files if f.startswith("plots/")) == sorted(
        f"plots/{p.name}" for p in (run / "plots").iterdir())
    local = client.download_artifacts(logged.info.run_id, "results.json", str(run.parent / "dl"))
    assert json.loads(open(local).read()) == again
    # tracking.export (turned on for the resume): the model as `fedsilo export` writes it, the best round's weights
    assert {"model/global/model.safetensors", "model/global/config.json", "model/global/README.md"} <= set(files)
    from safetensors.torch import load_file
    exported = load_file(client.download_artifacts(logged.info.run_id, "model/global/model.safetensors",
                                                   str(run.parent / "dl2")))
    import torch
    best = torch.load(run / "best.pt", weights_only=True)["server"]["params"]
    name = next(k for k in best if k.endswith("lm_head.weight") or "shared" in k)
    assert torch.equal(exported[name], best[name])


def test_a_run_writes_tensorboard_scalars_per_silo_each_round_once(tracked):
    run, _, again, _ = tracked
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    folder = run / "tensorboard"
    assert [s for s, _ in scalars(folder, "round")] == [1, 2, 3]  # the resume's file purged the first one's
    for silo in ("restaurants", "academic", "yelp"):
        assert scalars(folder, f"silo/{silo}/weight") == [
            (r["round"], pytest.approx(r["clients"][silo]["weight"])) for r in rounds]
    dev = [(r["round"], r["dev"]["score"]) for r in rounds]
    assert scalars(folder, "dev/score") == [(s, pytest.approx(v)) for s, v in dev]
    assert scalars(folder, "test/em") == [(3, pytest.approx(again["test"]["macro"]["em"]))]


def test_an_unreachable_tracking_server_is_one_warning_and_fedsilo_track_logs_it_later(tmp_path, capsys, monkeypatch):
    """A server that refuses connections: the run finishes with its files complete and one warning;
    `fedsilo track` then gives a store everything the run directory holds."""
    from fedsilo.engines.flower.deploy import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    data = write_silos(tmp_path / "data")
    run = tmp_path / "runs" / "r"
    cfg = validate(tiny_config(data, federation={"rounds": 1},
                               tracking={"backend": "mlflow", "uri": f"http://127.0.0.1:{free_port()}"}))
    results = run_experiment(cfg, run, show_progress=False)
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "tracking: mlflow could not" in line]
    assert len(warned) == 1 and "the run goes on without mlflow" in warned[0]
    assert (run / "results.json").exists() and (run / "report.md").exists() and results["rounds"] == 1
    store = f"sqlite:///{tmp_path / 'later.db'}"
    assert main(["track", str(run), "--set", f"tracking.uri={store}"]) == 0
    client, logged = mlflow_run(run)
    assert logged.info.status == "FINISHED" and steps(client, logged.info.run_id, "round") == [1]
    assert client.get_metric_history(logged.info.run_id, "test/em")[0].value == pytest.approx(
        results["test"]["macro"]["em"])
    assert main(["track", str(run), "--set", "federation.rounds=4"]) == 2
    assert "changes only the [tracking] section" in capsys.readouterr().err


# ---- a study: one parent run, one nested run per variant and seed --------------------------------

def test_a_study_is_a_parent_run_with_each_variant_and_seed_nested_and_its_claims(tmp_path):
    from fedsilo.runs.study import run_study
    from tests.test_study import STUDY

    text = (STUDY.replace("[variants.equal]\nfederation = {weighting = \"equal\"}\n", "")
            .replace("rounds = 2", "rounds = 1") + "[base.tracking]\nbackend = \"both\"\n")
    text = text.replace("[base.task]\n", "[base.task]\nsilos = [\"alpha\", \"beta\"]\n")
    (tmp_path / "s.toml").write_text(text)
    out = tmp_path / "study"
    study = run_study(tmp_path / "s.toml", out, show_progress=False, seeds=[0, 1])
    client, parent = mlflow_run(out)
    assert parent.info.run_name == "toy-study" and parent.info.status == "FINISHED"
    assert parent.data.params["study.seeds"] == "[0, 1]" and parent.data.params["study.baseline"] == "alone"
    pid = parent.info.run_id
    nested = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{pid}'")
    assert sorted(r.info.run_name for r in nested) == ["alone seed 0", "alone seed 1", "fedavg seed 0",
                                                        "fedavg seed 1"]
    for r in nested:
        variant, seed = r.data.tags["fedsilo.variant"], r.data.tags["fedsilo.seed"]
        assert r.info.run_name == f"{variant} seed {seed}"
        assert r.data.tags["fedsilo.run_dir"] == str((out / variant / f"seed-{seed}").resolve())
        if variant == "alone":  # each silo trained alone: one run each, nested under the variant's
            silos = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{r.info.run_id}'")
            assert sorted(s.info.run_name for s in silos) == ["alpha", "beta"]
            assert all(steps(client, s.info.run_id, "round") == [1] for s in silos)
    # the comparison on the parent: each variant's mean over seeds, the table, the claims, the files
    for variant in ("alone", "fedavg"):
        per_seed = [study["per_seed"][variant][s]["overall"]["map"] for s in ("0", "1")]
        assert parent.data.metrics[f"{variant}/map"] == pytest.approx(sum(per_seed) / 2)
    files = set(artifacts(client, pid))
    assert {"report.md", "study.json", "study_table.md", "claims.md"} <= files
    claims = open(client.download_artifacts(pid, "claims.md", str(tmp_path / "dl"))).read()
    assert study["checks"] and all(line in claims for line in study["checks"])
    assert not math.isnan(parent.data.metrics["fedavg/map"])
    # the study again: every run is finished, so nothing is logged twice, in the parent or a nested run
    run_study(tmp_path / "s.toml", out, show_progress=False, seeds=[0, 1])
    assert [m.step for m in client.get_metric_history(pid, "fedavg/map")] == [4]  # 4 runs compared
    runs = client.search_runs([parent.info.experiment_id])
    assert len(runs) == 1 + 4 + 2 * 2  # the study, its 4 runs, the alone runs' 2 silos each
    rounds = {r.info.run_name: steps(client, r.info.run_id, "round") for r in runs if r.info.run_id != pid}
    assert all(rounds[f"fedavg seed {s}"] == [1] and rounds[f"alone seed {s}"] == [] for s in (0, 1))
    assert [rounds[name] for name in ("alpha", "beta")] == [[1], [1]]  # (names repeat per seed: the last seen)
    assert all(steps(client, r.info.run_id, "round") in ([1], []) for r in runs)
    # TensorBoard: each run its own folder under the study, the study's table as text
    assert [s for s, _ in scalars(out / "fedavg" / "seed-1" / "tensorboard", "round")] == [1]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "study_table.md/text_summary" in events.Tags()["tensors"]
