"""Issue 41, the server's part: one hostile silo under secure aggregation (SA10: 500 × the model every
round; SA09: NaN), an empty update (P19b), uncapped self-reported weights (P16), the survivor of a
killed worker (W2), and seeded silo-level noise that must not depend on PYTHONHASHSEED."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsilo.core.messages import ClientUpdate
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.privacy.secagg_parts import encode
from fedsilo.runs.runner import run_experiment
from tests.test_bad_input import fails, toy_file
from tests.test_plugins import rounds_of, toy_config
from tests.toy import server_with

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0",
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def _final(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


def hostile(monkeypatch, silo: str, change, rounds=None) -> None:
    """`silo`'s update goes through `change(tensors) -> tensors` before it is masked (its own silo turned
    hostile: nothing of the protocol changes), in the rounds given (None: every round)."""
    import fedsilo.client.silo as silo_module
    from fedsilo.privacy.secure_stages import SecureMask

    real_mask, real_fit, fitting = SecureMask.__call__, silo_module.SiloClient.fit, []

    def fit(self, round_idx, *args, **kwargs):
        fitting.append((self.name, round_idx))
        return real_fit(self, round_idx, *args, **kwargs)

    def mask(self, update, received):
        name, r = fitting[-1]
        if name == silo and (rounds is None or r in rounds):
            update = dataclasses.replace(update, tensors=change(update.tensors))
        return real_mask(self, update, received)

    monkeypatch.setattr(silo_module.SiloClient, "fit", fit)
    monkeypatch.setattr(SecureMask, "__call__", mask)


def times_500(tensors):
    return {k: 500 * t for k, t in tensors.items()}


def nan(tensors):
    return {k: torch.full_like(t, math.nan) for k, t in tensors.items()}


SECURE = {"secure_aggregation": {}}


# ---- SA10: 500 × the model under secure aggregation -------------------------------------------------------

def test_a_silo_sending_500_times_the_model_every_round_under_secure_aggregation_stops_the_run(
        tmp_path, capsys, monkeypatch):
    """Before: exit 0, no warning, the model 166 × its norm after round 1 and 5e6 × after round 3 (the
    default max_step_ratio of 1000 bounds the step only against the current, already inflated, norm)."""
    hostile(monkeypatch, "gamma", times_500)
    config = toy_file(tmp_path, federation={"rounds": 3, **SECURE}, engine={"workers": 1})
    line = fails(capsys, "run", str(config), "--out", str(tmp_path / "run"), "--no-progress",
                 culprit="applied no update")
    assert "secure_aggregation.max_mean_ratio" in line
    records = rounds_of(tmp_path / "run")
    assert [r["applied"] for r in records] == [False] * 3
    assert all("only the sum" in r["skipped"] for r in records)


def test_an_attack_in_one_round_is_skipped_with_a_warning_and_the_model_stays_near_the_honest_run(
        tmp_path, capsys, monkeypatch):
    torch.set_num_threads(1)
    cfg = toy_config(federation={"rounds": 3, **SECURE}, engine={"workers": 1})
    run_experiment(cfg, tmp_path / "honest", show_progress=False)
    hostile(monkeypatch, "gamma", times_500, rounds={2})
    run_experiment(cfg, tmp_path / "attacked", show_progress=False)
    err = capsys.readouterr().err
    assert "round 2: no update applied" in err and "max_mean_ratio" in err
    records = rounds_of(tmp_path / "attacked")
    assert [r["applied"] for r in records] == [True, False, True]
    honest, attacked = _final(tmp_path / "honest"), _final(tmp_path / "attacked")
    start = _norm(torch.load(tmp_path / "honest" / "checkpoint.pt", weights_only=True)["server"]["params"])
    gap = _norm({k: attacked[k] - honest[k] for k in honest})
    assert gap < 0.05 * start  # one honest round fewer: the model moved by the honest steps only


def test_the_step_is_also_held_to_the_earlier_rounds_steps(monkeypatch):
    """An attacker that stays under max_mean_ratio × the model's norm is still held to
    max_mean_growth × the median of the mean updates of the rounds applied before."""
    from fedsilo.privacy.secure_stages import SumGuard
    from fedsilo.core.rounds import Outcome

    guard = SumGuard(max_ratio=10.0, max_growth=10.0)
    params = {"w": torch.ones(100)}  # norm 10: max_mean_ratio allows a mean update of 100

    class Inner:  # a secure round's sum, decoded: only the mean update
        like = params

        def __init__(self, size):
            self.size = size

        def finish(self, records):
            return Outcome({"w": torch.full((100,), self.size)}, ["a", "b"], {})

    outcomes = []
    for r, size in enumerate([0.01, 0.012, 0.011, 5.0, 0.013], start=1):  # 5.0: a mean update of norm 50
        outcomes.append(guard.wrap(Inner(size), r, ["a", "b"], {}).finish({}))
    assert [o.delta is not None for o in outcomes] == [True, True, True, False, True]
    assert "max_mean_growth" in outcomes[3].none_reason and "median" in outcomes[3].none_reason
    again = SumGuard(max_ratio=10.0, max_growth=10.0)
    again.load_state_dict(guard.state_dict())  # a resume holds the same history
    assert again.state_dict() == guard.state_dict()


def test_an_honest_secure_run_is_untouched_by_the_guard_and_its_history_resumes_from_the_records(tmp_path):
    torch.set_num_threads(1)
    cfg = toy_config(federation={"rounds": 2, **SECURE}, engine={"workers": 1})
    run = tmp_path / "run"
    run_experiment(cfg, run, show_progress=False)
    records = rounds_of(run)
    assert all(r["applied"] and "skipped" not in r and r["sum_guard"]["passed"] for r in records)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert json.loads(state["server"]["sum_guard"]) == [r["sum_guard"]["mean_norm"] for r in records]
    state["server"]["sum_guard"] = json.dumps([1e9, 1e9])  # a history that would let any step through
    torch.save(state, run / "checkpoint.pt")
    longer = toy_config(federation={"rounds": 3, **SECURE}, engine={"workers": 1})
    with pytest.raises(Exception, match="step history differs from the rounds recorded"):
        run_experiment(longer, run, resume=True, show_progress=False)


@pytest.mark.parametrize("key,value", [("max_mean_ratio", 0), ("max_mean_growth", 0.5), ("max_mean_ratio", True)])
def test_the_guards_settings_are_checked(key, value):
    from fedsilo.config import ConfigError
    with pytest.raises(ConfigError, match=f"secure_aggregation.{key}: must be a finite number"):
        toy_config(federation={"secure_aggregation": {key: value}})
    toy_config(federation={"secure_aggregation": {key: "off"}})


def test_under_silo_level_dp_only_the_growth_is_bounded():
    """The DP noise in the mean can be longer than the model itself: a bound against the model's norm would
    skip honest rounds there."""
    from fedsilo.recipe import build_recipe

    def guard(cfg):
        return next(s for s in build_recipe(cfg).server.stages if s.state_key == "sum_guard")

    plain = guard(toy_config(federation=SECURE))
    dp = guard(toy_config(federation={**SECURE, "weighting": "equal",
                                      "silo_dp": {"mode": "distributed", "clip": 1.0, "noise_multiplier": 1.0}}))
    assert (plain.max_ratio, plain.max_growth) == (10.0, 10.0) and (dp.max_ratio, dp.max_growth) == (None, 10.0)


# ---- SA09: one silo's NaN under secure aggregation --------------------------------------------------------

def test_a_silo_whose_update_is_nan_drops_out_and_the_others_form_the_sum(tmp_path, monkeypatch):
    """Before: every round lost (`... use a larger step`), although 2 of 3 could form the sum."""
    torch.set_num_threads(1)
    hostile(monkeypatch, "gamma", nan)
    cfg = toy_config(federation={"rounds": 2, **SECURE}, engine={"workers": 1})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    for record in rounds_of(tmp_path / "run"):
        assert record["applied"] and record["secure"]["survivors"] == ["alpha", "beta"]
        assert record["secure"]["dropped"] == ["gamma"]
        assert "not finite" in record["clients"]["gamma"]["refused"]
    assert all(torch.isfinite(t).all() for t in _final(tmp_path / "run").values())


def test_the_wrap_message_is_given_only_for_a_finite_input_that_could_wrap():
    with pytest.raises(ValueError) as err:
        encode(np.array([0.0, math.nan]), 2.0 ** -32, 3)
    assert "not finite" in str(err.value) and "larger step" not in str(err.value)
    with pytest.raises(ValueError, match="larger step"):
        encode(np.array([0.0, 1e9]), 2.0 ** -32, 3)


# ---- P19b: an empty update --------------------------------------------------------------------------------

@pytest.mark.parametrize("tensors", [{}, {"b": torch.zeros(0)}], ids=["no tensors", "zero elements"])
def test_an_empty_update_is_rejected_with_a_reason(tensors):
    params = {"w": torch.ones(4), "b": torch.zeros(0)}
    server = server_with(params, ServerOptimizer("fedavg", 1.0), WEIGHTINGS.resolve("equal"))
    server.register({"a": 10, "b": 10, "empty": 10})
    server.begin_round(1)
    for name in ("a", "b"):
        assert server.receive(name, ClientUpdate({"w": torch.full((4,), 2.0)}, 10)) is None
    reason = server.receive("empty", ClientUpdate(tensors, 10))
    record = server.end_round()
    assert reason and "empty update" in reason and record["clients"]["empty"]["rejected"] == reason
    assert record["clients"]["a"]["weight"] == pytest.approx(0.5) and record["clients"]["empty"]["weight"] is None


# ---- P16: self-reported weights without a cap -------------------------------------------------------------

def test_uncapped_self_reported_weights_are_said_at_the_start_of_the_run(tmp_path, capsys):
    cfg = toy_config(federation={"rounds": 1, "weighting": "lorar", "max_weight_ratio": "off"}, engine={"workers": 1})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "self-reported" in line]
    assert len(lines) == 1 and "max_weight_ratio" in lines[0] and "max_client_weight" in lines[0]
    capped = toy_config(federation={"rounds": 1, "weighting": "lorar"}, engine={"workers": 1})
    run_experiment(capped, tmp_path / "capped", show_progress=False)
    assert "self-reported" not in capsys.readouterr().err  # the default cap holds it


def test_the_uncapped_weights_note_reads_the_policys_ability_not_its_name():
    from fedsilo.features.robust import uncapped_weights
    from fedsilo.recipe import build_recipe

    for weighting, expected in (("lorar", True), ("loss", True), ("size", False), ("equal", False)):
        cfg = toy_config(federation={"weighting": weighting, "max_weight_ratio": "off"})
        assert (uncapped_weights(build_recipe(cfg)) is not None) == expected, weighting
    assert uncapped_weights(build_recipe(toy_config(federation={"weighting": "lorar", "max_weight_ratio": "off",
                                                                "max_client_weight": 0.5}))) is None


# ---- W2: the survivor of a killed worker ------------------------------------------------------------------

KILL = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from tests.test_bad_input import toy_file
    from fedsilo.cli import main
    from fedsilo.client.silo import SiloClient

    tmp = Path(sys.argv[1])
    config = toy_file(tmp, federation={"rounds": 2}, engine={"workers": 2})
    parent, fit, done = os.getpid(), SiloClient.fit, tmp / "others-done"

    def fit_then_kill(self, round_idx, *args, **kwargs):
        if os.getpid() != parent and round_idx == 2 and self.name == "beta":
            while not done.exists():  # the other worker trains alpha and gamma, then waits for work
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        out = fit(self, round_idx, *args, **kwargs)
        if os.getpid() != parent and round_idx == 2 and self.name == "gamma":
            done.touch()
        return out

    SiloClient.fit = fit_then_kill
    sys.exit(main(["run", str(config), "--out", str(tmp / "run"), "--no-progress"]))
""")


def test_the_surviving_worker_of_a_killed_one_exits_quietly(tmp_path):
    """Before: the one error line, and the idle survivor's 25-line traceback (`fedsilo.cli.Terminated`: the
    pool ends it with SIGTERM, and it had inherited the run's SIGTERM handler)."""
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=ENV,
                          cwd=ROOT)  # captured until every process holding stderr (the workers too) has exited
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("fedsilo: error:")]
    assert len(errors) == 1 and "worker process died" in errors[0]


# ---- seeded silo-level noise and the hash seed ------------------------------------------------------------

NOISE = textwrap.dedent("""
    import hashlib, sys, torch
    from fedsilo.core.aggregate import RoundAggregator
    from fedsilo.core.weighting import WEIGHTINGS
    from fedsilo.privacy.accountant import Budget
    from fedsilo.privacy.silo_dp import SiloDP

    names = [f"layer{i}.{part}" for i in range(6) for part in ("weight", "bias")]
    like = {n: torch.zeros(3) for n in names}
    agg = RoundAggregator(WEIGHTINGS.get("size"), like=like)
    for c, client in enumerate(("a", "b", "c")):
        agg.add(client, {n: torch.full((3,), float(c + i)) for i, n in enumerate(names)}, 10 + c)
    mean, _ = agg.finish()
    dp = SiloDP(True, 1.0, 1.0, Budget(1.0, 1.0, 1e-5), seed=7)
    out, _ = dp.privatise(mean, {"a": 10.0, "b": 11.0, "c": 12.0}, {"a": 10.0, "b": 11.0, "c": 12.0}, 1)
    digest = hashlib.sha256()
    for name in sorted(out):
        digest.update(name.encode() + out[name].numpy().tobytes())
    print(digest.hexdigest())
""")


def test_seeded_central_noise_does_not_depend_on_the_hash_seed(tmp_path):
    """Before: the aggregate's tensors came out in a set's order, so the seeded noise draws went to other
    tensors under another PYTHONHASHSEED."""
    script = tmp_path / "noise.py"
    script.write_text(NOISE)
    digests = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                              env={**ENV, "PYTHONHASHSEED": seed}, cwd=ROOT).stdout.strip()
               for seed in ("0", "1", "2", "3")}
    assert len(digests) == 1, digests


def test_a_step_over_max_step_ratio_names_that_setting():
    """Before: the reason named federation.max_update_ratio, another setting."""
    params = {"w": torch.ones(4)}
    why = ServerOptimizer("fedavg", 1.0).check_step(params, {"w": torch.full((4,), 1e6)}, 1000.0)
    assert why and "federation.max_step_ratio = 1000" in why and "max_update_ratio" not in why
