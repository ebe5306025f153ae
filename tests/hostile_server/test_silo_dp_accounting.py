"""Silo-level DP's accounting (fedsilo.privacy.silo_dp) where silos do not answer as planned or lie about
their size: the federation's ε never passes its target whoever answers, it is accounted with the noise the
silos were told to add, an honest silo's share of the mean never exceeds what the noise covers, and the ε
reported equals dp-accounting's ε from what was actually released (1e-3)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsilo.client.silo import SiloClient
from fedsilo.core.masking import weighted_vector
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.transforms import SiloRefused
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.features.silo_dp import release
from fedsilo.recipe import build_recipe
from fedsilo.runs.runner import run_experiment
from fedsilo.server import Server
from tests.test_plugins import toy_config
from tests.test_silo_dp import google_gaussian_epsilon

DELTA = 1e-5


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def drop(monkeypatch, silos: set[str], round_idx: int) -> None:
    """`silos` do not answer round `round_idx` (a dropout as the engine sees one: the silo sends nothing)."""
    fit = SiloClient.fit

    def gone(self, r, *args, **kwargs):
        if self.name in silos and r == round_idx:
            raise SiloRefused(f"{self.name} dropped out")
        return fit(self, r, *args, **kwargs)
    monkeypatch.setattr(SiloClient, "fit", gone)


def released_epsilon(cfg, rounds: list[dict]) -> float:
    """ε from what left each round: each of the k silos in the sum added N(0, std²) (std as its release
    adds it), so the sum carries std·√k against a sensitivity of C (equal weights, one denominator)."""
    share = release(cfg)
    return google_gaussian_epsilon([share.std * math.sqrt(len(r["silo_dp"]["silos"])) / share.clip for r in rounds],
                                   DELTA)


def distributed(rounds: int, **silo_dp) -> dict:
    return {"rounds": rounds, "weighting": "equal",
            "silo_dp": {"mode": "distributed", "clip": 1.0, "delta": DELTA, **silo_dp}}


def test_silos_dropping_in_the_last_round_cannot_take_the_federation_past_its_target(tmp_path, monkeypatch):
    """Issue 40: the check before a round assumed every silo answers; two of four dropping in the last
    round ended a run at ε = 4.439 > 4. Here two of three drop in the last round."""
    cfg = toy_config(federation=distributed(3, target_epsilon=4.0))
    drop(monkeypatch, {"beta", "gamma"}, 3)
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    assert [len(r["silo_dp"]["silos"]) for r in rounds] == [3, 3, 1]  # the drop happened as scripted
    true = released_epsilon(cfg, rounds)
    assert true <= 4.0
    assert rounds[-1]["silo_dp"]["epsilon"] == pytest.approx(true, rel=1e-3)


def test_a_round_that_would_pass_the_target_if_only_the_fewest_answered_is_refused_naming_them(tmp_path):
    """σ given: each round is planned for one answer (the server applies a round from one update)."""
    sigma, target = 4.0, 2.5
    cfg = toy_config(federation=distributed(6, noise_multiplier=sigma, target_epsilon=target))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    # every round ran with all three silos; the next one would pass the target at σ·√(1/3)
    assert all(len(r["silo_dp"]["silos"]) == 3 for r in rounds)
    done = len(rounds)
    assert google_gaussian_epsilon([sigma] * done + [sigma / math.sqrt(3)], DELTA) > target
    assert google_gaussian_epsilon([sigma] * (done - 1) + [sigma / math.sqrt(3)], DELTA) <= target
    assert f"round {done + 1} would take the federation to ε = " in results["stopped"]
    assert "if only 1 of the 3 sampled silos answer, the fewest that still form an aggregate" in results["stopped"]
    assert rounds[-1]["silo_dp"]["epsilon"] == pytest.approx(released_epsilon(cfg, rounds), rel=1e-3)


def test_under_secure_aggregation_the_fewest_is_its_threshold(tmp_path):
    sigma, target = 4.0, 2.5
    secure = {"secure_aggregation": {"threshold": 2}}
    cfg = toy_config(federation={**distributed(6, noise_multiplier=sigma, target_epsilon=target), **secure})
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    done = len(rounds)
    assert google_gaussian_epsilon([sigma] * done + [sigma * math.sqrt(2 / 3)], DELTA) > target
    assert google_gaussian_epsilon([sigma] * (done - 1) + [sigma * math.sqrt(2 / 3)], DELTA) <= target
    assert "if only 2 of the 3 sampled silos answer" in results["stopped"]


def test_sigma_derived_from_the_target_fits_every_round_at_the_fewest_answers():
    """A target-derived σ is sized for the worst case: the planned rounds are never refused."""
    from fedsilo.features.silo_dp import mechanism
    cfg = toy_config(federation=distributed(4, target_epsilon=4.0))
    dp = mechanism(cfg)
    worst, k = dp.worst_case(3)
    assert k == 1 and worst == pytest.approx(dp.noise_multiplier / math.sqrt(3))
    assert google_gaussian_epsilon([worst] * 4, DELTA) <= 4.0 * (1 + 1e-3)
    for r in range(1, 5):
        assert dp.refuses(r, 3) is None
        dp.privatise({"w": torch.zeros(2)}, {"a": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, r)  # one answer each round
    assert dp.budget.epsilon() <= 4.0 * (1 + 1e-9)


def test_m_is_the_noise_the_silos_were_told_to_add_not_the_number_sampled(tmp_path):
    """Issue 40: a silo whose DP-SGD budget is spent is not sampled again, yet every silo's share was sized
    for m = silos_per_round; the accountant divided by the number sampled (σ = 2.0 recorded, 1.63 in the sum)."""
    cfg = toy_config(federation=distributed(2, noise_multiplier=2.0),
                     clients={"gamma": {"dp": {"noise_multiplier": 1.0, "target_epsilon": 0.01}}})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    assert rounds[0]["clients"]["gamma"].get("final") and rounds[1]["sampled"] == ["alpha", "beta"]
    assert rounds[1]["silo_dp"]["noise_multiplier"] == pytest.approx(2.0 * math.sqrt(2 / 3))
    assert rounds[-1]["silo_dp"]["epsilon"] == pytest.approx(released_epsilon(cfg, rounds), rel=1e-3)


SIZES = {"alpha": 100, "beta": 100}


def central_size_server(secure: bool) -> tuple[Server, dict]:
    federation = {"rounds": 1, "weighting": "size",
                  "silo_dp": {"clip": 1.0, "noise_multiplier": 1.0, "noise": "seeded", "delta": DELTA}}
    if secure:
        federation["secure_aggregation"] = {}
    cfg = toy_config(federation=federation)
    server = Server({"w": torch.zeros(64, dtype=torch.float64)}, build_recipe(cfg).server)
    server.register(SIZES)
    return server, cfg


def after_one_round(secure: bool, honest: torch.Tensor, reported: dict[str, int]) -> torch.Tensor:
    """The global tensor after one round in which alpha sends `honest` and beta sends nothing new."""
    server, _ = central_size_server(secure)
    server.begin_round(1, list(SIZES))
    deltas = {"alpha": honest, "beta": torch.zeros_like(honest)}
    updates = {c: ClientUpdate({"w": d.clone()}, reported[c], steps=1) for c, d in deltas.items()}
    if secure:  # each silo weighs its own vector inside the mask by the size it reports
        layout = server.secure_layout()
        total = sum(weighted_vector({"w": d}, reported[c], math.nan, WEIGHTINGS.get("size"), layout)
                    for c, d in deltas.items())
        for c in updates:
            updates[c].tensors = {}
        assert server.receive_sum(np.asarray(total), layout, updates, {"survivors": list(SIZES), "dropped": []}) is None
    else:
        for c, update in updates.items():
            assert server.receive(c, update) is None
    record = server.end_round()
    assert record["applied"]
    return server.params["w"].clone()


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_a_silo_reporting_a_smaller_size_cannot_raise_an_honest_silos_share(secure):
    """Issue 40: central mode with `size` weighting formed the mean with each silo's reported size and the
    noise with the registered ones; beta reporting n = 1 raised alpha's share to 1.98× what the noise covers.
    Alpha's share is measured exactly: the same seeded noise with and without its update."""
    honest = torch.full((64,), 0.05, dtype=torch.float64)  # norm 0.4 < C
    lying = {"alpha": 100, "beta": 1}
    share = (after_one_round(secure, honest, lying) - after_one_round(secure, torch.zeros(64, dtype=torch.float64),
                                                                       lying)) / honest
    covered = max(SIZES.values()) / sum(SIZES.values())  # w_max / W: what σ·C·w_max/W covers
    assert share.numpy() == pytest.approx(np.full(64, covered), rel=1e-9)
