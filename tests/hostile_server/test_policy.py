"""A silo's own policy (fedsilo.client.policy) against a coordinator that changes its config mid-run: the
real Flower ClientApp, driven by a scripted server (tests/hostile_server/driver.py), refuses each round
that breaks a rule — naming the rule — before anything leaves, and reads every rule from the config of
the message that asked for the round, not from an earlier one."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedsilo.client.policy import Asked, SiloPolicy, breach, read_policy
from fedsilo.errors import ConfigError
from tests.hostile_server.driver import ScriptedServer, toy_raw

DP = {"noise_multiplier": 1.0, "delta": 1e-3}


def silo(tmp_path: Path, policy: str, **sections) -> ScriptedServer:
    path = tmp_path / "alpha-policy.toml"
    path.write_text(policy)
    return ScriptedServer(toy_raw(**sections), "alpha", tmp_path / "state", policy=str(path))


def refused_by(server: ScriptedServer, round_idx: int, rule: str, **override) -> str:
    """The round is refused, naming `rule`, and nothing left the silo."""
    sent = len(server.sent)
    update, refused = server.train(round_idx, override=override)
    assert update is None and refused is not None, f"round {round_idx} trained: {update.privacy if update else ''}"
    reason, _ = refused
    assert f": {rule}: " in reason, reason
    assert len(server.sent) == sent
    return reason


def trains(server: ScriptedServer, round_idx: int, **override):
    update, refused = server.train(round_idx, override=override)
    assert refused is None, refused
    return update


def test_max_epsilon_implies_dp_a_server_that_switches_dp_off_mid_run_is_refused(tmp_path):
    server = silo(tmp_path, "max_epsilon = 50.0\n", client={"dp": DP})
    assert trains(server, 1).privacy["noise_multiplier"] == 1.0
    reason = refused_by(server, 2, "max_epsilon", client={"dp": None})
    assert "without record-level DP" in reason


def test_a_token_noise_is_refused_by_min_noise_multiplier(tmp_path):
    """require_dp alone takes any σ > 0; min_noise_multiplier sets the floor."""
    server = silo(tmp_path, "require_dp = true\nmin_noise_multiplier = 0.5\n",
                  client={"dp": {"noise_multiplier": 1e-6, "delta": 1e-3}})
    reason = refused_by(server, 1, "min_noise_multiplier")
    assert "σ = 1e-06" in reason


def test_min_noise_multiplier_implies_dp(tmp_path):
    server = silo(tmp_path, "min_noise_multiplier = 0.5\n")
    refused_by(server, 1, "min_noise_multiplier")


def test_lowering_sigma_mid_run_is_refused(tmp_path):
    server = silo(tmp_path, "min_noise_multiplier = 0.5\n", client={"dp": DP})
    trains(server, 1)
    refused_by(server, 2, "min_noise_multiplier", client={"dp": {"noise_multiplier": 0.1, "delta": 1e-3}})
    assert trains(server, 3).privacy["noise_multiplier"] >= 0.5  # the honest config again: it trains


def test_lowering_sigma_through_a_larger_target_epsilon_is_refused(tmp_path):
    """σ derived from target_epsilon: a server that raises the target asks for less noise."""
    server = silo(tmp_path, "min_noise_multiplier = 0.5\n", client={"dp": {"target_epsilon": 4.0, "delta": 1e-3}})
    assert trains(server, 1).privacy["noise_multiplier"] >= 0.5
    refused_by(server, 2, "min_noise_multiplier", client={"dp": {"target_epsilon": 1000.0, "delta": 1e-3}})


def test_seeded_noise_is_refused_under_max_epsilon_alone(tmp_path):
    """The server chooses the run seed: seeded noise is no DP against it, whichever DP rule asks for DP."""
    server = silo(tmp_path, "max_epsilon = 50.0\n", client={"dp": DP})
    refused_by(server, 1, "max_epsilon", client={"dp": {**DP, "noise": "seeded"}})


def test_un_privating_a_tensor_mid_run_is_refused(tmp_path):
    server = silo(tmp_path, 'allow_tensors = ["bert.*"]\n', exchange={"private": ["classifier.*"]})
    sent = trains(server, 1)
    assert sent.tensors and not any(k.startswith("classifier.") for k in sent.tensors)
    reason = refused_by(server, 2, "allow_tensors", exchange={"private": []})
    assert "'classifier." in reason


def test_every_rule_is_read_from_the_message_that_asks_not_an_earlier_one(tmp_path):
    """The server alternates an honest and a hostile config: each hostile round is refused, each honest
    one trains (the ClientApp builds what the policy reads from each message's own config)."""
    server = silo(tmp_path, "max_rounds = 3\nrequire_dp = true\n", client={"dp": DP})
    hostile = [{"federation": {"rounds": 9}}, {"client": {"dp": None}}]
    trains(server, 1)
    refused_by(server, 2, "max_rounds", **hostile[0])
    trains(server, 2)
    refused_by(server, 3, "require_dp", **hostile[1])
    trains(server, 3)
    assert [s["round"] for s in server.sent] == [1, 2, 3]


def test_require_roster_refuses_a_round_without_a_roster(tmp_path):
    server = silo(tmp_path, "require_roster = true\n")
    assert "in the clear" in refused_by(server, 1, "require_roster")
    secure = {"federation": {"secure_aggregation": {}}}
    server.query("secagg_keys", round=1, silos=["alpha", "beta", "gamma"], override=secure,
                 **{"protocol-round": "run-1/1"})  # stage 1 first: the silo commits before it trains
    assert "without a roster" in refused_by(server, 1, "require_roster", **secure)


def test_require_roster_admits_secure_aggregation_with_the_silos_roster(tmp_path):
    """With the operator's roster and signing key in the node config the policy admits the round; it then
    masks with the keys of the protocol's first stage, which this scripted server never ran."""
    from fedsilo import cli
    for name in ("alpha", "beta", "gamma"):
        assert cli.main(["keys", "new", "--out", str(tmp_path / "keys"), "--silo", name]) == 0
    pubs = [f"{n}={tmp_path / 'keys' / (n + '.pub')}" for n in ("alpha", "beta", "gamma")]
    assert cli.main(["keys", "roster", *pubs, "--out", str(tmp_path / "roster.toml")]) == 0
    path = tmp_path / "alpha-policy.toml"
    path.write_text("require_roster = true\n")
    server = ScriptedServer(toy_raw(federation={"secure_aggregation": {}}), "alpha", tmp_path / "state",
                            policy=str(path), roster=str(tmp_path / "roster.toml"),
                            **{"signing-key": str(tmp_path / "keys" / "alpha.key")})
    with pytest.raises(ConfigError, match="holds no keys of round 1"):
        server.train(1)
    assert server.sent == []


@pytest.mark.parametrize("secure,roster,rule", [
    (False, False, "require_roster: the round sends the update in the clear"),
    (True, False, "require_roster: secure aggregation without a roster"),
    (True, True, None),
])
def test_require_roster_needs_secure_aggregation_with_a_roster(secure, roster, rule):
    asked = Asked(1, 1, ("w",), None, None, False, secure, roster, None, False)
    found = breach(SiloPolicy(require_roster=True), asked)
    assert found == rule if rule is None else found.startswith(rule)


@pytest.mark.parametrize("text,culprit", [
    ("max_rounds = true", "max_rounds: Input should be a valid integer"),
    ("max_epsilon = true", "max_epsilon: Input should be a valid number"),
    ("min_noise_multiplier = true", "min_noise_multiplier: Input should be a valid number"),
    ("require_dp = 1", "require_dp: Input should be a valid boolean"),
    ("allow_tensors = [1]", "allow_tensors.0: Input should be a valid string"),
])
def test_a_bool_or_a_number_of_the_wrong_kind_is_refused_when_the_policy_is_read(tmp_path, text, culprit):
    """`max_rounds = true` must not be read as 1 round."""
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=culprit):
        read_policy(path)


def test_a_supernode_with_a_bad_policy_sends_nothing(tmp_path):
    """The ClientApp fails the message (Flower answers the server with an error), no update."""
    server = silo(tmp_path, "max_rounds = true\n")
    with pytest.raises((RuntimeError, ConfigError), match="max_rounds: Input should be a valid integer"):
        server.train(1)
    assert server.sent == []
