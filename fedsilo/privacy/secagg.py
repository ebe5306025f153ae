"""Secure aggregation: the server learns the sum of the silos' vectors and nothing about each one.

The protocol is SecAgg (Bonawitz et al., CCS 2017) in its variant against an active server (a PKI
and a consistency round), on the complete graph: cross-silo federations are small, so every pair of clients
masks with each other. Five stages, each a separate call whose messages are plain dicts of bytes,
ints and numpy arrays, so that an engine can carry them over any transport:

1. ``advertise_keys``: each client makes two X25519 key pairs and a 32-byte self-mask seed ``b``
   (``os.urandom``), and signs (round id, its name, both public keys, its round ``commitment``: what
   the round trains from, secagg_parts.round_commitment) with its long-term Ed25519 key
   (fedsilo.privacy.roster). The ``c`` pair keys the packets of stage 2; the ``s`` pair agrees
   the pairwise masks. They are separate because the server learns a dropped client's ``s`` private
   key: were it also the packet key, the server could read every share that client sent or received.
2. ``share_keys``: each client checks every advertisement's signature against its roster (so the
   server cannot put its own keys in a peer's place), that no key repeats and that every peer
   committed what it did (else it shares nothing, so masks nothing), splits its ``s``
   private key and ``b`` into Shamir shares (``t`` of ``n`` reconstruct), and sends peer ``v`` its
   shares, AES-GCM encrypted under HKDF(X25519(c_u, c_v)) and authenticated with sender, recipient
   and round; the server only routes.
3. ``masked_input``: ``y_u = enc(x_u) + PRG(b_u) + sum over peers v of ±PRG(s_uv)`` in Z_2^64 over
   the peers whose packets reached u (u's view U2), ``+`` where u precedes v in the client list,
   ``-`` otherwise, so the pairwise masks cancel in the sum; ``s_uv`` = HKDF(X25519(s_u, s_v)).
4. ``consistency``: the server names the survivors U3 (the clients whose masked inputs it holds).
   Each checks U3 ⊆ its own U2, ``|U3| >= t`` and that it is in U3, and signs (round, client list,
   t, U3 and U3's public keys) once.
5. ``unmask``: the server hands each survivor the signatures it collected. A client reveals only if
   at least ``t`` of them are valid roster signatures of members of U3 over the same U3 it signed:
   its shares of every survivor's ``b`` and of the ``s`` key of every client it holds shares from
   that is not in U3. That dropped set is the client's own U2 \\ U3; it never takes one from the
   server. Each client answers stages 4 and 5 once. The server rebuilds those secrets, removes the
   self-masks and the dropped clients' dangling pairwise masks, and decodes the sum. Up to ``n - t``
   clients may drop after stage 2; one that drops earlier is left out.

The round id goes into every HKDF ``info`` and every signature, so that masks and signatures of
different rounds differ even with the same keys. Threat model (n clients in the round's list, threshold t, c colluding clients). The active bound and
its argument are this module's own, written for what the code checks (the paper was not at hand):

* Honest-but-curious server, with or without a roster: the server and up to ``t - 1`` colluding
  clients learn nothing but the sum over the survivors (fewer than ``t`` shares of any secret).
* Active server (it may drop, reorder, withhold or forge any message), every client holding the
  federation's roster and signing key: the server with ``c`` colluding clients learns only the sum
  over one survivor set U3 with ``|U3| >= t``, that is the sum of at least ``t - c`` honest inputs,
  provided ``2t > n + c``. Why: an honest client reveals a ``b`` share only of a member of the U3 it
  signed and an ``s`` share only of a non-member, and it signs one U3. Two different survivor sets
  accepted by honest clients would need ``t`` signatures each; honest clients sign one, colluders
  both, so ``2t - c <= n``. With a single U3 no secret is revealed both ways (``c < t`` shares of the
  other), and each member of U3 masked with every other (U3 ⊆ its U2), so only the sum over U3
  unmasks. Unsigned, an advertisement could be the server's own keys, and the server would read the
  shares sent to them; a signature over another U3 is what the split-view attack needs (issue 40:
  5 clients, t = 3, two packets withheld from the target and a different survivor list for each
  client rebuilt the target's input to 1e-10; tests/hostile_server/test_secagg_active.py).
  With the default ``t = n // 2 + 1``, ``2t > n`` always holds: an active server alone learns only
  the sum; it tolerates ``c = 2t - n - 1`` colluders (0 for odd n, 1 for even n). For ``c``
  colluders set ``t >= (n + c) // 2 + 1`` (then ``n - t`` drops are still tolerated). A client with a
  roster refuses a list of clients or a threshold with ``2t <= n``.
* Active server, no roster: the protocol runs the same stages unsigned, and only the semi-honest
  guarantee holds: by swapping keys or showing clients different survivor sets such a server can
  learn one client's input. The engines say so once at run start and in every round record.
* An eavesdropper on the client-server links sees what the server sees (the share packets are
  encrypted end to end between clients), so it learns at most the sum; with TLS, nothing.

A client masks one input per protocol run (stage 3 runs once); two runs over the same input with
different survivor sets would give two different sums, so a round must never be masked twice: every
silo under secure aggregation keeps a privacy ledger that refuses it (fedsilo.privacy.ledger).

The server's side is fedsilo.privacy.secagg_server; the ring encoding, the PRG, Shamir sharing and the
exact bytes each stage signs are in fedsilo.privacy.secagg_parts; the protocol's cost is measured in
docs/privacy.md (`bench/secagg_cost.py`,
`bench/secagg_active.py`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsilo.privacy.roster import Identity, ephemeral_identities

from .secagg_parts import (_CHUNK, COMMIT_BYTES, HEADROOM, SHARE_BYTES, SecAggSettings, _aad, _advert_message,
                           _agree, _check_keys, _check_round, _positions, _quorum, _survivors_message, _unknown,
                           add_prg, colluders_tolerated, decode, derive_key, encode, shamir_combine, shamir_split)
from .secagg_server import SecAggServer

_NONCE = 12                   # AES-GCM nonce length

__all__ = ["SecAggClient", "SecAggServer", "secure_sum",  # the protocol; and its pieces, used with it:
           "SecAggSettings", "HEADROOM", "SHARE_BYTES", "_CHUNK", "add_prg", "colluders_tolerated", "decode",
           "derive_key", "encode", "shamir_combine", "shamir_split"]


class SecAggClient:
    """One silo's side of one round: call the five stages in order, each once.

    ``identity`` (fedsilo.privacy.roster): the silo's signing key and roster. With it every advertisement
    and survivor set is checked against the roster (secure against an active server, within the module's
    bound); without it the same stages run unsigned and only the semi-honest guarantee holds.
    """

    def __init__(self, name: str, clients: Sequence[str], settings: SecAggSettings, round_id: int | str = 0,
                 identity: Identity | None = None, commitment: bytes = b""):
        self.index = _positions(clients)
        if name not in self.index:
            raise ValueError(f"secure aggregation client {name!r} is not among {list(self.index)}")
        self.name = name
        self.settings = settings
        self.threshold = settings.threshold_for(len(self.index))
        self.round_id = _check_round(round_id)
        self.identity = identity
        if not isinstance(commitment, bytes) or len(commitment) not in (0, COMMIT_BYTES):
            raise ValueError(f"secure aggregation: a round commitment is {COMMIT_BYTES} bytes (round_commitment)")
        self.commitment = commitment  # what this silo's round trains from (round_commitment); b"": none
        if identity is not None:
            self._check_identity(identity)
        self._c_key = X25519PrivateKey.generate()  # keys the stage-2 packets
        self._s_key = X25519PrivateKey.generate()  # agrees the pairwise masks; revealed if this client drops
        self._b = os.urandom(32)                   # self-mask seed; revealed if this client survives
        self._public_keys: dict[str, dict] = {}
        self._shares: dict[str, tuple[bytes, bytes]] = {}  # owner: (share of its s key, share of its b)
        self._survivors: list[str] = []  # the survivor set U3 this client signed (stage 4)
        self._stage = 2  # the stage that runs next; advertise_keys may repeat

    def _check_identity(self, identity: Identity) -> None:
        n, t = len(self.index), self.threshold
        if identity.name != self.name:
            raise ValueError(f"secure aggregation client {self.name!r} was given {identity.name!r}'s signing key")
        unknown = identity.roster.missing(self.index)
        if unknown:
            raise ValueError(f"secure aggregation: {unknown} are not in {self.name!r}'s roster "
                             f"({identity.roster.fingerprint()}); it masks only with silos its roster vouches for")
        if 2 * t <= n:
            raise ValueError(f"secure aggregation: threshold {t} of {n} silos lets a lying server get two survivor "
                             f"sets signed; {self.name!r} with a roster needs 2t > n (t >= {n // 2 + 1})")

    def to_state(self) -> bytes:
        """This client's whole state (its secret keys included, its long-term identity not) as JSON bytes, for
        an engine whose stages may reach the silo in different processes: it keeps them on the silo's own disk
        between stages."""
        return json.dumps({
            "name": self.name, "clients": list(self.index), "threshold": self.settings.threshold,
            "step": self.settings.step, "round_id": self.round_id, "stage": self._stage,
            "commitment": self.commitment.hex(),
            "c_key": self._c_key.private_bytes_raw().hex(), "s_key": self._s_key.private_bytes_raw().hex(),
            "b": self._b.hex(),
            "public_keys": {n: {k: v.hex() for k, v in keys.items()} for n, keys in self._public_keys.items()},
            "shares": {n: [a.hex(), b.hex()] for n, (a, b) in self._shares.items()},
            "survivors": self._survivors,
        }).encode()

    @classmethod
    def from_state(cls, data: bytes, identity: Identity | None = None) -> "SecAggClient":
        state = json.loads(data)
        client = cls(state["name"], state["clients"], SecAggSettings(state["threshold"], state["step"]),
                     state["round_id"], identity, bytes.fromhex(state["commitment"]))
        client._c_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["c_key"]))
        client._s_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["s_key"]))
        client._b = bytes.fromhex(state["b"])
        client._public_keys = {n: {k: bytes.fromhex(v) for k, v in keys.items()}
                               for n, keys in state["public_keys"].items()}
        client._shares = {n: (bytes.fromhex(a), bytes.fromhex(b)) for n, (a, b) in state["shares"].items()}
        client._survivors = list(state["survivors"])
        client._stage = int(state["stage"])
        return client

    @property
    def stage(self) -> int:
        """The stage that runs next (6: the round is over)."""
        return self._stage

    def _at(self, stage: int, what: str) -> None:
        """Each stage runs once and in order (a second masked input would reveal x1 - x2, a second signature
        a second survivor set); a stage that raises has not run."""
        if self._stage != stage:
            raise RuntimeError(f"secure aggregation client {self.name!r}: {what} (stage {stage}) repeated or "
                               f"out of order; the next stage is {self._stage} (6: the round is over)")

    def _keys(self) -> tuple[bytes, bytes]:
        return self._c_key.public_key().public_bytes_raw(), self._s_key.public_key().public_bytes_raw()

    def advertise_keys(self) -> dict:
        """Stage 1: this client's two public keys, signed with its identity when it has one."""
        c_pk, s_pk = self._keys()
        advert = {"c_pk": c_pk, "s_pk": s_pk, "commit": self.commitment}
        if self.identity is not None:
            advert["sig"] = self.identity.sign(_advert_message(self.round_id, self.name, c_pk, s_pk, self.commitment))
        return advert

    def share_keys(self, public_keys: Mapping[str, Mapping]) -> dict[str, bytes]:
        """Stage 2: {peer: encrypted packet of this client's shares of its s key and of b}."""
        self._at(2, "share_keys")
        _unknown(public_keys, self.index, "public keys")
        own = public_keys.get(self.name, {})
        if (own.get("c_pk"), own.get("s_pk")) != self._keys():
            raise ValueError(f"secure aggregation: the public keys sent to {self.name!r} do not hold its own")
        _check_keys(public_keys)
        if self.identity is not None:
            forged = [peer for peer, keys in public_keys.items() if peer != self.name and not self.identity.roster.verify(
                peer, keys.get("sig", b""), _advert_message(self.round_id, peer, keys["c_pk"], keys["s_pk"],
                                                            keys.get("commit", b"")))]
            if forged:
                raise ValueError(f"secure aggregation: the keys advertised for {forged} carry no valid roster "
                                 f"signature of theirs for this round (swapped or forged); {self.name!r} shares "
                                 "nothing")
        other = [peer for peer, keys in public_keys.items() if keys.get("commit", b"") != self.commitment]
        if other:
            raise ValueError(f"secure aggregation: {other} committed to another model or training config for round "
                             f"{self.round_id} than {self.name!r} (the server sent the silos different messages); "
                             f"{self.name!r} shares nothing and masks nothing")
        _quorum(len(public_keys), self.threshold, len(self.index), "advertised keys")
        self._public_keys = {name: {"c_pk": keys["c_pk"], "s_pk": keys["s_pk"]} for name, keys in public_keys.items()}
        n = len(self.index)
        s_shares = shamir_split(self._s_key.private_bytes_raw(), self.threshold, n)
        b_shares = shamir_split(self._b, self.threshold, n)
        mine = self.index[self.name] - 1
        self._shares[self.name] = (s_shares[mine], b_shares[mine])
        self._stage = 3
        return {peer: self._seal(peer, s_shares[self.index[peer] - 1] + b_shares[self.index[peer] - 1])
                for peer in self._public_keys if peer != self.name}

    def _packet_key(self, peer: str) -> AESGCM:
        return AESGCM(_agree(self._c_key, self._public_keys[peer]["c_pk"], "share packet", self.round_id))

    def _seal(self, peer: str, plaintext: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return nonce + self._packet_key(peer).encrypt(nonce, plaintext, _aad(self.name, peer, self.round_id))

    def _open(self, sender: str, packet: bytes) -> tuple[bytes, bytes]:
        try:
            plain = self._packet_key(sender).decrypt(packet[:_NONCE], packet[_NONCE:],
                                                     _aad(sender, self.name, self.round_id))
        except InvalidTag:
            raise ValueError(f"secure aggregation: the packet from {sender!r} to {self.name!r} "
                             "does not authenticate (tampered, misrouted or from another round)") from None
        if len(plain) != 2 * SHARE_BYTES:
            raise ValueError(f"secure aggregation: the packet from {sender!r} holds {len(plain)} bytes, "
                             f"not {2 * SHARE_BYTES}")
        return plain[:SHARE_BYTES], plain[SHARE_BYTES:]

    def masked_input(self, x: np.ndarray, packets: Mapping[str, bytes]) -> np.ndarray:
        """Stage 3: enc(x) + PRG(b) + the pairwise masks with every peer whose packet arrived (uint64).

        The shares in ``packets`` are kept for stage 5; their senders and this client are its view U2.
        """
        self._at(3, "masked_input")
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"secure aggregation input must be a non-empty vector, got shape {x.shape}")
        y = encode(x, self.settings.step, len(self.index))
        senders = [s for s in packets if s != self.name]
        _unknown(senders, self._public_keys, "stage-2 packets")
        received = {sender: self._open(sender, packets[sender]) for sender in senders}
        _quorum(len(received) + 1, self.threshold, len(self.index), "shared keys with this client")
        self._shares.update(received)
        self._stage = 4
        add_prg(y, self._b)
        for peer in senders:
            seed = _agree(self._s_key, self._public_keys[peer]["s_pk"], "mask", self.round_id)
            add_prg(y, seed, subtract=self.index[peer] < self.index[self.name])
        return y

    def _survivors_message(self, survivors: Sequence[str]) -> bytes:
        return _survivors_message(self.round_id, list(self.index), self.threshold, survivors, self._public_keys,
                                  self.commitment)

    def consistency(self, survivors: Collection[str]) -> dict:
        """Stage 4: check the survivor set U3 against this client's own view and sign it, once."""
        self._at(4, "consistency")
        if isinstance(survivors, (str, bytes)) or not all(isinstance(v, str) for v in survivors):
            raise ValueError(f"secure aggregation: the survivor set sent to {self.name!r} is not a list of names")
        _unknown(survivors, self.index, "a survivor set")
        held = set(self._shares)
        outside = sorted(set(survivors) - held)
        if outside:
            raise ValueError(f"secure aggregation: inconsistent view: the survivor set sent to {self.name!r} names "
                             f"{outside}, whose shares it does not hold (its view: {sorted(held, key=self.index.get)})")
        if self.name not in survivors:
            raise ValueError(f"secure aggregation: inconsistent view: the survivor set sent to {self.name!r} leaves "
                             "it out, though it sent its masked input")
        _quorum(len(set(survivors)), self.threshold, len(self.index), "survivors in the set it was sent")
        self._survivors = sorted(set(survivors), key=self.index.__getitem__)
        self._stage = 5
        sig = b"" if self.identity is None else self.identity.sign(self._survivors_message(self._survivors))
        return {"sig": sig}

    def unmask(self, signatures: Mapping[str, bytes]) -> dict:
        """Stage 5: shares of each survivor's b and of the s key of each client of this client's view U2 that
        is not a survivor, never both for one, and (with a roster) only once t survivors signed the same set."""
        self._at(5, "unmask")
        if self.identity is not None:
            self._check_signatures(signatures)
        dropped = [v for v in self._shares if v not in self._survivors]
        self._stage = 6
        return {"self_mask_shares": {v: self._shares[v][1] for v in self._survivors},
                "mask_key_shares": {d: self._shares[d][0] for d in dropped}}

    def _check_signatures(self, signatures: Mapping[str, bytes]) -> None:
        outside = sorted(set(signatures) - set(self._survivors))
        if outside:
            raise ValueError(f"secure aggregation: inconsistent view: signatures from {outside}, who are not in "
                             f"the survivor set {self._survivors} that {self.name!r} signed; it reveals nothing")
        message = self._survivors_message(self._survivors)
        roster = self.identity.roster
        bad = sorted(v for v, sig in signatures.items() if v != self.name and not roster.verify(v, sig, message))
        if bad:
            raise ValueError(f"secure aggregation: inconsistent view: the signatures of {bad} are not over the "
                             f"survivor set {self._survivors} that {self.name!r} signed; it reveals nothing")
        signed = set(signatures) | {self.name}
        if len(signed) < self.threshold:
            raise ValueError(f"secure aggregation: {self.name!r} holds {len(signed)} signatures over its survivor "
                             f"set {self._survivors}, fewer than t = {self.threshold}; it reveals nothing")


def secure_sum(inputs: Mapping[str, np.ndarray], settings: SecAggSettings | None = None,
               drop_after_share: Collection[str] = (), round_id: int | str = 0,
               signed: bool = True) -> tuple[np.ndarray, list[str]]:
    """The whole protocol in memory: the sum over the clients that did not drop, and their names.

    ``drop_after_share`` names clients that vanish after stage 2, to exercise the recovery. ``signed``:
    every client gets a fresh signing key and they share a roster made for this call (one process runs
    every client, so the keys need not outlive it), and the signed stages run as on a federation.
    """
    settings = settings or SecAggSettings()
    names = list(inputs)
    _unknown(drop_after_share, names, "drops")
    lengths = {np.shape(x) for x in inputs.values()}
    if len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise ValueError(f"secure aggregation inputs must be vectors of one length, got shapes {sorted(lengths)}")
    server = SecAggServer(names, settings, next(iter(lengths))[0], round_id)
    identities = ephemeral_identities(names) if signed else {}
    clients = {name: SecAggClient(name, names, settings, round_id, identities.get(name)) for name in names}
    public_keys = server.collect_keys({name: c.advertise_keys() for name, c in clients.items()})
    inboxes = server.route_packets({name: c.share_keys(public_keys) for name, c in clients.items()})
    masked = {name: clients[name].masked_input(inputs[name], inboxes[name])
              for name in names if name not in drop_after_share}
    survivors = server.survivors(masked)
    signatures = server.unmask_request({name: clients[name].consistency(survivors) for name in survivors})
    replies = {name: clients[name].unmask(signatures) for name in signatures}
    return server.aggregate(masked, replies), survivors
