"""The same config on the in-process engine and on Flower gives the same run."""
import json
import os
import time

import pytest
import torch

from fedsilo.config import validate
from fedsilo.runs.runner import run_experiment
from tests.synth import tiny_config, write_silos

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"


# Each silo keeps its decoder feed-forward layer private (a FedPer-style split), so the Flower runs
# also exercise private tensors kept on the silos' disks across rounds and used in evaluation.
PRIVATE = {"exchange": {"private": ["decoder.block.*.layer.2.*"]}}


def flower_config(data_dir, **sections):
    return tiny_config(data_dir, **PRIVATE, **sections)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_silos(tmp_path_factory.mktemp("t2s"))


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, data_dir):
    """The reference: in-process, one torch thread (as each Flower ClientApp gets), 2 rounds."""
    out = tmp_path_factory.mktemp("local") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(validate(flower_config(data_dir)), out, show_progress=False)
    finally:
        torch.set_num_threads(threads)
    return out


def rounds_of(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def assert_same_run(a, b):
    ra, rb = rounds_of(a), rounds_of(b)
    assert [r["round"] for r in ra] == [r["round"] for r in rb]
    for x, y in zip(ra, rb):
        assert set(x["clients"]) == set(y["clients"])
        for c in x["clients"]:
            assert y["clients"][c]["weight"] == pytest.approx(x["clients"][c]["weight"], rel=1e-6)
            assert y["clients"][c]["bytes_up"] == x["clients"][c]["bytes_up"]
    pa = torch.load(a / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(b / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
    ta = json.loads((a / "results.json").read_text())["test"]
    tb = json.loads((b / "results.json").read_text())["test"]
    assert [r["client"] for r in tb["rows"]] == [r["client"] for r in ta["rows"]]
    for x, y in zip(ta["rows"], tb["rows"]):
        assert y["metrics"]["em"] == x["metrics"]["em"]
        assert y["metrics"]["loss"] == pytest.approx(x["metrics"]["loss"], rel=1e-5)


def assert_bytes_agree(run):
    """The bytes Flower carried per round and client vs fedsilo's own count: within 5%."""
    for r in rounds_of(run):
        assert r["missing"] == []
        for c in r["clients"].values():
            assert abs(c["flower_bytes_up"] - c["bytes_up"]) <= 0.05 * c["bytes_up"]
            assert abs(c["flower_bytes_down"] - c["bytes_down"]) <= 0.05 * c["bytes_down"]


@pytest.mark.ray_actor_per_core
def test_flower_simulation_matches_in_process(tmp_path, data_dir, local_run):
    from fedsilo.runs.flower import run_simulation

    out = tmp_path / "sim"
    run_simulation(validate(flower_config(data_dir)), out, show_progress=False)
    assert_same_run(local_run, out)
    assert_bytes_agree(out)


def _client_texts(data_dir, silos):
    """Every question and SQL string (raw and normalised) a silo holds."""
    from fedsilo.tasks.text2sql.data import load_silo
    texts = set()
    for silo in silos:
        for split in load_silo(data_dir, silo).values():
            for e in split:
                texts |= {e.question, e.sql, e.source}
    raw = json.loads((data_dir / "yelp.json").read_text())
    texts |= {r["sql"][0] for r in raw} | {s["text"] for r in raw for s in r["sentences"]}
    return texts


def test_deployment_matches_in_process_and_carries_no_client_text(tmp_path, data_dir, local_run):
    """Also tracked (MLflow and TensorBoard, server side): no tracked file holds a silo's text either."""
    from fedsilo.config import to_toml
    from fedsilo.engines.flower.deploy import LocalDeployment, silo_nodes
    from tests.wiretap import Wiretap

    cfg = validate(flower_config(data_dir, tracking={"backend": "both"}))
    config = tmp_path / "exp.toml"
    config.write_text(to_toml(cfg))
    silos = silo_nodes(cfg.task, data_dir)
    dep = LocalDeployment(tmp_path / "fl", silos)
    tap = Wiretap(dep.port)
    dep.fleet_port = tap.port  # SuperNodes talk to the SuperLink through the recording relay
    with dep:
        assert len(dep.pids()) >= 4  # a SuperLink and 3 SuperNodes
        dep.run(config, tmp_path / "run", timeout=600)
    tap.close()
    assert dep.pids() == []  # nothing left behind

    assert_same_run(local_run, tmp_path / "run")
    assert_bytes_agree(tmp_path / "run")
    # private tensors never reached the server; each silo kept its own in its store on its disk,
    # the same store the in-process engine keeps in the run directory
    from fedsilo.client.store import DiskStore

    run_id = (tmp_path / "run" / "run_id").read_text()
    server_params = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert not any(".layer.2." in k and k.startswith("decoder") for k in server_params)
    local = DiskStore(local_run / "clients")
    local.set_round(2)
    for silo in cfg.task.silos:
        remote = DiskStore(tmp_path / "fl" / "state" / silo / run_id)
        remote.set_round(2)
        on_disk, expected = remote.get(silo).slot("own"), local.get(silo).slot("own")
        assert on_disk.keys() == expected.keys() and len(expected) == 3  # wi, wo, layer norm
        for k in expected:
            torch.testing.assert_close(on_disk[k], expected[k], rtol=1e-6, atol=1e-7)
    streams = tap.captured()
    assert sum(len(s) for s in streams) > 3 * 2 * 1_000_000  # the model went down and up
    assert any(b"delta_loss" in s for s in streams)  # the capture is readable (not compressed)
    texts = _client_texts(data_dir, cfg.task.silos)
    leaked = [t for t in texts if any(t.encode() in s for s in streams)]
    assert leaked == []
    # what the ServerApp tracked: the MLflow store and its artifacts beside the run, the TensorBoard events
    tracked = [p for p in [tmp_path / "mlflow.db", *(tmp_path / "mlartifacts").rglob("*"),
                           *(tmp_path / "run" / "tensorboard").rglob("*")] if p.is_file()]
    names = {p.name for p in tracked}
    assert "mlflow.db" in names and {"report.md", "results.json"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)
    blobs = [p.read_bytes() for p in tracked]
    assert any(b"silo/yelp/mean_loss" in b for b in blobs)  # the files are searchable as they are
    assert [t for t in texts if any(t.encode() in b for b in blobs)] == []
    assert not (tmp_path / "fl" / "state" / "mlflow.db").exists()  # the silos track nothing


def test_a_supernode_killed_mid_run_is_recorded_missing(tmp_path, data_dir):
    """Kill yelp's SuperNode once round 1 is logged. No `round_timeout`: every wait is on an event.

    The live silos answer however slow the machine is; for the dead node the SuperLink itself
    answers: a SuperNode's heartbeat keeps it online for 2 × 30 s (flwr 1.41: HEARTBEAT_PATIENCE ×
    HEARTBEAT_DEFAULT_INTERVAL), after which `get_message_res` replies to every message for it
    with a NODE_UNAVAILABLE error (flwr/server/superlink/linkstate/utils.py,
    check_node_availability_for_in_message). The test waits for rounds.jsonl lines and
    results.json, and fails early (with the log) if the run ends first.
    """
    from fedsilo.config import to_toml
    from fedsilo.engines.flower.deploy import LocalDeployment, silo_nodes

    cfg = validate(tiny_config(data_dir, federation={"rounds": 3}))
    assert cfg.flower.round_timeout is None
    config = tmp_path / "exp.toml"
    config.write_text(to_toml(cfg))
    silos = silo_nodes(cfg.task, data_dir)
    run = tmp_path / "run"

    def wait_for(done, submitted, what):
        # A guard far beyond any machine's pace, only so a broken Flower cannot hang the suite.
        guard = time.monotonic() + 3600
        while not done():
            log = tmp_path / "fl" / "flwr-run.log"
            assert submitted.poll() is None, f"the run ended before {what}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < guard, f"no {what} after an hour:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)

    def complete_rounds():
        path = run / "rounds.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    with LocalDeployment(tmp_path / "fl", silos) as dep:
        submitted = dep.submit(config, run)
        wait_for(lambda: complete_rounds() >= 1, submitted, "round 1")
        dep.kill("supernode-yelp")
        wait_for((run / "results.json").exists, submitted, "results")
    rounds = rounds_of(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[0]["missing"] == [] and set(rounds[0]["clients"]) == {"restaurants", "academic", "yelp"}
    assert [r["missing"] for r in rounds[1:]] == [["yelp"], ["yelp"]]
    for r in rounds[1:]:
        assert "Node Unavailable" in r["missing_reasons"]["yelp"]  # the SuperLink's answer, not a timeout
        assert set(r["clients"]) == {"restaurants", "academic"}
        assert sum(c["weight"] for c in r["clients"].values()) == pytest.approx(1.0)
    test = json.loads((run / "results.json").read_text())["test"]
    tested = {r["client"] for r in test["rows"]}
    assert tested == {"restaurants", "academic"}


def test_flower_resume_equals_uninterrupted(tmp_path, data_dir, local_run):
    from fedsilo.runs.flower import run_simulation

    out = tmp_path / "sim"
    run_simulation(validate(flower_config(data_dir, federation={"rounds": 1})), out, show_progress=False)
    assert len(rounds_of(out)) == 1
    run_simulation(validate(flower_config(data_dir)), out, resume=True, show_progress=False)
    assert_same_run(local_run, out)


def test_second_task_on_flower_simulation_matches_in_process(tmp_path, monkeypatch):
    """The toy ranking task (encoder model, plug-ins named in the config) through the same plug-in
    points on Flower: every silo keeps its score head private and a personal model in its store."""
    from pathlib import Path

    from tests.parity import local_and_simulation
    from tests.test_plugins import toy_config

    # Flower's simulation workers import the config's plugins (tests.toytask) from the repository root
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(exchange={"private": ["classifier.*"], "overwrite": "none"},
                     client={"regularizers": {"personal": 0.2}})
    local_and_simulation(cfg, tmp_path)
    a, b = rounds_of(tmp_path / "local"), rounds_of(tmp_path / "sim")
    for x, y in zip(a, b):
        for c in x["clients"]:
            assert y["clients"][c]["weight"] == pytest.approx(x["clients"][c]["weight"], rel=1e-6)
            assert y["clients"][c]["bytes_up"] == x["clients"][c]["bytes_up"]
    pa = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(tmp_path / "sim" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert pa.keys() == pb.keys() and not any(k.startswith("classifier") for k in pa)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
    ra = json.loads((tmp_path / "local" / "results.json").read_text())["test"]
    rb = json.loads((tmp_path / "sim" / "results.json").read_text())["test"]
    assert [r["client"] for r in rb["rows"]] == ["alpha", "beta", "gamma"]
    for x, y in zip(ra["rows"], rb["rows"]):
        assert y["stats"] == pytest.approx(x["stats"], rel=1e-5)
