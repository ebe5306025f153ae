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
    assert tb["per_silo"].keys() == ta["per_silo"].keys()
    for s in ta["per_silo"]:
        assert tb["per_silo"][s]["em"] == ta["per_silo"][s]["em"]
        assert tb["per_silo"][s]["loss"] == pytest.approx(ta["per_silo"][s]["loss"], rel=1e-5)


def assert_bytes_agree(run):
    """The bytes Flower carried per round and client vs fedsilo's own count: within 5%."""
    for r in rounds_of(run):
        assert r["missing"] == []
        for c in r["clients"].values():
            assert abs(c["flower_bytes_up"] - c["bytes_up"]) <= 0.05 * c["bytes_up"]
            assert abs(c["flower_bytes_down"] - c["bytes_down"]) <= 0.05 * c["bytes_down"]


def test_flower_simulation_matches_in_process(tmp_path, data_dir, local_run):
    from fedsilo.engines.flower.simulation import run_simulation

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
    from fedsilo.config import to_toml
    from fedsilo.engines.flower.deploy import LocalDeployment, split_silo_data
    from tests.wiretap import Wiretap

    cfg = validate(flower_config(data_dir))
    config = tmp_path / "exp.toml"
    config.write_text(to_toml(cfg))
    silos = split_silo_data(data_dir, cfg.task.silos, tmp_path / "silos")
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
    # private tensors never reached the server; each silo kept its own on its disk, as in-process
    local_clients = torch.load(local_run / "checkpoint.pt", weights_only=True)["clients"]
    run_id = (tmp_path / "run" / "run_id").read_text()
    server_params = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert not any(".layer.2." in k and k.startswith("decoder") for k in server_params)
    for silo in cfg.task.silos:
        on_disk = torch.load(tmp_path / "fl" / "state" / silo / run_id / "round-00002.pt", weights_only=True)
        expected = local_clients[silo]["private"]
        assert on_disk["private"].keys() == expected.keys() and len(expected) == 3  # wi, wo, layer norm
        for k in expected:
            torch.testing.assert_close(on_disk["private"][k], expected[k], rtol=1e-6, atol=1e-7)
    streams = tap.captured()
    assert sum(len(s) for s in streams) > 3 * 2 * 1_000_000  # the model went down and up
    assert any(b"delta_loss" in s for s in streams)  # the capture is readable (not compressed)
    leaked = [t for t in _client_texts(data_dir, cfg.task.silos) if any(t.encode() in s for s in streams)]
    assert leaked == []


def test_a_supernode_killed_mid_run_is_recorded_missing(tmp_path, data_dir):
    from fedsilo.config import to_toml
    from fedsilo.engines.flower.deploy import LocalDeployment, split_silo_data

    cfg = validate(tiny_config(data_dir, federation={"rounds": 3}, flower={"round_timeout": 20}))
    config = tmp_path / "exp.toml"
    config.write_text(to_toml(cfg))
    silos = split_silo_data(data_dir, cfg.task.silos, tmp_path / "silos")
    rounds_file = tmp_path / "run" / "rounds.jsonl"
    with LocalDeployment(tmp_path / "fl", silos) as dep:
        submitted = dep.submit(config, tmp_path / "run")
        deadline = time.monotonic() + 300
        while not (rounds_file.exists() and rounds_file.read_text().strip()):
            assert time.monotonic() < deadline and submitted.poll() is None, "round 1 never finished"
            time.sleep(0.5)
        dep.kill("supernode-yelp")
        while not (tmp_path / "run" / "results.json").exists():
            log = (tmp_path / "fl" / "flwr-run.log").read_text()
            assert time.monotonic() < deadline + 300 and submitted.poll() is None, log[-3000:]
            time.sleep(0.5)
    rounds = rounds_of(tmp_path / "run")
    assert rounds[0]["missing"] == []
    assert [r["missing"] for r in rounds[1:]] == [["yelp"], ["yelp"]]
    assert all(set(r["clients"]) == {"restaurants", "academic"} for r in rounds[1:])
    assert sum(c["weight"] for c in rounds[2]["clients"].values()) == pytest.approx(1.0)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert set(results["test"]["per_silo"]) == {"restaurants", "academic"}


def test_flower_resume_equals_uninterrupted(tmp_path, data_dir, local_run):
    from fedsilo.engines.flower.simulation import run_simulation

    out = tmp_path / "sim"
    run_simulation(validate(flower_config(data_dir, federation={"rounds": 1})), out, show_progress=False)
    assert len(rounds_of(out)) == 1
    run_simulation(validate(flower_config(data_dir)), out, resume=True, show_progress=False)
    assert_same_run(local_run, out)
