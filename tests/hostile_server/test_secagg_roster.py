"""The federation roster and the silos' signing keys (fedsilo.privacy.roster, `fedsilo keys`), and how a silo's
ClientApp takes them from its node config only: a roster that is not the run's, a key readable by others, half an
identity, each refused with one line before anything leaves the silo."""
from __future__ import annotations

import os
import stat

import pytest

from fedsilo import cli
from fedsilo.config import ConfigError
from fedsilo.core.transforms import SiloRefused
from fedsilo.privacy import roster as rosters
from tests.hostile_server.driver import ScriptedServer, toy_raw

NAMES = ["alpha", "beta", "gamma"]


def make_keys(folder, names=NAMES):
    """`fedsilo keys new` per silo and `fedsilo keys roster`, as operators run them; the fingerprint printed."""
    for name in names:
        assert cli.main(["keys", "new", "--out", str(folder / "keys"), "--silo", name]) == 0
    entries = [f"{n}={folder / 'keys' / (n + '.pub')}" for n in names]
    assert cli.main(["keys", "roster", *entries, "--out", str(folder / "roster.toml")]) == 0
    return rosters.read_roster(folder / "roster.toml").fingerprint()


def node(folder, name):
    return {"roster": str(folder / "roster.toml"), "signing-key": str(folder / "keys" / f"{name}.key")}


def test_keys_and_roster_files(tmp_path, capsys):
    fingerprint = make_keys(tmp_path)
    out = capsys.readouterr().out
    assert f"fingerprint: {fingerprint}" in out and out.count("ed25519:") == 3
    key = tmp_path / "keys" / "alpha.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    roster = rosters.read_roster(tmp_path / "roster.toml")
    identity = rosters.load_identity("alpha", key, tmp_path / "roster.toml", fingerprint)
    assert roster.verify("alpha", identity.sign(b"m"), b"m") and not roster.verify("beta", identity.sign(b"m"), b"m")
    # the fingerprint is of the keys, not of the file's layout; one key changed changes it
    shuffled = rosters.Roster(dict(reversed(list(roster.keys.items()))))
    assert shuffled.fingerprint() == fingerprint
    changed = rosters.Roster({**roster.keys, "beta": bytes(32)})
    assert changed.fingerprint() != fingerprint


def test_key_and_roster_refusals(tmp_path, capsys):
    make_keys(tmp_path)
    capsys.readouterr()
    assert cli.main(["keys", "new", "--out", str(tmp_path / "keys"), "--silo", "alpha"]) == 2
    assert "alpha.key exists; a silo's key is made once" in capsys.readouterr().err
    assert cli.main(["keys", "roster", "alpha", "--out", str(tmp_path / "r.toml")]) == 2
    assert capsys.readouterr().err == "fedsilo: error: 'alpha' is not NAME=PUBFILE (e.g. alpha=keys/alpha.pub)\n"
    assert cli.main(["keys", "roster", f"alpha={tmp_path / 'keys' / 'alpha.key'}", "--out", str(tmp_path / "r.toml")]) == 2
    assert "is not an Ed25519 public key in PEM" in capsys.readouterr().err
    key = tmp_path / "keys" / "alpha.key"
    os.chmod(key, 0o640)
    with pytest.raises(ConfigError, match=r"signing key .*alpha.key may be read by others \(mode 0640\); chmod 600"):
        rosters.load_private_key(key)
    os.chmod(key, 0o600)
    with pytest.raises(ConfigError, match="silo 'beta''s signing key is not the one its roster lists for it"):
        rosters.load_identity("beta", key, tmp_path / "roster.toml")
    with pytest.raises(ConfigError, match=r"roster .* has fingerprint sha256:\w+, not the expected sha256:0+: it is "
                                          "not the federation's roster"):
        rosters.load_identity("alpha", key, tmp_path / "roster.toml", "sha256:" + "0" * 64)
    bad = tmp_path / "bad.toml"
    for text, culprit in [("[silos]\nalpha = \"12\"\n", "silo 'alpha''s key is not 64 hex digits"),
                          ("alpha = 1\n", "must hold exactly one table"), ("[silos\n", "is not TOML")]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=culprit):
            rosters.read_roster(bad)


def test_half_an_identity_in_the_node_config_is_refused_at_the_first_message(tmp_path):
    make_keys(tmp_path)
    raw = toy_raw(federation={"secure_aggregation": {}})
    s = ScriptedServer(raw, "alpha", tmp_path / "alpha", roster=str(tmp_path / "roster.toml"))
    with pytest.raises(ConfigError, match="node config sets only one of roster and signing-key"):
        s.query("describe")


def test_a_roster_other_than_the_runs_is_refused_before_any_key_leaves(tmp_path):
    fingerprint = make_keys(tmp_path)
    other = "sha256:" + "1" * 64
    raw = toy_raw(federation={"secure_aggregation": {"roster_fingerprint": other}})
    s = ScriptedServer(raw, "alpha", tmp_path / "alpha", **node(tmp_path, "alpha"))
    with pytest.raises(SiloRefused, match=f"the run expects roster {other}; alpha holds {fingerprint}"):
        s.query("secagg_keys", round=1, silos=NAMES, **{"protocol-round": "r/1"})
    bare = ScriptedServer(raw, "alpha", tmp_path / "bare")
    with pytest.raises(SiloRefused, match=f"the run expects roster {other}; alpha holds no roster"):
        bare.query("secagg_keys", round=1, silos=NAMES, **{"protocol-round": "r/1"})
    raw = toy_raw(federation={"secure_aggregation": {"roster_fingerprint": fingerprint}})
    reply = ScriptedServer(raw, "alpha", tmp_path / "same", **node(tmp_path, "alpha")).query(
        "secagg_keys", round=1, silos=NAMES, **{"protocol-round": "r/1"})
    assert len(bytes(reply.content["secagg"]["sig"])) == 64


def test_a_silo_with_a_roster_refuses_a_silo_list_or_threshold_the_roster_cannot_defend(tmp_path):
    make_keys(tmp_path)
    s = ScriptedServer(toy_raw(federation={"secure_aggregation": {}}), "alpha", tmp_path / "alpha",
                       **node(tmp_path, "alpha"))
    with pytest.raises(SiloRefused, match=r"\['mallory'\] are not in 'alpha''s roster"):
        s.query("secagg_keys", round=1, silos=["alpha", "beta", "mallory"], **{"protocol-round": "r/1"})
    low = ScriptedServer(toy_raw(federation={"secure_aggregation": {"threshold": 2}}), "alpha", tmp_path / "low",
                         **node(tmp_path, "alpha"))
    with pytest.raises(SiloRefused, match="threshold 2 of 4 silos lets a lying server get two survivor sets signed"):
        make_keys_and_ask(low, tmp_path)


def make_keys_and_ask(server, tmp_path):
    """A 4-silo list with the roster extended (a fourth silo's key): threshold 2 of 4 is below a majority."""
    key = rosters.generate_key()
    roster = rosters.read_roster(tmp_path / "roster.toml")
    bigger = rosters.Roster({**roster.keys, "delta": rosters.raw_public_key(key.public_key())})
    rosters.write_roster(bigger, tmp_path / "roster.toml")
    return server.query("secagg_keys", round=1, silos=NAMES + ["delta"], **{"protocol-round": "r/1"})
