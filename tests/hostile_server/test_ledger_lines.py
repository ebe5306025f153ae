"""Every line of a silo's privacy ledger is checked field by field (fedsilo.privacy.ledger_lines): a line
that parses as JSON but is not what the silo writes (`"steps": -40` made ε 0) is refused with its
file:line and field — by `PrivacyLedger.entries()`, by `fedsilo ledger show/reset` (one error line, the
file untouched), and by a silo's next DP round (a refusal, not a traceback)."""
from __future__ import annotations

import copy
import json
import math

import pytest

from fedsilo.cli import main
from fedsilo.engines.flower import client_app
from fedsilo.privacy.ledger import LEDGER_FILE, PrivacyLedger, epsilon_of
from tests.hostile_server.driver import ScriptedServer, toy_raw

GOOD = {"v": 1, "run": "run-1", "round": 1, "scope": "data:test", "silo": "alpha",
        "mechanisms": [{"level": "record", "noise_multiplier": 1.1, "sample_rate": 0.5, "steps": 4, "delta": 1e-3},
                       {"level": "silo", "noise_multiplier": 0.5, "sample_rate": 1.0, "steps": 1, "delta": None}],
        "released": "a" * 64, "received": "b" * 64, "masked": False, "time": "2025-01-01T00:00:00Z"}
GONE = object()


def line(edits: dict | None = None, **top) -> dict:
    """GOOD with `top` keys set and `edits` ("mechanisms.0.steps": value; GONE deletes) applied."""
    entry = {**copy.deepcopy(GOOD), **top}
    for path, value in (edits or {}).items():
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = entry
        for p in parents:
            target = target[p]
        if value is GONE:
            del target[last]
        else:
            target[last] = value
    return entry


def write(path, *entries) -> bytes:
    data = "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries).encode()
    path.write_bytes(data)
    return data


BAD = [  # (the line on line 2, the field the error names, what it says)
    (line({"mechanisms.0.steps": -40}), "mechanisms[0].steps", "must be an integer ≥ 1, got -40"),
    (line({"mechanisms.1.steps": -5}), "mechanisms[1].steps", "got -5"),
    (line({"mechanisms.0.steps": 0}), "mechanisms[0].steps", "got 0"),
    (line({"mechanisms.0.steps": 2.5}), "mechanisms[0].steps", "got 2.5"),
    (line({"mechanisms.0.steps": 3.0}), "mechanisms[0].steps", "got 3.0"),
    (line({"mechanisms.0.steps": "4"}), "mechanisms[0].steps", 'got "4"'),
    (line({"mechanisms.0.noise_multiplier": math.nan}), "mechanisms[0].noise_multiplier", "finite number > 0, got NaN"),
    (line({"mechanisms.0.noise_multiplier": -1}), "mechanisms[0].noise_multiplier", "got -1"),
    (line({"mechanisms.0.noise_multiplier": 10 ** 400}), "mechanisms[0].noise_multiplier", "finite number"),
    (line({"mechanisms.0.sample_rate": 0}), "mechanisms[0].sample_rate", "in (0, 1], got 0"),
    (line({"mechanisms.0.sample_rate": 1.5}), "mechanisms[0].sample_rate", "got 1.5"),
    (line({"mechanisms.0.sample_rate": math.inf}), "mechanisms[0].sample_rate", "got Infinity"),
    (line({"mechanisms.0.delta": 1.0}), "mechanisms[0].delta", "in (0, 1), or null, got 1.0"),
    (line({"mechanisms.0.delta": "x"}), "mechanisms[0].delta", 'got "x"'),
    (line({"mechanisms.0.level": GONE}), "mechanisms[0].level", 'missing (must be "record" or "silo")'),
    (line({"mechanisms.1.level": "user"}), "mechanisms[1].level", 'got "user"'),
    (line({"mechanisms.0.epsilon": 0.1}), "mechanisms[0].epsilon", "unknown key"),
    (line({"mechanisms.0": 7}), "mechanisms[0]", "must be an object, got 7"),
    (line(mechanisms="record"), "mechanisms", 'must be a list of mechanisms, got "record"'),
    (line(scope=3), "scope", "must be a non-empty string, got 3"),
    (line(scope=""), "scope", 'got ""'),
    (line(run=None), "run", "got null"),
    (line({"run": GONE}), "run", "missing"),
    (line(round="x"), "round", 'must be an integer ≥ 1, got "x"'),
    (line(round=0), "round", "got 0"),
    (line(round=True), "round", "got true"),
    (line(v=2), "v", "must be 1, got 2"),
    (line(released="abc"), "released", 'must be a sha256 (64 lowercase hex digits), got "abc"'),
    (line(received="B" * 64), "received", "or null"),
    (line(masked="yes"), "masked", 'must be true or false, got "yes"'),
    (line(epsilon=0.0), "epsilon", "unknown key"),
    ([GOOD], "(top level)", "must be an object"),
]


@pytest.mark.parametrize("bad,field,says", BAD, ids=[f"{b[1]}:{i}" for i, b in enumerate(BAD)])
def test_a_bad_line_is_refused_with_its_file_line_and_field(tmp_path, capsys, bad, field, says):
    path = tmp_path / "ledger.jsonl"
    data = write(path, GOOD, bad)
    with pytest.raises(ValueError) as err:
        PrivacyLedger(path).entries()
    message = str(err.value)
    assert message.startswith(f"privacy ledger {path}:2: {field}: ") and says in message, message
    assert "\n" not in message
    for argv in (["ledger", "show", str(path)], ["ledger", "reset", str(path), "--scope", "data:test"]):
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.err == f"fedsilo: error: {message}\n" and out.out == ""
        assert path.read_bytes() == data
    assert not list(tmp_path.glob("*archived*"))


def test_a_good_ledger_reads_and_shows_epsilon(tmp_path, capsys):
    """Several lines, both levels, δ null on the silo level (and absent, as a silo's noise writes it):
    read back as written, and `show` gives the record level's ε."""
    path = tmp_path / "ledger.jsonl"
    lines = [GOOD, line(round=2, received=None, masked=True),
             line({"mechanisms.1.delta": GONE}, round=3),
             line(run="run-2", scope="operator-named", mechanisms=[])]
    write(path, *lines)
    entries = PrivacyLedger(path).entries()
    assert entries == lines
    assert main(["ledger", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    eps = epsilon_of(entries, "data:test", "record", 1e-3)
    assert eps > 0 and f"record level: 12 step(s), σ 1.1; ε = {eps:.4f} at δ = 0.001" in shown
    assert "silo level: 3 step(s), σ 0.5\n" in shown and "scope operator-named: 1 release(s)" in shown


@pytest.fixture
def fresh_process():
    client_app._SILOS.clear()
    yield
    client_app._SILOS.clear()


def test_a_silo_refuses_its_next_dp_round_on_a_bad_line(tmp_path, fresh_process):
    """A DP silo's round-1 line rewritten with `"steps": -40` (ε would count it as nothing): round 2 is a
    refusal naming the file:line and field — no traceback, no update."""
    s = ScriptedServer(toy_raw(client={"dp": {"target_epsilon": 4.0, "delta": 1e-3}}), "alpha", tmp_path)
    _, refused = s.train(1)
    assert refused is None
    path = tmp_path / LEDGER_FILE
    (entry,) = PrivacyLedger(path).entries()
    entry["mechanisms"][0]["steps"] = -40
    write(path, entry)
    update, refused = s.train(2)
    assert update is None and refused is not None
    assert f"privacy ledger {path}:1: mechanisms[0].steps: must be an integer ≥ 1, got -40" in refused[0]
    assert "Traceback" not in refused[0] and len(s.sent) == 1
