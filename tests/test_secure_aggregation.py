"""Secure aggregation in the engines: the masked weighted mean equals the plaintext aggregate within the
documented error, a silo dropping after key sharing still gives a result, the same run on Flower, a wire
capture of a real deployment holds no silo's update, and combinations that need one update in the clear
are refused by name."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsilo.recipe import build_recipe
from fedsilo.config import validate
from fedsilo.core.aggregate import RoundAggregator
from fedsilo.core.masking import Layout, mean_from_sum, weighted_vector
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.privacy.secagg import SecAggSettings, secure_sum
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import PLUGINS, toy_config

ROOT = Path(__file__).resolve().parents[1]


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def params(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


# ---- the masked weighted mean against the plaintext aggregator ----------------------------------

@pytest.mark.parametrize("policy,values", [
    ("size", [math.nan] * 4),
    ("equal", [math.nan] * 4),
    ("lorar", [0.3, 0.05, 1.2, 0.4]),           # every ΔL usable
    ("lorar", [0.3, math.nan, 1.2, -0.1]),      # two fall back to their size share
    ("lorar", [math.nan, -1.0, math.nan, math.inf]),  # none usable: every silo by size
])
def test_secure_mean_equals_the_plaintext_aggregate(policy, values):
    g = torch.Generator().manual_seed(0)
    like = {"a.weight": torch.zeros(5, 3), "b.bias": torch.zeros(7)}
    sizes = [40, 13, 90, 7]
    deltas = [{k: torch.randn(v.shape, generator=g) * 0.1 for k, v in like.items()} for _ in sizes]
    plain = RoundAggregator(WEIGHTINGS.get(policy), like=like)
    for i, (d, n, v) in enumerate(zip(deltas, sizes, values)):
        plain.add(f"s{i}", d, n, v)
    expected, _ = plain.finish()
    layout = Layout.of(like, list(like), WEIGHTINGS.get(policy))
    vectors = {f"s{i}": weighted_vector(d, n, v, WEIGHTINGS.get(policy), layout)
               for i, (d, n, v) in enumerate(zip(deltas, sizes, values))}
    step = 2.0 ** -32
    total, survivors = secure_sum(vectors, SecAggSettings(step=step))
    assert survivors == list(vectors)
    got = mean_from_sum(total, layout, like)
    for k in like:
        # the sum's coordinates are exact to 4·step/2; the mean divides it by a total weight ≥ 7
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=4 * step / 2 / 7 + 1e-7)


# ---- runs ----------------------------------------------------------------------------------------

def test_in_process_secure_run_equals_the_plaintext_run_and_hides_each_weight(tmp_path, monkeypatch):
    from fedsilo.server import Server

    sent, real = [], Server.receive_sum

    def seen(self, total, layout, updates, protocol):
        sent.extend(u for u in updates.values())
        return real(self, total, layout, updates, protocol)

    monkeypatch.setattr(Server, "receive_sum", seen)
    clip = {"upload_transforms": [{"name": "clip", "max_norm": 1000.0}]}
    for name, extra in (("plain", {}), ("secure", {"secure_aggregation": {}})):
        run_experiment(toy_config(federation={"rounds": 2, "weighting": "size", **extra}, exchange=clip),
                       tmp_path / name, show_progress=False)
    # what travels beside the masked vector: no tensor, no loss, and of the clip only its name (not the norm)
    assert len(sent) == 6 and all(u.tensors == {} and u.losses == [] and math.isnan(u.delta_loss) and
                                  u.transforms == [{"name": "clip"}] for u in sent)
    a, b = params(tmp_path / "plain"), params(tmp_path / "secure")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # float32 sums against the exact secure sum
    for record in rounds_of(tmp_path / "secure"):
        assert record["secure"]["survivors"] == ["alpha", "beta", "gamma"] and record["applied"]
        # one process runs every silo: fresh keys per round, the signed stages and the consistency round run
        assert record["secure"]["against"] == "active server" and record["secure"]["roster"] == "ephemeral, in-process"
        for entry in record["clients"].values():  # nothing of one silo's update or weight in the record
            assert entry["secure"] and entry["weight"] is None and "losses" not in entry and "delta_loss" not in entry


def test_a_silo_that_refuses_after_the_keys_were_shared_is_a_dropout_the_sum_recovers_from(tmp_path):
    """gamma's own check refuses every round once training was asked of it: the sum is alpha's and beta's."""
    refuse = {"gamma": {"upload_checks": [{"name": "require_clip", "max_norm": 1.0}]}}
    secure = toy_config(federation={"rounds": 2, "secure_aggregation": {}}, clients=refuse)
    run_experiment(secure, tmp_path / "secure", show_progress=False)
    two = toy_config(task={"silos": ["alpha", "beta"]}, federation={"rounds": 2})
    run_experiment(two, tmp_path / "two", show_progress=False)
    for record in rounds_of(tmp_path / "secure"):
        assert record["secure"]["dropped"] == ["gamma"] and record["secure"]["survivors"] == ["alpha", "beta"]
        assert "require_clip" in record["clients"]["gamma"]["refused"] and record["applied"]
    a, b = params(tmp_path / "two"), params(tmp_path / "secure")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_too_few_silos_left_skips_the_round_with_the_reason_and_keeps_what_the_others_spent(tmp_path):
    refuse = {"upload_checks": [{"name": "require_clip", "max_norm": 1.0}]}
    cfg = toy_config(federation={"rounds": 1, "secure_aggregation": {"threshold": 3}},
                     clients={"gamma": refuse}, client={"dp": {"noise_multiplier": 1.0}})
    with pytest.raises(Exception, match="applied no update"):
        run_experiment(cfg, tmp_path / "run", show_progress=False)
    record = rounds_of(tmp_path / "run")[0]
    assert not record["applied"] and "needs at least 3 of 3" in record["skipped"]
    for silo in ("alpha", "beta"):  # they trained: their accountants spent the round, and the record says so
        assert record["clients"][silo]["privacy"]["steps"] == 2


def test_secure_aggregation_on_flower_simulation_equals_in_process(tmp_path, monkeypatch):
    from tests.parity import local_and_simulation

    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    refuse = {"gamma": {"upload_checks": [{"name": "require_clip", "max_norm": 1.0}]}}
    cfg = toy_config(task={"silos": ["alpha", "beta", "gamma"]}, federation={"rounds": 2, "secure_aggregation": {}},
                     clients=refuse)
    local, sim = local_and_simulation(cfg, tmp_path)
    assert max((params(local)[k] - params(sim)[k]).abs().max().item() for k in params(local)) == 0.0
    for record in rounds_of(sim):
        assert record["secure"]["dropped"] == ["gamma"] and record["applied"]
        # the simulation's silos hold no roster: the record says plainly that only the semi-honest guarantee holds
        assert record["secure"]["against"] == "semi-honest server only" and record["secure"]["roster"] is None
        assert record["secure"]["signed"] == ["alpha", "beta"]


# ---- a wire capture of a real deployment ----------------------------------------------------------

def chunks(t: torch.Tensor, n: int = 3, width: int = 32) -> list[bytes]:
    """A few `width`-byte pieces of a tensor's raw bytes, as numpy would put them on the wire."""
    raw = t.detach().contiguous().numpy().tobytes()
    stride = max(width, len(raw) // n)
    return [raw[i:i + width] for i in range(0, len(raw) - width + 1, stride)][:n]


def test_a_wire_capture_of_a_secure_deployment_holds_no_silos_update(tmp_path, monkeypatch):
    """Each silo's plaintext upload (its tensors and its weighted vector, recorded in an in-process run of the
    same config, which computes the same numbers) never crosses the wire; the global model does (control)."""
    import fedsilo.client.silo as silo_module
    from fedsilo.config import to_toml
    from fedsilo.privacy.secure_stages import SecureMask
    from fedsilo.engines.flower.deploy import LocalDeployment, silo_nodes
    from tests.wiretap import Wiretap

    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(federation={"rounds": 1, "weighting": "size", "secure_aggregation": {}}, engine={"workers": 1})
    uploads: list[tuple[str, dict, dict, np.ndarray]] = []
    real, real_fit, fitting = SecureMask.__call__, silo_module.SiloClient.fit, []

    def recorded(self, update, received):  # the mask, the last stage of a silo's round
        out = real(self, update, received)
        uploads.append((fitting[-1], dict(update.tensors), dict(received), out.secure_input))
        return out

    def fit(self, *args, **kwargs):
        fitting.append(self.name)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(SecureMask, "__call__", recorded)
    monkeypatch.setattr(silo_module.SiloClient, "fit", fit)
    torch.set_num_threads(1)
    run_experiment(cfg, tmp_path / "local", show_progress=False)
    monkeypatch.setattr(SecureMask, "__call__", real)
    monkeypatch.setattr(silo_module.SiloClient, "fit", real_fit)
    assert [u[0] for u in uploads] == ["alpha", "beta", "gamma"]

    config = tmp_path / "toy.toml"
    config.write_text(to_toml(cfg))
    # each silo's operator opts out of secret randomness by name, so the deployment computes what we recorded
    nodes = {silo: {**node, "secret-randomness": "false"} for silo, node in silo_nodes(cfg.task, None).items()}
    dep = LocalDeployment(tmp_path / "fl", nodes)
    tap = Wiretap(dep.port)
    dep.fleet_port = tap.port
    with dep:
        dep.run(config, tmp_path / "run", timeout=600)
    tap.close()
    streams = tap.captured()
    final = params(tmp_path / "run")
    torch.testing.assert_close(final, params(tmp_path / "local"), rtol=0, atol=0)  # it computed what we recorded
    # control: the aggregated model, sent down for the dev evaluation, is found on the wire as raw bytes
    largest = max(final, key=lambda k: final[k].numel())
    assert all(any(c in s for s in streams) for c in chunks(final[largest]))
    for name, tensors, received, vector in uploads:
        nonzero = np.flatnonzero(np.convolve(vector != 0, np.ones(4), "valid") == 4)  # 4 non-zero values in a row
        pieces = [vector[i:i + 4].tobytes() for i in nonzero[::max(1, len(nonzero) // 3)][:3]]
        for k, t in tensors.items():  # 8 values in a row that training changed (not the model sent down)
            changed = ((t != received[k]) & (t != final[k])).flatten().int()
            runs = torch.nonzero(changed.unfold(0, 8, 1).sum(1) == 8).flatten() if changed.numel() >= 8 else []
            if len(runs):
                i = int(runs[len(runs) // 2])
                pieces.append(t.flatten()[i:i + 8].numpy().tobytes())
        assert len(pieces) > 5
        found = [p.hex()[:16] for p in pieces if any(p in s for s in streams)]
        assert not found, f"{name}'s plaintext upload is on the wire: {found}"


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sections,culprit", [
    ({"exchange": {"upload": "dp_g"}}, "exchange.upload = 'dp_g' cannot run"),
    ({"exchange": {"download": "uploaded"}}, "exchange.download = 'uploaded' cannot run"),
    ({"federation": {"aggregation": "median"}}, "federation.aggregation = 'median' needs every update apart"),
    ({"federation": {"clip_norm": 1.0}}, "federation.clip_norm = 1.0 cannot apply"),
    ({"federation": {"max_update_ratio": 5}}, "federation.max_update_ratio = 5.0 cannot apply"),
    ({"federation": {"max_client_weight": 0.5}}, "federation.max_client_weight = 0.5 cannot apply"),
    ({"federation": {"secure_aggregation": {"threshold": 4}}}, "3 silo\\(s\\) per round: the Shamir threshold 4"),
    ({"task": {"silos": ["alpha"]}}, "1 silo\\(s\\) per round: one silo's update would be the whole sum"),
    ({"paradigm": "centralized"}, "does not federate"),
])
def test_combinations_that_need_one_update_in_the_clear_are_refused_by_name(sections, culprit):
    base = {"plugins": PLUGINS, "name": "toy", "task": {"name": "toyrank", "n_train": 8, "n_eval": 4},
            "model": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2},
            "federation": {"secure_aggregation": {}}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(Exception, match=culprit):
        build_recipe(validate(base))
