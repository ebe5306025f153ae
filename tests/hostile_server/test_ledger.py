"""A silo's DP budget is the silo's, not the run's (issue 40): its privacy ledger (fedsilo.privacy.ledger)
against a coordinator that replays rounds, starts new runs, retries and resumes, driven through the real
Flower ClientApp (tests/hostile_server/driver.py). Each attack is refused before anything leaves, or the
silo's true ε — computed here with Google's dp-accounting from every update that actually left — stays
within its target and equals the ε the silo reports, to 1e-3."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest
import torch

from fedsilo.core.tensors import tensor_digest
from fedsilo.engines.flower import client_app
from fedsilo.privacy.accountant import ORDERS, Budget
from tests.hostile_server.driver import ScriptedServer, toy_raw

ROOT = Path(__file__).resolve().parents[2]
TARGET, DELTA = 4.0, 1e-3
DP = {"dp": {"target_epsilon": TARGET, "delta": DELTA}}


def digest(update) -> str:
    """The sha256 of an update's tensors (a killed process's log carries it as `digest`)."""
    return getattr(update, "digest", None) or tensor_digest(update.tensors, {})


def true_epsilon(sent: list[dict], delta: float = DELTA) -> float:
    """ε of every distinct update that left the silo (an identical re-send is the same release), from
    dp-accounting's RDP accountant at the same orders: each update is a round of `steps` Poisson-sampled
    Gaussian steps at the σ and q it reports."""
    releases = {digest(s["update"]): s["update"] for s in sent}
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    for update in releases.values():
        p = update.privacy
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            p["sample_rate"], dp_accounting.GaussianDpEvent(p["noise_multiplier"])), int(update.steps))
    return accountant.get_epsilon(delta)


def reported_epsilon(server: ScriptedServer) -> float:
    return server.sent[-1]["update"].privacy["epsilon"]


def assert_within_target_and_honest(server: ScriptedServer, target: float = TARGET) -> float:
    eps = true_epsilon(server.sent)
    assert eps <= target * (1 + 1e-9), f"{len(server.sent)} updates left: true ε = {eps:.3f} > target {target}"
    assert reported_epsilon(server) == pytest.approx(eps, abs=1e-3)
    return eps


def restarted(server: ScriptedServer, **kw) -> ScriptedServer:
    """The same silo (same state folder, same node config) after its SuperNode process restarted."""
    client_app._SILOS.clear()
    again = ScriptedServer(server.raw, server.silo, Path(server.node_config["state-dir"]),
                           **{**{k: v for k, v in server.node_config.items() if k not in ("silo", "state-dir")}, **kw})
    again.sent = server.sent
    return again


@pytest.fixture(autouse=True)
def fresh_process():
    client_app._SILOS.clear()
    yield
    client_app._SILOS.clear()


# ---- the attacks -------------------------------------------------------------------------------------

def test_replayed_rounds_are_refused_and_the_true_epsilon_stays_within_the_target(tmp_path):
    """Issue 40's replay: rounds 1, 2, 3, 1, 2, 1, 2 to a silo of target ε = 4. Before the ledger six DP
    releases left (true ε 7.245) while the silo reported 3.995."""
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path)
    refusals = []
    for r in (1, 2, 3, 1, 2, 1, 2):
        update, refused = s.train(r)
        if refused is not None:
            refusals.append((r, refused[0]))
    assert_within_target_and_honest(s)
    replays = [reason for r, reason in refusals if r in (1, 2)]
    assert len(replays) == 4, refusals
    for reason in replays:
        assert "\n" not in reason and "privacy ledger" in reason and "not above round" in reason


def test_a_new_run_key_does_not_reset_the_budget(tmp_path):
    """A fresh run key starts a fresh store, never a fresh budget: runs on the same data add up."""
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path)
    for key in ("run-1", "run-2", "run-3"):
        for r in (1, 2, 3):
            s.train(r, run_key=key)
    assert len(s.sent) >= 3
    assert_within_target_and_honest(s)


def test_a_retry_of_the_same_round_resends_the_identical_update_at_no_cost(tmp_path):
    """flower.retries > 0: the same round with the same global model again. The silo sends back exactly
    what it released, without training and without spending; a retry with another payload is refused."""
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path)
    params = s.global_params()
    s.train(1, params)
    first, _ = s.train(2, params)
    again, refused = s.train(2, params)
    assert refused is None
    assert digest(again) == digest(first) and again.privacy == first.privacy
    assert all(torch.equal(again.tensors[k], first.tensors[k]) for k in first.tensors)
    other = {k: v + 0.01 for k, v in params.items()}
    _, refused = s.train(2, other)
    assert refused is not None and "privacy ledger" in refused[0]
    s.train(3, params)
    assert_within_target_and_honest(s)


def test_a_resumed_server_that_resends_its_round_gets_the_stored_update(tmp_path):
    """The ServerApp crashed in round 2 after alpha answered, and the SuperNode restarted too: the resumed
    server re-sends round 2 from its round-1 checkpoint (the same global model): the identical update,
    no new release; re-sending round 1 (older than its checkpoint) is refused."""
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path)
    params = s.global_params()
    s.train(1, params)
    first, _ = s.train(2, params)
    s = restarted(s)
    again, refused = s.train(2, params)
    assert refused is None and digest(again) == digest(first)
    _, refused = s.train(1, params)
    assert refused is not None and "not above round 2" in refused[0]
    s.train(3, params)
    assert_within_target_and_honest(s)


def test_rounds_below_the_round_index_still_count_the_asked_round(tmp_path):
    """`federation.rounds` below the round index: the max_epsilon projection counts the round being asked
    (before: it left it out, 13.357 projected where the round took the silo to 14.568)."""
    sigma, q, steps = 0.8, 0.5, 2  # the toy silo: 8 examples, batch 4, one epoch
    eps = [Budget(sigma, q, DELTA).epsilon(steps * k) for k in (1, 2, 3)]
    limit = (eps[1] + eps[2]) / 2
    policy = tmp_path / "policy.toml"
    policy.write_text(f"max_epsilon = {limit}\n")
    s = ScriptedServer(toy_raw(client={"dp": {"noise_multiplier": sigma, "delta": DELTA}},
                               federation={"rounds": 2}), "alpha", tmp_path / "state", policy=str(policy))
    s.train(1)
    s.train(2)
    update, refused = s.train(3, override={"federation": {"rounds": 2}})
    assert update is None and refused is not None and "max_epsilon" in refused[0]
    assert true_epsilon(s.sent) <= limit
    assert reported_epsilon(s) == pytest.approx(true_epsilon(s.sent), abs=1e-3)


# ---- kill -9 between writing and sending ------------------------------------------------------------

CHILD = r'''
import json, os, signal, sys
from pathlib import Path
from tests.hostile_server.driver import ScriptedServer, toy_raw
from fedsilo.core.tensors import tensor_digest
from fedsilo.engines.flower import client_app
from fedsilo.privacy import ledger as L

state, point, crash = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
now = {"round": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def at(point_name, real):
    def wrapped(*a, **kw):
        if point == point_name and now["round"] == crash:
            if point_name == "inside-line":  # half the line on disk, then killed
                entry = a[1]
                with open(a[0].path, "ab") as fh:
                    fh.write(json.dumps(entry, sort_keys=True).encode()[:40])
                    fh.flush(); os.fsync(fh.fileno())
                die()
            if point_name == "before-reply":
                die()
        out = real(*a, **kw)
        if point == point_name and now["round"] == crash:
            die()
        return out
    return wrapped

L.write_resend = at("after-record", L.write_resend)
L.PrivacyLedger.append = at("inside-line", at("after-line", L.PrivacyLedger.append))
client_app.update_to_content = at("before-reply", client_app.update_to_content)

s = ScriptedServer(toy_raw(client={"dp": {"target_epsilon": 4.0, "delta": 1e-3}}), "alpha", state)
params = s.global_params()
for r in (1, 2, 3):
    now["round"] = r
    update, refused = s.train(r, params)
    if update is not None:  # it left: the coordinator has it
        with open(state.parent / "sent.jsonl", "a") as fh:
            fh.write(json.dumps({"round": r, "tensors": tensor_digest(update.tensors, {}), "steps": update.steps,
                                 "privacy": update.privacy}) + "\n")
            fh.flush(); os.fsync(fh.fileno())
'''


class Sent:
    """An update that left the killed process, as its log describes it (for `true_epsilon`)."""
    def __init__(self, row: dict) -> None:
        self.privacy, self.steps, self.digest = row["privacy"], row["steps"], row["tensors"]


@pytest.mark.parametrize("point", ["after-record", "inside-line", "after-line", "before-reply"])
def test_a_silo_killed_between_writing_and_sending_misses_no_release(tmp_path, point):
    """kill -9 in round 2: after the stored release, inside the ledger line, after it, before the reply.
    After the restart every release that left is in the ledger; the retried round either re-sends the
    identical update (its line was written) or trains afresh (nothing of it had left); ε stays honest."""
    from fedsilo.privacy.ledger import LEDGER_FILE, PrivacyLedger, read_resend

    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(state), point, "2"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == -9, child.stderr[-3000:]
    left = [json.loads(line) for line in (tmp_path / "sent.jsonl").read_text().splitlines()]
    assert [row["round"] for row in left] == [1]

    ledger = PrivacyLedger(state / LEDGER_FILE)
    lines = ledger.entries()  # readable, whatever the kill left
    assert {(e["run"], e["round"]) for e in lines} >= {("run-1", row["round"]) for row in left}
    written = any(e["round"] == 2 for e in lines)
    assert written == (point in ("after-line", "before-reply"))

    s = ScriptedServer(toy_raw(client=DP), "alpha", state)
    params = s.global_params()
    stored = read_resend(next((state / "privacy-ledger.resend").iterdir()))[1] if written else None
    retried, refused = s.train(2, params)
    assert refused is None
    if written:  # the identical update, at no cost
        assert all(torch.equal(retried.tensors[k], stored.update.tensors[k].to(retried.tensors[k].dtype))
                   for k in stored.update.tensors)
    s.train(3, params)
    rounds = [e["round"] for e in ledger.entries() if e["run"] == "run-1"]
    assert rounds == [1, 2, 3]  # every release once, none missing
    sent = [{"update": Sent(row)} for row in left] + s.sent
    assert len({digest(x["update"]) for x in sent}) == 3
    eps = true_epsilon(sent)
    assert eps <= TARGET and reported_epsilon(s) == pytest.approx(eps, abs=1e-3)


# ---- the re-send rule, the scope, the local reset ------------------------------------------------------

def one_release(tmp_path: Path, masked: bool = False):
    from fedsilo.core.messages import ClientUpdate
    from fedsilo.privacy.ledger import PrivacyLedger, SiloLedger

    silo = SiloLedger(PrivacyLedger(tmp_path / "ledger.jsonl"), "run-1", "data:test", "alpha")
    received = {"w": torch.zeros(3)}
    update = ClientUpdate({"w": torch.randn(3)}, 8, 2, privacy={"epsilon": 1.0})
    mechanism = {"level": "record", "noise_multiplier": 1.0, "sample_rate": 0.5, "steps": 2, "delta": DELTA}
    silo.record(1, silo.admit(1, received, secure=masked), update, [mechanism], {"own": {"b": torch.ones(2)}},
                {"steps_done": 2}, masked=masked)
    return silo, received, update


@pytest.mark.parametrize("then_masked,now_masked", [(True, True), (False, True), (True, False)])
def test_no_resend_under_secure_aggregation(tmp_path, then_masked, now_masked):
    """A masked input unmasked twice, over two survivor sets, reveals it: a re-send is refused, also when
    the server switches secure aggregation off for the re-send (the plain update never left before)."""
    from fedsilo.core.transforms import SiloRefused

    silo, received, _ = one_release(tmp_path, masked=then_masked)
    with pytest.raises(SiloRefused, match="secure aggregation"):
        silo.admit(1, received, secure=now_masked)


def test_a_resend_is_the_stored_release_only_when_its_sha256_is_the_ledgers(tmp_path):
    from fedsilo.core.transforms import SiloRefused
    from fedsilo.privacy.ledger import read_resend, write_resend

    silo, received, update = one_release(tmp_path)
    again = silo.admit(1, received, secure=False).resend
    assert torch.equal(again.update.tensors["w"], update.tensors["w"]) and again.meta == {"steps_done": 2}
    assert torch.equal(again.slots["own"]["b"], torch.ones(2))
    _, stored = read_resend(silo.resend_path)  # the record replaced by another update: no proof, nothing sent
    stored.update.tensors["w"] = stored.update.tensors["w"] + 1
    write_resend(silo.resend_path, "run-1", 1, stored.update, stored.slots, stored.meta)
    with pytest.raises(SiloRefused, match="sha256 differs"):
        silo.admit(1, received, secure=False)
    with pytest.raises(SiloRefused, match="another global model"):
        silo.admit(1, {"w": torch.ones(3)}, secure=False)


def test_scopes_add_up_by_data_and_reset_is_a_local_command_that_archives(tmp_path, capsys):
    """Two silos' data are two scopes; `fedsilo ledger reset` moves one scope's lines to an archive (none
    deleted), after which that scope's budget starts again; `fedsilo ledger show` prints ε per scope."""
    from fedsilo.cli import main
    from fedsilo.privacy.ledger import LEDGER_FILE, PrivacyLedger

    state = tmp_path / "state"
    s = ScriptedServer(toy_raw(client=DP), "alpha", state)
    s.train(1)
    s.train(2)
    other = ScriptedServer(toy_raw(client=DP), "alpha", state, run_key="run-2", **{"ledger-scope": "operator-named"})
    other.train(1)
    path = state / LEDGER_FILE
    before = PrivacyLedger(path).entries()
    assert sorted({e["scope"] for e in before}) == sorted({before[0]["scope"], "operator-named"})
    data_scope = before[0]["scope"]
    assert data_scope.startswith("examples:")  # toyrank reads no files: its training examples

    assert main(["ledger", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert f"scope {data_scope}: 2 release(s) in 1 run(s)" in shown
    eps = shown.split(f"scope {data_scope}")[1].split("ε = ")[1].split()[0]
    assert float(eps) == pytest.approx(reported_epsilon(s), abs=1e-4)

    assert main(["ledger", "reset", str(path), "--scope", data_scope]) == 0
    capsys.readouterr()
    after = PrivacyLedger(path).entries()
    assert [e["scope"] for e in after] == ["operator-named"]
    archives = list(state.glob("privacy-ledger.archived-*.jsonl"))
    assert len(archives) == 1 and len(PrivacyLedger(archives[0]).entries()) == 2
    assert main(["ledger", "reset", str(path), "--scope", "nothing-there"]) == 2  # one line, no traceback
    assert "no entry of scope 'nothing-there'" in capsys.readouterr().err
    client_app._SILOS.clear()
    fresh = ScriptedServer(toy_raw(client=DP), "alpha", state, run_key="run-3")
    update, refused = fresh.train(1)
    assert refused is None and update.privacy["epsilon"] == pytest.approx(true_epsilon(fresh.sent), abs=1e-3)


def test_an_in_process_resume_re_sends_the_released_round_and_spends_it_once(tmp_path, monkeypatch):
    """In-process the ledger is <out>/privacy-ledger/<silo>.jsonl: a run interrupted after alpha released
    round 2 resumes from round 1's checkpoint; alpha's round 2 is the stored release, once in its ledger,
    and each silo's ε per round is the uninterrupted run's."""
    from fedsilo.privacy.ledger import PrivacyLedger
    from fedsilo.runs.runner import run_experiment
    from tests.killed_run import interrupted_in_round_two
    from tests.test_plugins import toy_config

    cfg = toy_config(client={"dp": {"target_epsilon": 5.0}}, federation={"rounds": 3})
    run_experiment(cfg, tmp_path / "whole", show_progress=False)
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "cut", loop="train_private")
    cut = PrivacyLedger(tmp_path / "cut" / "privacy-ledger" / "alpha.jsonl")
    assert [e["round"] for e in cut.entries()] == [1, 2]  # released, but the server's round 2 was lost
    run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    for silo in ("alpha", "beta", "gamma"):
        whole = PrivacyLedger(tmp_path / "whole" / "privacy-ledger" / f"{silo}.jsonl").entries()
        again = PrivacyLedger(tmp_path / "cut" / "privacy-ledger" / f"{silo}.jsonl").entries()
        assert [e["round"] for e in again] == [e["round"] for e in whole] == [1, 2, 3]
        assert [e["mechanisms"] for e in again] == [e["mechanisms"] for e in whole]
    rounds = [json.loads(x) for x in (tmp_path / "cut" / "rounds.jsonl").read_text().splitlines()]
    assert rounds[1]["clients"]["alpha"]["privacy"]["steps"] == 4
