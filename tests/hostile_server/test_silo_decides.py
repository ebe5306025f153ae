"""The silo decides (issue 49): every parameter that decides what a silo releases is fixed where its operator
set it, or committed identically by every silo of a round before anything is masked. A lying coordinator
drives the real Flower ClientApp (tests/hostile_server/driver.py) with each attack of the issue; each
test says what the attack got before (main a1d8830) and asserts what holds now: dp-accounting over the
distinct releases the server received stays within the silo's target at the scope's δ, and no sum or
difference of sums the server holds equals one silo's input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from fedsilo.config import ConfigError
from fedsilo.core.transforms import SiloRefused
from fedsilo.engines.flower import client_app
from fedsilo.engines.flower.codec import pack, pack_keys, unpack, unpack_shares
from fedsilo.privacy import roster as rosters
from fedsilo.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedsilo.privacy.secagg import SecAggServer, SecAggSettings, decode
from tests.hostile_server.driver import ScriptedServer, toy_raw
from tests.hostile_server.test_ledger import DELTA, DP, TARGET, true_epsilon
from tests.hostile_server.test_secagg_active import masked_length, node_identity

NAMES = ["alpha", "beta", "gamma"]
STEP = SecAggSettings().step


@pytest.fixture(autouse=True)
def fresh_process():
    client_app._SILOS.clear()
    yield
    client_app._SILOS.clear()


def refusal(server: ScriptedServer, round_idx: int, **kw) -> str:
    """The round is refused and nothing left the silo; the reason."""
    sent = len(server.sent)
    update, refused = server.train(round_idx, **kw)
    assert update is None and refused is not None, f"round {round_idx} trained"
    assert len(server.sent) == sent
    return refused[0]


# ---- 1. δ is the scope's ----------------------------------------------------------------------------

def test_a_message_with_another_delta_is_refused_and_the_true_epsilon_stays_at_the_scopes_delta(tmp_path):
    """Before: after the budget was spent at δ = 1e-3, `client.dp.delta = 0.5` passed four more releases
    (true ε at the scope's δ 6.20, reported 1.45)."""
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path)
    for r in (1, 2, 3, 4):
        s.train(r)
    lying = {"client": {"dp": {"target_epsilon": TARGET, "delta": 0.5}}}
    for r in (5, 6, 7, 8):
        reason = refusal(s, r, override=lying)
        assert "client.dp.delta = 0.5" in reason and "δ = 0.001, pinned by its first release" in reason
    assert true_epsilon(s.sent, DELTA) <= TARGET * (1 + 1e-9)
    # a config that leaves δ out takes the scope's: an honest new run goes on at δ = 1e-3
    update, refused = s.train(1, run_key="run-2", override={"client": {"dp": {"target_epsilon": TARGET}}})
    assert refused is None or "privacy budget" in refused[0]
    assert all(m.get("delta") in (None, DELTA) for e in PrivacyLedger(tmp_path / LEDGER_FILE).entries()
               for m in e["mechanisms"])


def test_a_delta_of_one_over_n_or_more_is_refused_always(tmp_path):
    """toyrank's 8 training examples: δ = 0.2 would allow releasing one of them outright."""
    s = ScriptedServer(toy_raw(client={"dp": {"noise_multiplier": 1.0, "delta": 0.2}}), "alpha", tmp_path)
    assert "client.dp.delta = 0.2: at least 1/n for silo alpha's n = 8 examples" in refusal(s, 1)


def test_the_policys_max_delta_refuses_a_larger_delta(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("max_delta = 1e-5\n")
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path / "state", policy=str(policy))
    assert "max_delta: the round would spend this silo's budget at δ = 0.001 > 1e-05" in refusal(s, 1)


# ---- 2. one budget for one dataset --------------------------------------------------------------------

@pytest.mark.parametrize("knob,values", [("max_train", [8, 7, 6]), ("train_fraction", [1.0, 0.9, 0.8])])
def test_subsets_of_the_same_files_share_one_budget(tmp_path, knob, values):
    """Before: the scope was a fingerprint of the examples the server's config selected: `max_train` 8, 7, 6
    gave three scopes over nested data, 9 releases, true ε 7.43 for the shared examples against 4."""
    from tests.synth import tiny_config, write_silos
    data = write_silos(tmp_path / "data")
    raw = tiny_config(data, client={"epochs": 1, "batch_size": 4, "dp": {"target_epsilon": TARGET, "delta": DELTA}},
                      federation={"rounds": 3, "weighting": "size"}, server={"optimizer": "fedavg"})
    raw["clients"] = {}
    s = ScriptedServer(raw, "restaurants", tmp_path / "state", **{"data-dir": str(data)})
    for k, value in enumerate(values):
        for r in (1, 2, 3):
            s.train(r, run_key=f"run-{k}", override={"task": {knob: value}})
    scopes = {e["scope"] for e in PrivacyLedger(tmp_path / "state" / LEDGER_FILE).entries()}
    assert len(scopes) == 1 and next(iter(scopes)).startswith("data:")
    assert len(s.sent) >= 2
    assert true_epsilon(s.sent, DELTA) <= TARGET * (1 + 1e-9)


# ---- secure rounds a scripted server runs over real ClientApps ------------------------------------------

def silos(tmp_path, raw: dict, **node) -> dict[str, ScriptedServer]:
    ids = rosters.ephemeral_identities(NAMES)
    return {n: ScriptedServer(raw, n, tmp_path / n, **node_identity(tmp_path, ids[n]), **node) for n in NAMES}


def secure_round(parties: dict[str, ScriptedServer], length: int, run_key: str, round_idx: int, params: dict,
                 stage1: dict | None = None, train: dict | None = None, signers: list[str] | None = None):
    """One protocol run as the server scripts it. `stage1` / `train`: {silo: (params, config override)} a
    silo is sent instead of the honest (`params`, no override); `signers`: whom the consistency round asks.
    Returns (the sum the server unmasked or None, the silos' refusals)."""
    names, refusals = list(parties), []
    stage1, train = stage1 or {}, train or {}
    server = SecAggServer(names, SecAggSettings(), length, f"{run_key}/{round_idx}")
    adverts = {}
    for n, s in parties.items():
        model, override = stage1.get(n, (params, None))
        reply = s.query("secagg_keys", run_key=run_key, override=override, round=round_idx, silos=names,
                        **{"protocol-round": f"{run_key}/{round_idx}", "model-digest": s.model_digest(model)})
        adverts[n] = {k: bytes(v) for k, v in reply.content["secagg"].items()}
    keys = server.collect_keys(adverts)
    sent = {}
    for n, s in parties.items():
        try:
            reply = s.query("secagg_share", run_key=run_key, round=round_idx, records={"secagg": pack_keys(keys)})
            sent[n] = unpack(reply.content["secagg"], "to")
        except SiloRefused as err:
            refusals.append(str(err))
    if len(sent) < server.threshold:
        return None, refusals
    inboxes = server.route_packets(sent)
    masked = {}
    for n in inboxes:
        model, override = train.get(n, (params, None))
        update, refused = parties[n].train(round_idx, params=model, run_key=run_key, override=override,
                                           secagg=pack(inboxes[n], "from"))
        if refused is not None:
            refusals.append(refused[0])
        else:
            masked[n] = update.tensors["masked"].numpy()
    if len(masked) < server.threshold:
        return None, refusals
    survivors = server.survivors(masked)
    asked = [n for n in survivors if signers is None or n in signers]
    signed = {n: {"sig": bytes(parties[n].query("secagg_check", run_key=run_key, round=round_idx,
                                                 survivors=survivors).content["secagg"]["sig"])} for n in asked}
    if len(signed) < server.threshold:
        return None, refusals
    signatures = server.unmask_request(signed)
    replies = {}
    for n in signatures:
        try:
            reply = parties[n].query("secagg_unmask", run_key=run_key, round=round_idx,
                                     records={"secagg": pack(signatures, "sig")})
            replies[n] = unpack_shares(reply.content["secagg"])
        except SiloRefused as err:
            refusals.append(str(err))
    return server.aggregate(masked, replies), refusals


def masked_inputs(monkeypatch) -> dict[str, list[np.ndarray]]:
    """{silo: every vector it masked, in order} (the ground truth a difference of sums is compared with)."""
    from fedsilo.privacy.secagg import SecAggClient
    seen: dict[str, list[np.ndarray]] = {}
    real = SecAggClient.masked_input

    def masked_input(self, x, packets):
        seen.setdefault(self.name, []).append(np.array(x, dtype=np.float64))
        return real(self, x, packets)

    monkeypatch.setattr(SecAggClient, "masked_input", masked_input)
    return seen


# ---- 3. two secure sums, one difference ------------------------------------------------------------------

def test_a_second_sum_over_the_same_model_is_refused_by_every_silo_that_masked_it(tmp_path, monkeypatch):
    """Before: one sum over {alpha, beta, gamma}, then one over {beta, gamma} with the same model and config
    (a new run key, or round 2 of the same run): beta and gamma sent bit-identical inputs and S1 − S2 was
    alpha's update to 1.2e-10."""
    raw = toy_raw(federation={"secure_aggregation": {}})
    parties = silos(tmp_path, raw)
    length, params = masked_length(raw, tmp_path), parties["alpha"].global_params()
    s1, refusals = secure_round(parties, length, "run-1", 1, params)
    assert s1 is not None and not refusals
    pair = {n: parties[n] for n in ("beta", "gamma")}
    for run_key, round_idx in (("run-2", 1), ("run-1", 2)):
        s2, refusals = secure_round(pair, length, run_key, round_idx, params)
        assert s2 is None and len(refusals) == 2
        assert all("would mask a second input trained from the model this silo already masked one from" in r
                   for r in refusals)


@pytest.mark.parametrize("secret", [True, False])
def test_a_nudged_model_gets_a_second_sum_whose_difference_is_not_one_silos_input(tmp_path, monkeypatch, secret):
    """The server nudges one coordinate so the ledger sees another model: beta and gamma mask again. Their
    secret randomness (data order, dropout) makes the second inputs differ from the first, so S1 − S2 is
    not alpha's input. Without it (the operator's `secret-randomness=false`) the difference is alpha's
    input to the nudge's size: what secure aggregation alone cannot hide across rounds, said in
    docs/privacy.md; only noise bounds it."""
    seen = masked_inputs(monkeypatch)
    raw = toy_raw(federation={"secure_aggregation": {}})
    parties = silos(tmp_path, raw, **({} if secret else {"secret-randomness": False}))
    length, params = masked_length(raw, tmp_path), parties["alpha"].global_params()
    s1, _ = secure_round(parties, length, "run-1", 1, params)
    nudged = {k: v.clone() for k, v in params.items()}
    first = next(iter(nudged))
    nudged[first].view(-1)[0] += 1e-6
    s2, refusals = secure_round({n: parties[n] for n in ("beta", "gamma")}, length, "run-2", 1, nudged)
    assert s2 is not None and not refusals
    alpha = seen["alpha"][0]
    error = float(np.linalg.norm(s1 - s2 - alpha) / np.linalg.norm(alpha))
    print(f"secret randomness {secret}: |S1 - S2 - x_alpha| / |x_alpha| = {error:.3g}")
    if secret:
        assert error > 0.05, error
    else:
        assert error < 1e-3, error


# ---- 4. one round, different messages -------------------------------------------------------------------

def lr(value: float) -> dict:
    return {"client": {"lr": value}}


def zero(params: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in params.items()}


@pytest.mark.parametrize("attack", ["lr at stage 1", "lr at training", "zero model at stage 1",
                                    "zero model at training", "alpha left out of the signing"])
def test_silos_sent_different_models_or_configs_in_one_round_mask_nothing(tmp_path, monkeypatch, attack):
    """Before: beta and gamma were sent `client.lr = 1e-30` (or an all-zero model) in alpha's round: the sum
    minus their known weights was alpha's update to 1.2e-10, with a strict policy and with alpha left out of
    the signing. Now every silo's stage-1 advert commits to the run key, the round, the model and its
    resolved config; a silo masks only when every peer committed the same, and trains only what it
    committed to."""
    seen = masked_inputs(monkeypatch)
    raw = toy_raw(federation={"secure_aggregation": {}})
    parties = silos(tmp_path, raw)
    length, params = masked_length(raw, tmp_path), parties["alpha"].global_params()
    lying = {"lr at stage 1": ({n: (params, lr(1e-30)) for n in ("beta", "gamma")}, None),
             "lr at training": (None, {n: (params, lr(1e-30)) for n in ("beta", "gamma")}),
             "zero model at stage 1": ({n: (zero(params), None) for n in ("beta", "gamma")}, None),
             "zero model at training": (None, {n: (zero(params), None) for n in ("beta", "gamma")}),
             "alpha left out of the signing": ({n: (zero(params), None) for n in ("beta", "gamma")},
                                               {n: (zero(params), None) for n in ("beta", "gamma")})}[attack]
    total, refusals = secure_round(parties, length, "run-1", 1, params, *lying,
                                   signers=["beta", "gamma"] if "signing" in attack else None)
    assert total is None, "the server unmasked a sum"
    assert refusals
    if "stage 1" in attack or "signing" in attack:
        assert any("committed to another model or training config" in r for r in refusals) and "alpha" not in seen
    else:
        assert sum("than the one it committed to at stage 1" in r for r in refusals) == 2


# ---- 5. a roster means masked ----------------------------------------------------------------------------

def test_a_silo_with_a_roster_refuses_an_unmasked_round_unless_its_operator_opts_out(tmp_path):
    """Before: a node config with a roster and a signing key but no policy file sent its update in the clear
    when the config left out [federation.secure_aggregation]."""
    ids = rosters.ephemeral_identities(NAMES)
    s = ScriptedServer(toy_raw(), "alpha", tmp_path / "alpha", **node_identity(tmp_path, ids["alpha"]))
    assert "holds a roster: it sends no update in the clear" in refusal(s, 1)
    client_app._SILOS.clear()
    (tmp_path / "opted").mkdir()
    opted = ScriptedServer(toy_raw(), "alpha", tmp_path / "opted" / "state",
                           **node_identity(tmp_path / "opted", ids["alpha"]), **{"allow-unmasked": True})
    update, refused = opted.train(1)
    assert refused is None and update.tensors


def test_a_silo_with_a_roster_and_no_noise_is_warned_and_require_noise_refuses_it(tmp_path, capsys):
    ids = rosters.ephemeral_identities(NAMES)
    policy = tmp_path / "policy.toml"
    policy.write_text("require_noise = true\n")
    s = ScriptedServer(toy_raw(federation={"secure_aggregation": {}}), "alpha", tmp_path / "alpha",
                       policy=str(policy), **node_identity(tmp_path, ids["alpha"]))
    s.query("secagg_keys", round=1, silos=NAMES, **{"protocol-round": "run-1/1"})
    assert "holds a roster but adds no DP noise" in capsys.readouterr().err
    assert "require_noise: the round adds no secret DP noise on this silo" in refusal(s, 1)


# ---- 6. only dev and test ----------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "unlabelled", ""])
def test_only_dev_and_test_are_evaluated(tmp_path, split):
    """Before: `evaluate` named its split, and a silo under require_dp evaluated `train` and returned its
    statistics (per record with final = true)."""
    from fedsilo.engines.flower.codec import to_arrays
    policy = tmp_path / "policy.toml"
    policy.write_text("require_dp = true\n")
    s = ScriptedServer(toy_raw(client=DP), "alpha", tmp_path / "state", policy=str(policy))
    arrays = to_arrays(s.global_params())
    with pytest.raises(SiloRefused, match=f"evaluation of split '{split}' refused: a silo evaluates only dev, test"):
        s.send("evaluate", s.config(split=split, final=True, **{"state-round": 0}), arrays=arrays)
    reply = s.send("evaluate", s.config(split="dev", final=False, **{"state-round": 0}), arrays=arrays)
    assert not reply.has_error() and "rows" in reply.content


# ---- 7. the ledger's place is never per run -------------------------------------------------------------

def flower_example_node(s: ScriptedServer) -> ScriptedServer:
    """The SuperNode configured as Flower's own examples do: `partition-id` alone, no silo, no state-dir."""
    s.node_config = {"partition-id": 0, "num-partitions": 3}
    s.context = Context(run_id=1, node_id=1, node_config=s.node_config, state=RecordDict(), run_config={})
    return s


def test_a_dp_silo_on_a_supernode_that_names_no_ledger_place_is_refused(tmp_path, monkeypatch):
    """Before: such a SuperNode kept its ledger per run key: 3 run keys × 3 rounds, true ε 7.25 against 4."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    s = flower_example_node(ScriptedServer(toy_raw(client=DP), "alpha", tmp_path))
    with pytest.raises(ConfigError, match="names no place for its privacy ledger: set state-dir"):
        s.train(1)
    assert s.sent == []
    # fedsilo's own simulation (its operator runs every silo; the environment says so, no message can)
    monkeypatch.setenv(client_app.SIMULATION, "1")
    client_app._SILOS.clear()
    update, refused = s.train(1)
    assert refused is None and update is not None


def test_a_node_flag_that_is_not_true_or_false_is_named(tmp_path):
    """`allow-unmasked="yes"` is no opt-out the operator meant to give: one error naming the key."""
    ids = rosters.ephemeral_identities(NAMES)
    s = ScriptedServer(toy_raw(), "alpha", tmp_path / "alpha", **node_identity(tmp_path, ids["alpha"]),
                       **{"allow-unmasked": "yes"})
    with pytest.raises(ConfigError, match="node config allow-unmasked = 'yes': must be true or false"):
        s.train(1)
