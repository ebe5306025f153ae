"""Compressed upload in real runs (fedsilo.core.compression on the upload seam): the bytes counted are
the bytes sent, the model stays close to the uncompressed run, error feedback's residual lives in the
silo's store (resume-exact), and Flower carries the compressed bytes."""
import math
import os
from pathlib import Path

import pytest
import torch

from fedsilo.client.silo import federated_parameters
from fedsilo.client.store import DiskStore
from fedsilo.config import ConfigError
from fedsilo.recipe import build_model
from fedsilo.runs.runner import run_experiment
from tests.killed_run import interrupted_in_round_two
from tests.test_plugins import rounds_of, toy_config

SMALL = {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2, "dropout": 0.0}


def coded(*transforms, rounds=2, down=(), **sections):
    return toy_config(model=SMALL, exchange={"upload_transforms": list(transforms), "download_transforms": list(down)},
                      federation={"rounds": rounds, "weighting": "size"}, **sections)


def _params(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


def _wire_bytes(cfg, codec: str) -> int:
    """What one silo's upload of every shared tensor costs under `codec` (the formulas of the docstring)."""
    model, _ = build_model(cfg)
    sizes = [p.numel() for p in federated_parameters(model).values()]
    if codec in ("fp16", "bf16"):
        return sum(2 * n for n in sizes)
    if codec == "int8":
        return sum(n + 4 * math.ceil(n / 256) for n in sizes)
    return 4 * sum(sizes)


def _uncompressed(cfg, tmp_path: Path) -> tuple[dict, float]:
    """The uncompressed run's final tensors and how far the run moved them (‖final − start‖)."""
    run_experiment(cfg, tmp_path / "plain", show_progress=False)
    plain = _params(tmp_path / "plain")
    start = {k: v.detach() for k, v in federated_parameters(build_model(cfg)[0]).items()}
    return plain, math.sqrt(sum(float((plain[k] - start[k]).norm()) ** 2 for k in plain))


def test_compressed_runs_count_the_bytes_sent_and_stay_close_to_the_uncompressed_run(tmp_path):
    plain_cfg = coded()
    plain, moved = _uncompressed(plain_cfg, tmp_path)
    raw = _wire_bytes(plain_cfg, "fp32")
    for codec, tolerance in (("fp16", 1e-3), ("bf16", 1e-2), ("int8", 2e-2)):
        run_experiment(coded({"name": codec}), tmp_path / codec, show_progress=False)
        first = rounds_of(tmp_path / codec)[0]
        assert all(e["bytes_up"] == _wire_bytes(plain_cfg, codec) for e in first["clients"].values()), codec
        assert all(e["params_up"] == _wire_bytes(plain_cfg, "fp32") // 4 for e in first["clients"].values())
        assert all(0 <= e["transforms"][0]["error"] < 0.05 for e in first["clients"].values())
        got = _params(tmp_path / codec)
        off = math.sqrt(sum(float((got[k] - plain[k]).norm()) ** 2 for k in plain))
        assert off / moved < tolerance, (codec, off / moved)
    assert raw / _wire_bytes(plain_cfg, "int8") >= 3.9


def test_topk_sends_its_fraction_and_error_feedback_carries_the_rest_in_the_silos_store(tmp_path):
    cfg = coded({"name": "topk", "fraction": 0.05}, rounds=2)
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    model, _ = build_model(cfg)
    sizes = [p.numel() for p in federated_parameters(model).values()]
    expected = sum(8 * max(1, round(0.05 * n)) for n in sizes)
    assert all(e["bytes_up"] == expected for r in rounds_of(tmp_path / "run") for e in r["clients"].values())
    # parameters sent: the kept values (the indices are bytes, not parameters)
    kept = sum(max(1, round(0.05 * n)) for n in sizes)
    assert all(e["params_up"] == kept for r in rounds_of(tmp_path / "run") for e in r["clients"].values())
    store = DiskStore(tmp_path / "run" / "clients")
    store.set_round(2)
    residual = store.get("alpha").slot("transform0")
    assert set(residual) == set(federated_parameters(model))
    assert sum(float(t.abs().sum()) for t in residual.values()) > 0  # what was not sent waits on the silo


def test_error_feedback_after_a_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    cfg = coded({"name": "topk", "fraction": 0.05}, rounds=3)
    run_experiment(cfg, tmp_path / "whole", show_progress=False)
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "resumed")
    run_experiment(cfg, tmp_path / "resumed", resume=True, show_progress=False)
    a, b = _params(tmp_path / "whole"), _params(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole, resumed = DiskStore(tmp_path / "whole" / "clients"), DiskStore(tmp_path / "resumed" / "clients")
    for store in (whole, resumed):
        store.set_round(3)
    for silo in ("alpha", "beta", "gamma"):
        ra, rb = whole.get(silo).slot("transform0"), resumed.get(silo).slot("transform0")
        assert ra and all(torch.equal(ra[k], rb[k]) for k in ra)


def test_lora_adapters_travel_compressed(tmp_path):
    cfg = toy_config(model={**SMALL, "surgery": {"name": "lora", "options": {"rank": 4}}},
                     exchange={"upload_transforms": [{"name": "int8", "block_size": 64}]}, federation={"rounds": 1})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    sizes = [p.numel() for p in federated_parameters(build_model(cfg)[0]).values()]
    entry = rounds_of(tmp_path / "run")[0]["clients"]["alpha"]
    assert entry["bytes_up"] == sum(n + 4 * math.ceil(n / 64) for n in sizes)


@pytest.mark.parametrize("section, message", [
    ({"exchange": {"upload_transforms": [{"name": "int8"}, {"name": "clip", "max_norm": 1.0}]}},
     r"upload_transforms\[0\]: 'int8' encodes what is sent .* 'clip' comes after it"),
    ({"exchange": {"upload_transforms": [{"name": "topk", "fraction": 0}]}},
     r"upload_transforms\[0\]\.fraction"),
    ({"exchange": {"download_transforms": [{"name": "fp16"}, {"name": "int8"}]}}, "at most one codec"),
    ({"exchange": {"download_transforms": [{"name": "topk"}]}}, r"download_transforms\[0\]\.name: 'topk' is not"),
    ({"exchange": {"download_transforms": [{"name": "fp16"}]}, "federation": {"secure_aggregation": {}}},
     "download_transforms cannot run with federation.secure_aggregation"),
])
def test_compression_that_cannot_hold_is_refused_by_name(section, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(**section)


def test_a_download_codec_sends_the_coded_values_and_the_run_stays_close(tmp_path):
    plain_cfg = coded()
    plain, moved = _uncompressed(plain_cfg, tmp_path)
    off = {}
    for codec in ("fp16", "bf16", "int8"):
        run_experiment(coded(down=[{"name": codec}]), tmp_path / codec, show_progress=False)
        first = rounds_of(tmp_path / codec)[0]
        assert all(e["bytes_down"] == _wire_bytes(plain_cfg, codec) for e in first["clients"].values())
        got = _params(tmp_path / codec)
        off[codec] = math.sqrt(sum(float((got[k] - plain[k]).norm()) ** 2 for k in plain)) / moved
    # the values themselves are coded (no Δ a client is sure to hold): fp16 keeps the run, int8's grid of
    # |w|max/254 per block is as large as two rounds of this toy's training (docs/compression.md)
    assert 0 < off["fp16"] < 0.05 and off["fp16"] < off["bf16"] < off["int8"], off


def test_compressed_upload_on_flower_simulation_equals_in_process_and_flower_carries_fewer_bytes(
        tmp_path, monkeypatch):
    from tests.parity import local_and_simulation

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = coded({"name": "int8"}, down=[{"name": "int8"}], engine={"workers": 1})
    local, sim = local_and_simulation(cfg, tmp_path)
    a, b = _params(local), _params(sim)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7)
    raw = _wire_bytes(cfg, "fp32")
    for la, sa in zip(rounds_of(local), rounds_of(sim), strict=True):
        for silo, entry in sa["clients"].items():
            # Flower's arrays carry the int8 codes and float32 scales, with a few bytes of framing per array
            for way in ("up", "down"):
                assert entry[f"bytes_{way}"] == la["clients"][silo][f"bytes_{way}"]
                assert entry[f"bytes_{way}"] <= entry[f"flower_bytes_{way}"] <= entry[f"bytes_{way}"] + 200 * 64
                assert raw / entry[f"flower_bytes_{way}"] > 3.5
