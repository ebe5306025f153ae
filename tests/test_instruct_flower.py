"""The instruct task on Flower's simulation gives the in-process run: a tiny-llama with LoRA adapters
and a private LM head (so the silos' stores on Flower carry the heads across rounds), 2 rounds over
three own silos written here."""
import json
import os

import pytest
import torch

from fedsilo.config import validate
from tests.parity import local_and_simulation
from tests.test_instruct_engine import LORA, SILOS, instruct_config, rounds_of, write_silos

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

PRIVATE_HEAD = {"name": "lora", "options": {**LORA["options"], "head": "private"}}


def test_flower_simulation_gives_the_in_process_results(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "data-root"))
    cfg = validate(instruct_config(write_silos(tmp_path / "silos"), model={"surgery": PRIVATE_HEAD}))
    local, sim = local_and_simulation(cfg, tmp_path)

    ra, rb = rounds_of(local), rounds_of(sim)
    assert [r["round"] for r in rb] == [r["round"] for r in ra] == [1, 2]
    for x, y in zip(ra, rb):
        assert y["missing"] == [] and set(y["clients"]) == set(x["clients"]) == set(SILOS)
        for c in x["clients"]:
            assert y["clients"][c]["weight"] == pytest.approx(x["clients"][c]["weight"], rel=1e-6)
            assert y["clients"][c]["bytes_up"] == x["clients"][c]["bytes_up"]
            assert y["clients"][c]["losses"] == x["clients"][c]["losses"]
    pa = torch.load(local / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(sim / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert pa.keys() == pb.keys() and not any("lm_head" in k for k in pa)  # the heads stayed on the silos
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)

    ta = json.loads((local / "results.json").read_text())["test"]
    tb = json.loads((sim / "results.json").read_text())["test"]
    assert [r["client"] for r in tb["rows"]] == [r["client"] for r in ta["rows"]] == list(SILOS)
    for x, y in zip(ta["rows"], tb["rows"]):  # each silo evaluated with its own head, on either engine
        assert y["stats"]["loss_n"] == x["stats"]["loss_n"]
        for metric in ("loss", "ppl"):
            assert y["metrics"][metric] == pytest.approx(x["metrics"][metric], rel=1e-5)
    assert tb["macro"]["loss"] == pytest.approx(ta["macro"]["loss"], rel=1e-5)
