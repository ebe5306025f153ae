"""Silo-level DP (fedsilo.privacy.silo_dp): the accountant against dp-accounting, the fixed denominator and
the noise's scale for each weighting and mode, runs that stop at their target and resume exactly, and the
weightings the accountant cannot cover refused by name."""
from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import pytest
import torch

from fedsilo.recipe import build_recipe
from fedsilo.config import validate
from fedsilo.privacy.accountant import ORDERS, Budget
from fedsilo.privacy.silo_dp import SiloDP, silo_noise
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import PLUGINS, toy_config


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def google_gaussian_epsilon(sigmas: list[float], delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    for sigma in sigmas:
        accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    return accountant.get_epsilon(delta)


def dp(mode="central", sigma=1.5, clip=0.5, target=None, delta=1e-5, seed=0, shares=4) -> SiloDP:
    """`shares`: the m each silo's distributed share σ·C/√m was sized for."""
    return SiloDP(mode == "central", clip, sigma, Budget(sigma, 1.0, delta, target), seed=seed, shares=shares)


def test_the_federations_epsilon_equals_dp_accounting_per_round():
    mech = dp(sigma=1.3)
    like = {"w": torch.zeros(10)}
    for r in range(1, 6):
        _, record = mech.privatise(like, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, r)
        assert record["steps"] == r
        assert record["epsilon"] == pytest.approx(google_gaussian_epsilon([1.3] * r, 1e-5), rel=1e-3)


@pytest.mark.parametrize("weights,accepted", [
    ({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, ["a", "b", "c", "d"]),       # equal
    ({"a": 100.0, "b": 20.0, "c": 60.0, "d": 20.0}, ["a", "b", "c", "d"]),  # size: w_max = 100 of W = 200
    ({"a": 100.0, "b": 20.0, "c": 60.0, "d": 20.0}, ["b", "c"]),            # two silos absent: W stays 200
])
def test_central_noise_is_sigma_c_wmax_over_w_on_a_fixed_denominator(weights, accepted):
    sigma, clip = 1.5, 0.5
    mech = dp(sigma=sigma, clip=clip)
    mean = {"w": torch.full((200_000,), 0.25, dtype=torch.float64)}
    out, record = mech.privatise(mean, {c: weights[c] for c in accepted}, weights, 1)
    total, w_max = sum(weights.values()), max(weights.values())
    scale = sum(weights[c] for c in accepted) / total
    noise = out["w"] - 0.25 * scale
    assert noise.mean().item() == pytest.approx(0.0, abs=4 * sigma * clip * w_max / total / math.sqrt(200_000))
    assert noise.std().item() == pytest.approx(sigma * clip * w_max / total, rel=0.01)
    assert record["noise_multiplier"] == sigma


def test_distributed_noise_sums_to_the_central_scale_and_fewer_answers_are_accounted():
    sigma, clip, m = 2.0, 1.0, 4
    g = torch.Generator().manual_seed(1)
    updates = [{"w": torch.randn(100_000, generator=g) * 0.01} for _ in range(m)]
    noisy = [silo_noise(u, clip, sigma * clip / math.sqrt(m), g) for u in updates]
    clipped = [silo_noise(u, clip, 0.0, None) for u in updates]
    noise = sum(n["w"] - c["w"] for n, c in zip(noisy, clipped))
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.01)  # N(0, σ²C²) on the sum, as central
    big = silo_noise({"w": torch.full((100,), 1.0)}, clip, 0.0, None)
    assert torch.linalg.vector_norm(big["w"]).item() == pytest.approx(clip)  # clipped to C
    mech = dp("distributed", sigma=sigma, clip=clip)
    _, record = mech.privatise({"w": torch.zeros(3)}, {"a": 1.0, "b": 1.0, "c": 1.0},
                               {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 1)
    assert record["noise_multiplier"] == pytest.approx(sigma * math.sqrt(3 / 4))  # 3 of 4 silos' noise
    assert record["epsilon"] == pytest.approx(google_gaussian_epsilon([sigma * math.sqrt(3 / 4)], 1e-5), rel=1e-3)


def test_a_run_stops_before_the_round_that_would_pass_its_target_and_resumes_exactly(tmp_path):
    # σ = 2 over rounds of q = 1: ε(δ=1e-5) is 2.17, 3.19, 4.01 after 1, 2, 3 rounds
    cfg = toy_config(federation={"rounds": 5, "silo_dp": {"clip": 1.0, "noise_multiplier": 2.0, "target_epsilon": 3.5}})
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    assert len(rounds) == 2 and results["rounds"] == 2
    assert "silo-level privacy budget: round 3 would take the federation to ε = 4.012 > target ε = 3.5" in results["stopped"]
    eps = [r["silo_dp"]["epsilon"] for r in rounds]
    assert eps == pytest.approx([google_gaussian_epsilon([2.0] * k, 1e-5) for k in (1, 2)], rel=1e-3)
    again = run_experiment(cfg, tmp_path / "run", resume=True, show_progress=False)
    assert again == results  # finished: a resume does not spend more
    # a run cut after round 1 and resumed has the same accountant as one that was not
    short = toy_config(federation={"rounds": 1, "silo_dp": {"clip": 1.0, "noise_multiplier": 2.0}})
    run_experiment(short, tmp_path / "cut", show_progress=False)
    longer = toy_config(federation={"rounds": 2, "silo_dp": {"clip": 1.0, "noise_multiplier": 2.0}})
    run_experiment(longer, tmp_path / "cut", resume=True, show_progress=False)
    assert [r["silo_dp"]["epsilon"] for r in rounds_of(tmp_path / "cut")] == eps
    from fedsilo.runs.report import write_report
    assert "(ε = 3.19" in write_report(tmp_path / "run").read_text()


def test_distributed_noise_under_secure_aggregation(tmp_path):
    cfg = toy_config(federation={"rounds": 1, "weighting": "equal", "secure_aggregation": {},
                                 "silo_dp": {"mode": "distributed", "clip": 1.0, "noise_multiplier": 1.0}})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    record = rounds_of(tmp_path / "run")[0]
    assert record["applied"] and record["secure"]["survivors"] == ["alpha", "beta", "gamma"]
    assert record["silo_dp"]["mode"] == "distributed" and record["silo_dp"]["noise_multiplier"] == 1.0


@pytest.mark.parametrize("federation,culprit", [
    ({"weighting": "lorar"}, "federation.weighting = 'lorar' cannot be accounted"),
    ({"weighting": "size", "silo_dp": {"mode": "distributed", "clip": 1.0, "noise_multiplier": 1.0}},
     "each silo's share of the noise would depend"),
    ({"aggregation": "median"}, "accounted for the mean"),
    ({"clip_norm": 2.0}, "federation.clip_norm = 2.0 cannot apply with federation.silo_dp"),
    ({"silo_dp": {"clip": 1.0}}, "set target_epsilon"),
    ({"silo_dp": {"noise_multiplier": 1.0}}, "clip"),
])
def test_weightings_the_accountant_cannot_cover_are_refused_by_name(federation, culprit):
    base = {"plugins": PLUGINS, "name": "toy", "task": {"name": "toyrank", "n_train": 8, "n_eval": 4},
            "model": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2},
            "federation": {"silo_dp": {"clip": 1.0, "noise_multiplier": 1.0}, **federation}}
    with pytest.raises(Exception, match=culprit):
        build_recipe(validate(base))
