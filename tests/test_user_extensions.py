"""A user's own codec and weighting, added through the public registration only (fedsilo.core.compression.
register_codec, WEIGHTINGS.add with declared abilities), run under secure aggregation — and the weighting
under silo-level DP — with no change anywhere else (issue 39).

Each run is compared with the same run in the clear: the secure sum must give the model the user's
weighting and codec give without the mask.
"""
from __future__ import annotations

import math

import pytest
import torch

from fedsilo.core.compression import CompressionSettings, register_codec
from fedsilo.core.weighting import WEIGHTINGS, WeightingPolicy
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import rounds_of, toy_config

SIZES = {"alpha": 4, "beta": 16, "gamma": 36}  # uneven, so a weighting shows


def _to_int16(u: torch.Tensor, options: CompressionSettings) -> dict:
    """Codes round(u / s) in int16 with one float32 scale s = max|u| / 32767 per tensor."""
    scale = u.abs().max().clamp_min(1e-30) / 32767
    return {"": torch.round(u / scale).to(torch.int16), "scale": scale.reshape(1).float()}


def _from_int16(name: str, parts: dict, n: int, options: CompressionSettings) -> torch.Tensor:
    codes, scale = parts[""], parts["scale"]
    if codes.dtype != torch.int16 or tuple(codes.shape) != (n,) or tuple(scale.shape) != (1,):
        raise ValueError(f"{name!r}: not {n} int16 codes and one scale")
    return codes.float() * scale


if "user-int16" not in WEIGHTINGS:  # a module imported twice registers once
    register_codec("user-int16", ("", "scale"), _to_int16, _from_int16)
    WEIGHTINGS.add("user-sqrt", WeightingPolicy(lambda n, _: math.sqrt(n), None, can_degenerate=False,
                                                public_weight=math.sqrt))


def _config(**federation):
    return toy_config(task={"n_train_of": SIZES}, engine={"workers": 1},
                      federation={"rounds": 2, "weighting": "user-sqrt", **federation},
                      exchange={"upload_transforms": [{"name": "user-int16"}]})


def _params(run) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


def test_a_user_codec_and_weighting_run_under_secure_aggregation_as_in_the_clear(tmp_path):
    run_experiment(_config(), tmp_path / "clear", show_progress=False)
    run_experiment(_config(secure_aggregation={}), tmp_path / "secure", show_progress=False)
    clear, secure = rounds_of(tmp_path / "clear"), rounds_of(tmp_path / "secure")
    assert all(r["applied"] for r in clear + secure)
    assert secure[0]["secure"]["survivors"] == ["alpha", "beta", "gamma"]
    # the clear run's weights are the user's: √n / Σ√n
    roots = {s: math.sqrt(n) for s, n in SIZES.items()}
    for silo, entry in clear[0]["clients"].items():
        assert entry["weight"] == pytest.approx(roots[silo] / sum(roots.values()))
        assert entry["transforms"][0]["name"] == "user-int16" and entry["transforms"][0]["error"] > 0
        assert entry["bytes_up"] < entry["params_up"] * 4  # the codec's int16 wire left the silo
    # the secure sum carries the same weights and the same decoded updates
    a, b = _params(tmp_path / "clear"), _params(tmp_path / "secure")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


def test_the_user_weighting_is_accounted_under_silo_level_dp_by_its_public_weights(tmp_path):
    dp = {"clip": 10.0, "noise_multiplier": 1e-9, "noise": "seeded"}  # noise far below the check's tolerance
    cfg = toy_config(task={"n_train_of": SIZES}, engine={"workers": 1},
                     federation={"rounds": 1, "weighting": "user-sqrt", "silo_dp": dp})
    run_experiment(cfg, tmp_path / "dp", show_progress=False)
    record = rounds_of(tmp_path / "dp")[0]
    assert record["applied"] and record["silo_dp"]["mode"] == "central"
    roots = {s: math.sqrt(n) for s, n in SIZES.items()}
    for silo, entry in record["clients"].items():
        assert entry["weight"] == pytest.approx(roots[silo] / sum(roots.values()))
    # distributed mode sizes each silo's noise share for equal weights: √n is refused, by its ability
    with pytest.raises(Exception, match="federation.weighting = 'user-sqrt' cannot be accounted"):
        toy_config(task={"n_train_of": SIZES}, federation={"weighting": "user-sqrt",
                                                           "silo_dp": {**dp, "mode": "distributed"}})


class NormCap:
    """A user's stage around the server's aggregation (fedsilo.server.RoundStage): the round's aggregate Δ
    scaled down to at most `max_norm`; how often it bit is its state, kept in the checkpoint."""
    state_key = "norm_cap"

    def __init__(self, max_norm: float) -> None:
        self.max_norm, self.capped = max_norm, 0

    def wrap(self, inner, round_idx, sampled, registered):
        stage = self

        class Capped:
            def __getattr__(self, name):  # whatever else the inner aggregation offers (a secure sum)
                return getattr(inner, name)

            def add(self, pending, entry):
                inner.add(pending, entry)

            def finish(self, records):
                out = inner.finish(records)
                if out.delta is not None:
                    norm = math.sqrt(sum(float(t.double().square().sum()) for t in out.delta.values()))
                    if norm > stage.max_norm:
                        out.delta = {k: t * (stage.max_norm / norm) for k, t in out.delta.items()}
                        stage.capped += 1
                    out.tail["norm_cap"] = {"norm": norm, "max_norm": stage.max_norm}
                return out
        return Capped()

    def refuses(self, round_idx, sampled):
        return None

    def limits(self, limits):
        return limits

    def state_dict(self) -> str:
        return str(self.capped)

    def load_state_dict(self, state) -> None:
        self.capped = int(state or 0)


def test_a_user_stage_around_the_aggregation_is_one_registered_entry(tmp_path):
    from fedsilo.features import ROUND_STAGES

    cap = NormCap(1e-3)
    if "user-norm-cap" not in ROUND_STAGES:
        ROUND_STAGES.add("user-norm-cap", lambda cfg, weighting: STAGES.get(cfg.name))
    STAGES["capped"] = cap
    for secure in (False, True):
        cap.capped = 0
        cfg = toy_config(name="capped", engine={"workers": 1}, federation={
            "rounds": 2, **({"secure_aggregation": {}} if secure else {})})
        out = tmp_path / f"secure-{secure}"
        run_experiment(cfg, out, show_progress=False)
        rounds = rounds_of(out)
        assert [r["norm_cap"]["max_norm"] for r in rounds] == [1e-3, 1e-3]
        assert all(r["norm_cap"]["norm"] > 1e-3 for r in rounds) and cap.capped == 2
        assert torch.load(out / "checkpoint.pt", weights_only=False)["server"]["norm_cap"] == "2"
    STAGES.pop("capped")


STAGES: dict = {}


def test_the_wire_naming_is_the_seams_a_tensor_name_holding_it_is_refused():
    from fedsilo.config import ConfigError
    from fedsilo.core.exchange import ExchangePlan
    from fedsilo.recipe import check_plan

    model = torch.nn.Module()
    model.add_module("head::v2", torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"'head::v2.weight' holds '::'"):
        check_plan(model, ExchangePlan())
    check_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), ExchangePlan())  # an ordinary name passes
