"""Secure aggregation (fedsilo.privacy.secagg): right sums, drop recovery, refusals, what the server sees, and the
checks a silo with a roster makes (signed keys, one signed survivor set). The attacks of a lying server that
these checks stop are in tests/hostile_server/test_secagg_active.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedsilo.privacy import secagg
from fedsilo.privacy.roster import ephemeral_identities
from fedsilo.privacy.secagg import (SecAggClient, SecAggServer, SecAggSettings, add_prg, colluders_tolerated, decode,
                                    derive_key, secure_sum, shamir_combine)

STEP = SecAggSettings().step


def random_inputs(n: int, length: int, seed: int, scale: float = 50.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"silo{i}": rng.normal(scale=scale, size=length) for i in range(n)}


def exact_sum(inputs: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    """The correctly rounded sum per coordinate (math.fsum), the reference for the error bound."""
    return np.array([math.fsum(col) for col in np.stack([inputs[n] for n in names]).T])


def assert_within_bound(got: np.ndarray, inputs: dict[str, np.ndarray], names: list[str], step: float) -> None:
    ref = exact_sum(inputs, names)
    bound = len(names) * step / 2 + np.spacing(np.abs(ref))
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


def run_stages(inputs: dict[str, np.ndarray], settings: SecAggSettings = SecAggSettings(), round_id=0,
               signed: bool = True):
    """Stages 1 and 2 by hand: the server, the clients, what each client sent and each inbox."""
    names = list(inputs)
    server = SecAggServer(names, settings, len(next(iter(inputs.values()))), round_id)
    identities = ephemeral_identities(names) if signed else {}
    clients = {n: SecAggClient(n, names, settings, round_id, identities.get(n)) for n in names}
    keys = server.collect_keys({n: c.advertise_keys() for n, c in clients.items()})
    sent = {n: c.share_keys(keys) for n, c in clients.items()}
    return server, clients, sent, server.route_packets(sent)


def finish(server, clients, masked, answering=None):
    """Stages 4 and 5 as an honest server runs them; `answering`: the survivors that answer stage 5."""
    survivors = server.survivors(masked)
    signatures = server.unmask_request({n: clients[n].consistency(survivors) for n in survivors})
    replies = {n: clients[n].unmask(signatures) for n in (answering or signatures)}
    return server.aggregate(masked, replies)


# 1. the sum is right within m * step / 2

@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("length", [1, 257])
@pytest.mark.parametrize("step", [STEP, 0.25])
@pytest.mark.parametrize("signed", [True, False])
def test_sum_matches_plaintext_within_bound(n, length, step, signed):
    for seed in range(3):
        inputs = random_inputs(n, length, seed)
        got, survivors = secure_sum(inputs, SecAggSettings(step=step), signed=signed)
        assert survivors == list(inputs)
        assert got.dtype == np.float64 and got.shape == (length,)
        assert_within_bound(got, inputs, survivors, step)


def test_multiples_of_step_sum_exactly_across_chunks():
    rng = np.random.default_rng(7)
    length = 2 * secagg._CHUNK + 3
    inputs = {f"s{i}": rng.integers(-2**40, 2**40, size=length) * STEP for i in range(3)}
    got, _ = secure_sum(inputs)
    assert np.array_equal(got, sum(inputs.values()))


# 2. clients dropping after key sharing

@pytest.mark.parametrize("n, drops", [(3, ["silo1"]), (3, ["silo0"]), (3, ["silo2"]), (5, ["silo4"]),
                                      (5, ["silo0", "silo3"]), (5, ["silo1", "silo2"])])
def test_drops_after_sharing_sum_the_survivors(n, drops):
    inputs = random_inputs(n, 100, seed=n)
    got, survivors = secure_sum(inputs, drop_after_share=drops)
    assert survivors == [name for name in inputs if name not in drops]
    assert_within_bound(got, inputs, survivors, STEP)


def test_survivor_silent_in_unmasking_is_still_summed():
    inputs = random_inputs(5, 50, seed=3)
    server, clients, _, inboxes = run_stages(inputs)
    masked = {n: clients[n].masked_input(inputs[n], inboxes[n]) for n in inputs if n != "silo2"}
    got = finish(server, clients, masked, answering=["silo0", "silo3", "silo4"])  # silo1 goes quiet
    assert server.survivors(masked) == ["silo0", "silo1", "silo3", "silo4"] and server.dropped == ["silo2"]
    assert_within_bound(got, inputs, ["silo0", "silo1", "silo3", "silo4"], STEP)


def test_client_dropping_before_sharing_is_left_out():
    inputs = random_inputs(4, 20, seed=4)
    names = list(inputs)
    server = SecAggServer(names, SecAggSettings(), 20)
    clients = {n: SecAggClient(n, names, SecAggSettings()) for n in names}
    keys = server.collect_keys({n: clients[n].advertise_keys() for n in names[:3]})  # silo3 never shows
    inboxes = server.route_packets({n: clients[n].share_keys(keys) for n in names[:3]})
    assert set(inboxes) == set(names[:3])
    masked = {n: clients[n].masked_input(inputs[n], inboxes[n]) for n in names[:3]}
    assert_within_bound(finish(server, clients, masked), inputs, names[:3], STEP)


# 3. too many drops, thresholds

@pytest.mark.parametrize("n, drops, message", [
    (3, ["silo0", "silo1"], "needs at least 2 of 3 clients; only 1 sent masked inputs"),
    (5, ["silo0", "silo1", "silo4"], "needs at least 3 of 5 clients; only 2 sent masked inputs"),
])
def test_too_many_drops_is_a_clear_error(n, drops, message):
    with pytest.raises(ValueError, match=message):
        secure_sum(random_inputs(n, 10, seed=0), drop_after_share=drops)


def test_too_few_clients_at_key_advertising():
    names = ["a", "b", "c", "d", "e"]
    server = SecAggServer(names, SecAggSettings(), 4)
    adverts = {n: SecAggClient(n, names, SecAggSettings()).advertise_keys() for n in names[:2]}
    with pytest.raises(ValueError, match="needs at least 3 of 5 clients; only 2 advertised keys"):
        server.collect_keys(adverts)


def test_too_few_unmask_replies():
    inputs = random_inputs(3, 10, seed=1)
    server, clients, _, inboxes = run_stages(inputs)
    masked = {n: clients[n].masked_input(inputs[n], inboxes[n]) for n in inputs}
    survivors = server.survivors(masked)
    signed = {n: clients[n].consistency(survivors) for n in survivors}
    with pytest.raises(ValueError, match="only 1 signed the survivor set"):
        server.unmask_request({"silo0": signed["silo0"]})
    signatures = server.unmask_request(signed)
    with pytest.raises(ValueError, match="only 1 answered the unmask request"):
        server.aggregate(masked, {"silo0": clients["silo0"].unmask(signatures)})


def test_threshold_default_is_the_smallest_majority_and_is_validated():
    assert [SecAggSettings().threshold_for(n) for n in (2, 3, 4, 5, 10)] == [2, 2, 3, 3, 6]
    assert SecAggSettings(threshold=5).threshold_for(5) == 5
    for t, n in [(1, 3), (4, 3), (0, 5)]:
        with pytest.raises(ValueError, match=f"threshold must be between 2 and the number of clients \\({n}\\); got {t}"):
            SecAggSettings(threshold=t).threshold_for(n)
    with pytest.raises(ValueError, match="at least 2 clients"):
        SecAggSettings().threshold_for(1)
    for bad in ("2", 2.0, True):
        with pytest.raises(ValueError, match="threshold must be an integer"):
            SecAggSettings(threshold=bad)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="step must be a positive finite number"):
            SecAggSettings(step=bad)


def test_explicit_threshold_sets_the_tolerated_drops():
    inputs = random_inputs(5, 10, seed=2)
    got, survivors = secure_sum(inputs, SecAggSettings(threshold=2), drop_after_share=["silo0", "silo1", "silo2"],
                                signed=False)
    assert_within_bound(got, inputs, survivors, STEP)
    got, survivors = secure_sum(inputs, SecAggSettings(threshold=4), drop_after_share=["silo0"])
    assert_within_bound(got, inputs, survivors, STEP)
    with pytest.raises(ValueError, match="needs at least 5 of 5 clients; only 4"):
        secure_sum(inputs, SecAggSettings(threshold=5), drop_after_share=["silo0"])


# 4. what the server sees

def test_masked_inputs_look_uniform_and_uncorrelated_with_the_input():
    inputs = random_inputs(3, 4000, seed=5, scale=1.0)
    inputs["silo0"] = np.linspace(-1.0, 1.0, 4000)  # a structured input a leak would show
    server, clients, _, inboxes = run_stages(inputs)
    for name, client in clients.items():
        y = client.masked_input(inputs[name], inboxes[name])
        assert y.dtype == np.uint64
        as_plain = decode(y, STEP)
        assert abs(np.corrcoef(as_plain, inputs[name])[0, 1]) < 0.15
        assert np.median(np.abs(as_plain)) > 1e6 * np.max(np.abs(inputs[name]))
        top = y >> np.uint64(60)  # the top 4 bits: 16 buckets, 250 expected in each
        assert np.all(np.abs(np.bincount(top.astype(np.int64), minlength=16) - 250) < 100)


def test_server_sees_stage2_packets_only_as_ciphertext(monkeypatch):
    made: list[bytes] = []
    split = secagg.shamir_split

    def recording_split(secret, threshold, n):
        shares = split(secret, threshold, n)
        made.extend(shares)
        return shares

    monkeypatch.setattr(secagg, "shamir_split", recording_split)
    inputs = random_inputs(3, 8, seed=6)
    _, _, sent, inboxes = run_stages(inputs)
    assert len(made) == 3 * 2 * 3  # 3 clients x (s key, b) x 3 shares
    seen = [p for packets in sent.values() for p in packets.values()]
    seen += [p for inbox in inboxes.values() for p in inbox.values()]
    assert len(seen) == 12
    for share in made:
        for half in (share[:16], share[16:]):
            assert not any(half in packet for packet in seen)


def test_packets_are_authenticated_to_sender_and_recipient():
    inputs = random_inputs(3, 8, seed=7)
    _, clients, sent, inboxes = run_stages(inputs)
    tampered = dict(inboxes["silo1"])
    tampered["silo0"] = tampered["silo0"][:-1] + bytes([tampered["silo0"][-1] ^ 1])
    with pytest.raises(ValueError, match="packet from 'silo0' to 'silo1' does not authenticate"):
        clients["silo1"].masked_input(inputs["silo1"], tampered)
    misrouted = {"silo0": sent["silo0"]["silo1"], "silo1": inboxes["silo2"]["silo1"]}  # meant for silo1
    with pytest.raises(ValueError, match="packet from 'silo0' to 'silo2' does not authenticate"):
        clients["silo2"].masked_input(inputs["silo2"], misrouted)
    # a refused stage has not run: the genuine packets still work
    clients["silo2"].masked_input(inputs["silo2"], inboxes["silo2"])


# 5. masks differ between rounds

def test_masks_differ_between_rounds_with_the_same_clients():
    inputs = random_inputs(3, 64, seed=8)
    masked = []
    for round_id in (0, 1):
        server, clients, _, inboxes = run_stages(inputs, round_id=round_id)
        masked.append({n: clients[n].masked_input(inputs[n], inboxes[n]) for n in inputs})
        assert_within_bound(finish(server, clients, masked[-1]), inputs, list(inputs), STEP)
    for name in inputs:
        assert np.mean(masked[0][name] == masked[1][name]) < 0.01


def test_round_id_enters_the_key_derivation():
    secret = bytes(range(32))
    keys = {r: derive_key(secret, "mask", r) for r in (0, 1, "0", "round-7")}
    assert len(set(keys.values())) == 4
    assert derive_key(secret, "mask", 1) == keys[1]
    assert derive_key(secret, "share packet", 1) != keys[1]
    streams = []
    for r in (0, 1):
        stream = np.zeros(256, dtype=np.uint64)
        add_prg(stream, keys[r])
        streams.append(stream)
    assert np.mean(streams[0] == streams[1]) < 0.01


def test_keystream_does_not_depend_on_chunking():
    long, short = np.zeros(2 * secagg._CHUNK + 3, dtype=np.uint64), np.zeros(10, dtype=np.uint64)
    add_prg(long, b"k" * 32)
    add_prg(short, b"k" * 32)
    assert np.array_equal(long[:10], short) and np.all(long[-3:] != 0)
    add_prg(long, b"k" * 32, subtract=True)
    assert not long.any()


# 6. inputs too large for the ring

def test_input_too_large_for_the_ring_is_refused():
    limit = 2.0 ** 62 * STEP / 3
    inputs = random_inputs(3, 5, seed=9)
    inputs["silo1"][2] = -1.5 * limit
    with pytest.raises(ValueError, match=r"coordinate 2 is 5\.36871e\+08 in magnitude; .* below 3\.57914e\+08"):
        secure_sum(inputs)
    for bad in (limit, math.nan, math.inf):
        inputs["silo1"][2] = bad
        with pytest.raises(ValueError, match="coordinate 2 "):
            secure_sum(inputs)
    far = np.zeros(secagg._CHUNK + 9)
    far[secagg._CHUNK + 5] = limit
    with pytest.raises(ValueError, match=f"coordinate {secagg._CHUNK + 5} "):
        secure_sum({"a": far, "b": far, "c": far})


def test_inputs_just_inside_the_range_do_not_wrap():
    limit = 2.0 ** 62 * STEP / 3
    inputs = {f"s{i}": np.array([0.999 * limit, -0.999 * limit, 1.0]) for i in range(3)}
    got, names = secure_sum(inputs)
    assert_within_bound(got, inputs, names, STEP)


# 7. a client reveals one secret of each peer, by its own view, once

def test_client_derives_the_dropped_set_from_its_own_view_and_answers_each_stage_once():
    inputs = random_inputs(3, 8, seed=10)
    server, clients, _, inboxes = run_stages(inputs)
    for n in inputs:
        clients[n].masked_input(inputs[n], inboxes[n])
    survivors = ["silo0", "silo1"]  # silo2's masked input is left out: silo2 counts as dropped
    signed = {n: clients[n].consistency(survivors) for n in survivors}
    with pytest.raises(RuntimeError, match="consistency .* repeated or out of order"):
        clients["silo0"].consistency(["silo0", "silo1", "silo2"])  # a second survivor set is never signed
    reply = clients["silo0"].unmask({n: s["sig"] for n, s in signed.items()})
    assert set(reply["self_mask_shares"]) == {"silo0", "silo1"} and set(reply["mask_key_shares"]) == {"silo2"}
    with pytest.raises(RuntimeError, match="unmask .* repeated or out of order"):
        clients["silo0"].unmask({n: s["sig"] for n, s in signed.items()})


def test_client_masks_one_input_per_round():
    inputs = random_inputs(3, 8, seed=11)
    _, clients, _, inboxes = run_stages(inputs)
    clients["silo0"].masked_input(inputs["silo0"], inboxes["silo0"])
    with pytest.raises(RuntimeError, match="masked_input .* repeated or out of order"):
        clients["silo0"].masked_input(inputs["silo0"] + 1, inboxes["silo0"])


# 8. the checks of a client with a roster

def test_survivor_set_outside_the_clients_view_is_refused_by_name():
    inputs = random_inputs(5, 8, seed=12)
    _, clients, _, inboxes = run_stages(inputs)
    inbox = {s: p for s, p in inboxes["silo0"].items() if s in ("silo1", "silo2")}  # silo3, silo4 withheld
    clients["silo0"].masked_input(inputs["silo0"], inbox)
    with pytest.raises(ValueError, match=r"inconsistent view: .* names \['silo3'\], whose shares it does not hold "
                                         r"\(its view: \['silo0', 'silo1', 'silo2'\]\)"):
        clients["silo0"].consistency(["silo0", "silo1", "silo3"])
    with pytest.raises(ValueError, match="leaves it out"):
        clients["silo0"].consistency(["silo1", "silo2"])
    with pytest.raises(ValueError, match="needs at least 3 of 5 clients; only 2 survivors"):
        clients["silo0"].consistency(["silo0", "silo1"])
    assert clients["silo0"].consistency(["silo0", "silo1", "silo2"])["sig"]  # refusals did not use up the stage


def test_unmask_needs_t_roster_signatures_over_the_same_survivor_set():
    inputs = random_inputs(5, 8, seed=13)
    _, clients, _, inboxes = run_stages(inputs)
    for n in inputs:
        clients[n].masked_input(inputs[n], inboxes[n])
    a, b = ["silo0", "silo1", "silo2"], ["silo0", "silo3", "silo4"]  # silo0 is shown both sets, others one each
    sig_a = {n: clients[n].consistency(a)["sig"] for n in a}
    sig_b = {n: clients[n].consistency(b)["sig"] for n in b if n != "silo0"}
    target = clients["silo0"]
    with pytest.raises(ValueError, match=r"signatures from \['silo3', 'silo4'\], who are not in the survivor set"):
        target.unmask({**sig_a, **sig_b})
    with pytest.raises(ValueError, match=r"the signatures of \['silo1'\] are not over the survivor set"):
        target.unmask({**sig_a, "silo1": sig_b["silo3"]})
    with pytest.raises(ValueError, match=r"the signatures of \['silo2'\] are not over"):
        target.unmask({**sig_a, "silo2": bytes(64)})
    with pytest.raises(ValueError, match="holds 2 signatures over its survivor set .* fewer than t = 3"):
        target.unmask({"silo0": sig_a["silo0"], "silo1": sig_a["silo1"]})
    assert set(target.unmask(sig_a)["self_mask_shares"]) == set(a)  # refusals did not use up the stage
    for n in b[1:]:  # silo3 and silo4 signed b; silo0 never did: two of t = 3
        with pytest.raises(ValueError, match="fewer than t = 3"):
            clients[n].unmask(sig_b)


def test_swapped_or_unsigned_keys_are_refused_by_a_client_with_a_roster():
    names = ["a", "b", "c"]
    ids = ephemeral_identities(names)
    clients = {n: SecAggClient(n, names, SecAggSettings(), "r", ids[n]) for n in names}
    keys = {n: c.advertise_keys() for n, c in clients.items()}
    impostor = SecAggClient("b", names, SecAggSettings(), "r").advertise_keys()  # the server's keys for b
    with pytest.raises(ValueError, match=r"the keys advertised for \['b'\] carry no valid roster signature"):
        clients["a"].share_keys({**keys, "b": {**impostor, "sig": keys["b"]["sig"]}})
    with pytest.raises(ValueError, match=r"\['b'\] carry no valid roster signature"):
        clients["a"].share_keys({**keys, "b": impostor})
    other_round = SecAggClient("b", names, SecAggSettings(), "r-old", ids["b"]).advertise_keys()
    with pytest.raises(ValueError, match=r"\['b'\] carry no valid roster signature"):
        clients["a"].share_keys({**keys, "b": other_round})  # b's signature, but for another round
    with pytest.raises(ValueError, match="the keys advertised for 'a' and 'c' repeat one another"):
        clients["b"].share_keys({**keys, "c": {**keys["a"]}})
    assert set(clients["a"].share_keys(keys)) == {"b", "c"}


def test_a_client_with_a_roster_refuses_unknown_silos_and_a_minority_threshold():
    ids = ephemeral_identities(["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"\['e'\] are not in 'a''s roster \(sha256:[0-9a-f]{64}\)"):
        SecAggClient("a", ["a", "b", "e"], SecAggSettings(), 0, ids["a"])
    with pytest.raises(ValueError, match="threshold 2 of 4 silos lets a lying server get two survivor sets signed"):
        SecAggClient("a", ["a", "b", "c", "d"], SecAggSettings(threshold=2), 0, ids["a"])
    with pytest.raises(ValueError, match="was given 'b''s signing key"):
        SecAggClient("a", ["a", "b", "c"], SecAggSettings(), 0, ids["b"])
    SecAggClient("a", ["a", "b", "c", "d"], SecAggSettings(threshold=2), 0)  # without a roster: semi-honest, allowed


def test_state_survives_a_round_trip_with_the_identity_given_again():
    inputs = random_inputs(3, 8, seed=14)
    names = list(inputs)
    ids = ephemeral_identities(names)
    server = SecAggServer(names, SecAggSettings(), 8)
    clients = {n: SecAggClient(n, names, SecAggSettings(), 0, ids[n]) for n in names}
    keys = server.collect_keys({n: c.advertise_keys() for n, c in clients.items()})
    assert server.signed
    clients = {n: SecAggClient.from_state(c.to_state(), ids[n]) for n, c in clients.items()}
    inboxes = server.route_packets({n: c.share_keys(keys) for n, c in clients.items()})
    clients = {n: SecAggClient.from_state(c.to_state(), ids[n]) for n, c in clients.items()}
    masked = {n: clients[n].masked_input(inputs[n], inboxes[n]) for n in names}
    survivors = server.survivors(masked)
    signed = {n: SecAggClient.from_state(clients[n].to_state(), ids[n]) for n in names}
    sigs = server.unmask_request({n: signed[n].consistency(survivors) for n in names})
    again = {n: SecAggClient.from_state(signed[n].to_state(), ids[n]) for n in names}
    assert_within_bound(server.aggregate(masked, {n: again[n].unmask(sigs) for n in names}), inputs, names, STEP)


def test_colluders_tolerated_states_the_bound():
    # semi-honest: t - 1; active with a roster: the largest c with 2t > n + c
    assert [colluders_tolerated(n, n // 2 + 1, roster=True) for n in (2, 3, 4, 5, 6, 7)] == [1, 0, 1, 0, 1, 0]
    assert colluders_tolerated(5, 4, roster=True) == 2 and colluders_tolerated(5, 3, roster=False) == 2
    for n in range(2, 9):
        for t in range(2, n + 1):
            c = colluders_tolerated(n, t, roster=True)
            assert 2 * t > n + c and not 2 * t > n + c + 1


def test_t_minus_one_colluding_silos_hold_too_few_shares_to_rebuild_a_peers_secret():
    """The semi-honest bound: t − 1 silos pooling what a peer shared with them (with the server, which
    routed only ciphertext) rebuild neither of its two secrets; t shares do."""
    inputs = random_inputs(5, 8, seed=11)
    _, clients, _, inboxes = run_stages(inputs)  # t = 3 of 5
    for n in inputs:
        clients[n].masked_input(inputs[n], inboxes[n])
    target, index = clients["silo0"], {n: i + 1 for i, n in enumerate(inputs)}
    b, s_key = target._b, target._s_key.private_bytes_raw()
    for pool, rebuilt in ((["silo1", "silo2"], False), (["silo1", "silo2", "silo3"], True)):
        b_shares = {index[n]: clients[n]._shares["silo0"][1] for n in pool}
        s_shares = {index[n]: clients[n]._shares["silo0"][0] for n in pool}
        assert (shamir_combine(b_shares) == b) is rebuilt and (shamir_combine(s_shares) == s_key) is rebuilt
