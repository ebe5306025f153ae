"""The seam for what leaves a silo (fedsilo.core.transforms): an ordered chain of upload transforms
with the server's decode, recorded in rounds.jsonl, the same in-process and on Flower, and a silo
check that refuses a round before anything is trained or sent."""
import math
import os
from pathlib import Path

import pytest
import torch

from fedsilo.config import ConfigError
from fedsilo.core.transforms import (SILO_CHECKS, UPLOAD_TRANSFORMS, RoundInstructions, TransformContext,
                                     UploadTransform, decode, encode, refusal, update_norm)
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import rounds_of, toy_config


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, generator=g), "b": torch.randn(2, 3, generator=g)}


def _ctx(reference):
    return TransformContext(round=1, client="c0", reference=reference)


def _register_test_transforms():
    """`shift`: adds 1 on the way out and takes it off at the server (a codec); `double`: doubles Δ."""
    if "test-shift" not in UPLOAD_TRANSFORMS:
        UPLOAD_TRANSFORMS.add("test-shift", UploadTransform(
            lambda v, ctx, o: ({k: t + 1 for k, t in v.items()}, {"shifted": 1.0}),
            lambda v, ref, o: {k: t - 1 for k, t in v.items()}, needs_reference=False))
        UPLOAD_TRANSFORMS.add("test-double", UploadTransform(
            lambda v, ctx, o: ({k: ctx.reference[k] + 2 * (t - ctx.reference[k]) for k, t in v.items()}, {})))


def test_clip_bounds_the_update_and_says_so():
    ref, now = _tensors(0), _tensors(1)
    chain = UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 0.5}], "t")
    norm = update_norm(now, ref)
    assert norm > 0.5
    sent, records = encode(chain, now, _ctx(ref))
    assert update_norm(sent, ref) == pytest.approx(0.5, rel=1e-6)
    assert records == [{"name": "clip", "norm": pytest.approx(norm), "clipped": True}]
    for k in ref:  # the direction is kept
        torch.testing.assert_close(sent[k] - ref[k], (now[k] - ref[k]) * 0.5 / norm)
    loose = UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 100.0}], "t")
    same, records = encode(loose, now, _ctx(ref))
    assert records[0]["clipped"] is False and all(torch.equal(same[k], now[k]) for k in now)


def test_the_chain_runs_in_order_and_the_server_undoes_it_in_reverse():
    _register_test_transforms()
    ref, now = _tensors(0), _tensors(1)
    clip_then_double = UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 0.5}, {"name": "test-double"}], "t")
    double_then_clip = UPLOAD_TRANSFORMS.resolve_chain([{"name": "test-double"}, {"name": "clip", "max_norm": 0.5}], "t")
    a, rec_a = encode(clip_then_double, now, _ctx(ref))
    b, rec_b = encode(double_then_clip, now, _ctx(ref))
    assert update_norm(a, ref) == pytest.approx(1.0, rel=1e-6)  # clipped to 0.5, then doubled
    assert update_norm(b, ref) == pytest.approx(0.5, rel=1e-6)  # doubled, then clipped
    assert [r["name"] for r in rec_a] == ["clip", "test-double"] and [r["name"] for r in rec_b] == ["test-double", "clip"]
    codec = UPLOAD_TRANSFORMS.resolve_chain([{"name": "test-shift"}, {"name": "clip", "max_norm": 0.5}], "t")
    sent, records = encode(codec, now, _ctx(ref))
    assert records[0] == {"name": "test-shift", "shifted": 1.0} and records[1]["clipped"] is True
    back = decode(codec, sent, ref)  # clip has nothing to undo; the shift comes off
    for k in now:
        torch.testing.assert_close(back[k], sent[k] - 1)


def test_a_transform_reading_the_update_needs_every_uploaded_tensor_received():
    ref, now = _tensors(0), _tensors(1)
    chain = UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 1.0}], "t")
    with pytest.raises(ValueError, match="did not receive"):
        encode(chain, now, _ctx({"a": ref["a"]}))


@pytest.mark.parametrize("section, message", [
    ({"exchange": {"upload_transforms": [{"name": "zip"}]}},
     r"exchange\.upload_transforms\[0\]\.name: 'zip' is not a known upload transform"),
    ({"exchange": {"upload_transforms": [{"name": "clip"}]}}, r"exchange\.upload_transforms\[0\]\.max_norm: Field required"),
    ({"exchange": {"upload_transforms": [{"name": "clip", "max_norm": -1}]}}, r"exchange\.upload_transforms\[0\]\.max_norm"),
    ({"exchange": {"upload_transforms": "clip"}}, r"exchange\.upload_transforms: Input should be a valid list"),
    ({"exchange": {"upload_transforms": [{"name": "clip", "max_norm": 1.0}], "download": "uploaded"}},
     r"'clip' reads the update .* download = 'uploaded'"),
    ({"client": {"upload_checks": [{"name": "require_clip"}]}}, r"upload_checks\[0\]\.max_norm: Field required"),
    ({"clients": {"beta": {"upload_checks": [{"name": "nope"}]}}}, r"clients\.beta.*'nope' is not a known silo check"),
])
def test_config_errors_name_the_entry(section, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(**section)


def test_the_silo_check_refuses_on_its_own_terms():
    (check,) = SILO_CHECKS.resolve_chain([{"name": "require_clip", "max_norm": 1.0}], "t")
    none = RoundInstructions(1, "c0", ())
    loose = RoundInstructions(1, "c0", UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 5.0}], "t"))
    tight = RoundInstructions(1, "c0", UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 0.5}], "t"))
    assert "do not clip" in refusal([check], none)
    assert "at most 1" in refusal([check], loose) and "clips at 5" in refusal([check], loose)
    assert refusal([check], tight) is None


def test_clipped_federation_records_every_clip_and_moves_the_model_at_most_the_bound(tmp_path):
    """Each update leaves its silo with ‖Δ‖ ≤ C; FedAvg's weights sum to 1, so each round moves the
    global model by at most C: two rounds at most 2C from the model every client started from."""
    from fedsilo.client.silo import federated_parameters
    from fedsilo.recipe import build_model

    bound = 1e-3
    federation = {"rounds": 2, "weighting": "size", "max_update_ratio": "off"}
    clipped_cfg = toy_config(exchange={"upload_transforms": [{"name": "clip", "max_norm": bound}]}, federation=federation)
    run_experiment(clipped_cfg, tmp_path / "clip", show_progress=False)
    run_experiment(toy_config(federation=federation), tmp_path / "plain", show_progress=False)
    for record in rounds_of(tmp_path / "clip"):
        for entry in record["clients"].values():
            (t,) = entry["transforms"]
            assert t["name"] == "clip" and t["clipped"] is True and t["norm"] > bound
    assert all("transforms" not in e for r in rounds_of(tmp_path / "plain") for e in r["clients"].values())
    start = {k: p.detach() for k, p in federated_parameters(build_model(clipped_cfg)[0]).items()}

    def moved(run):
        end = torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)["server"]["params"]
        return math.sqrt(sum(float((end[k] - start[k]).double().norm()) ** 2 for k in end))

    assert moved("clip") <= 2 * bound * (1 + 1e-4)
    assert moved("plain") > 10 * bound  # the bound did something


def test_a_refusing_silo_sends_nothing_and_the_others_aggregate(tmp_path):
    cfg = toy_config(clients={"beta": {"upload_checks": [{"name": "require_clip", "max_norm": 1.0}]}})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    for record in rounds_of(tmp_path / "run"):
        beta = record["clients"]["beta"]
        assert beta["refused"].startswith("refused by the silo: require_clip:")
        assert beta["bytes_up"] == 0 and beta["weight"] is None and "steps" not in beta
        assert record["applied"] and record["clients"]["alpha"]["weight"] == pytest.approx(0.5)
    assert not list((tmp_path / "run" / "clients" / "beta").glob("round-*.safetensors"))  # never trained
    ok = toy_config(exchange={"upload_transforms": [{"name": "clip", "max_norm": 0.5}]},
                    clients={"beta": {"upload_checks": [{"name": "require_clip", "max_norm": 1.0}]}})
    run_experiment(ok, tmp_path / "ok", show_progress=False)
    assert all("refused" not in r["clients"]["beta"] for r in rounds_of(tmp_path / "ok"))


def test_transforms_and_refusals_are_the_same_on_flower(tmp_path, monkeypatch):
    from tests.parity import local_and_simulation

    root = str(Path(__file__).resolve().parents[1])  # Flower's workers import the config's plugins
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(exchange={"upload_transforms": [{"name": "clip", "max_norm": 1e-3}]},
                     clients={"gamma": {"upload_checks": [{"name": "require_clip", "max_norm": 1e-4}]}},
                     federation={"rounds": 2, "weighting": "size", "max_update_ratio": "off"})
    local_and_simulation(cfg, tmp_path)
    a, b = rounds_of(tmp_path / "local"), rounds_of(tmp_path / "sim")
    for x, y in zip(a, b):
        assert y["clients"]["gamma"]["refused"] == x["clients"]["gamma"]["refused"]
        for c in ("alpha", "beta"):
            tx, ty = x["clients"][c]["transforms"], y["clients"][c]["transforms"]
            assert [t["name"] for t in ty] == [t["name"] for t in tx] == ["clip"]
            assert ty[0]["norm"] == pytest.approx(tx[0]["norm"], rel=1e-5)
            assert ty[0]["clipped"] == tx[0]["clipped"]
    pa = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(tmp_path / "sim" / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
