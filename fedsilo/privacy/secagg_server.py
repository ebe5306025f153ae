"""Secure aggregation, the server's side (fedsilo.privacy.secagg has the protocol, its threat model and the
silo's side): it routes the silos' messages, names the survivors and unmasks the sum. It holds no secret
of a silo's and checks no signature: the silos do (they hold the roster)."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsilo.privacy.roster import SIGNATURE_BYTES

from .secagg_parts import (SHARE_BYTES, SecAggSettings, _agree, _check_keys, _check_round, _positions, _quorum,
                           _unknown, add_prg, decode, shamir_combine)


class SecAggServer:
    """The server's side of one round: routes messages, names the survivors, unmasks the sum."""

    def __init__(self, clients: Sequence[str], settings: SecAggSettings, length: int, round_id: int | str = 0):
        self.index = _positions(clients)
        self.settings = settings
        self.threshold = settings.threshold_for(len(self.index))
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"secure aggregation vector length must be a positive int, got {length!r}")
        self.length = length
        self.round_id = _check_round(round_id)
        self._public_keys: dict[str, dict] = {}
        self._sharers: list[str] = []    # the clients whose stage-2 packets were routed
        self._survivors: list[str] = []  # U3: the clients whose masked inputs arrived

    def _quorum(self, k: int, what: str) -> None:
        _quorum(k, self.threshold, len(self.index), what)

    def _ordered(self, names: Collection[str]) -> list[str]:
        return sorted(names, key=self.index.__getitem__)

    @property
    def signed(self) -> bool:
        """Whether every advertisement carried a signature (the server holds no roster to check them:
        the silos do)."""
        return bool(self._public_keys) and all(keys.get("sig") for keys in self._public_keys.values())

    def collect_keys(self, adverts: Mapping[str, Mapping]) -> dict[str, dict]:
        """Stage 1 replies in; the public keys (and signatures) to send every client out."""
        _unknown(adverts, self.index, "public keys")
        _check_keys(adverts)
        self._quorum(len(adverts), "advertised keys")
        self._public_keys = {name: dict(adverts[name]) for name in self._ordered(adverts)}
        return {name: dict(keys) for name, keys in self._public_keys.items()}

    def route_packets(self, sent: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, bytes]]:
        """Stage 2 replies ({sender: {recipient: packet}}) in; each sharer's inbox out."""
        if not self._public_keys:
            raise RuntimeError("secure aggregation: route_packets before collect_keys")
        _unknown(sent, self._public_keys, "stage-2 packets")
        self._quorum(len(sent), "shared keys")
        sharers = self._ordered(sent)
        for sender in sharers:
            missing = [r for r in sharers if r != sender and r not in sent[sender]]
            if missing:
                raise ValueError(f"secure aggregation: {sender!r} sent no packet to {missing}")
        self._sharers = sharers
        return {r: {s: sent[s][r] for s in sharers if s != r} for r in sharers}

    def survivors(self, masked: Mapping[str, np.ndarray]) -> list[str]:
        """Stage 3 replies in; the survivor set U3 to send every survivor out (stage 4 asks them to sign it)."""
        if not self._sharers:
            raise RuntimeError("secure aggregation: survivors before route_packets")
        _unknown(masked, self._sharers, "masked inputs")
        for name, y in masked.items():
            if not (isinstance(y, np.ndarray) and y.dtype == np.uint64 and y.shape == (self.length,)):
                raise ValueError(f"secure aggregation: the masked input of {name!r} is not a uint64 vector "
                                 f"of length {self.length}")
        self._quorum(len(masked), "sent masked inputs")
        self._survivors = self._ordered(masked)
        return list(self._survivors)

    @property
    def dropped(self) -> list[str]:
        return [name for name in self._sharers if name not in self._survivors]

    def unmask_request(self, signed: Mapping[str, Mapping]) -> dict[str, bytes]:
        """Stage 4 replies ({survivor: {"sig": ...}}) in; the signatures to send every signer out."""
        if not self._survivors:
            raise RuntimeError("secure aggregation: unmask_request before survivors")
        _unknown(signed, self._survivors, "survivor-set signatures")
        signatures = {}
        for name in self._ordered(signed):
            sig = signed[name].get("sig") if isinstance(signed[name], Mapping) else None
            if not isinstance(sig, bytes) or len(sig) not in (0, SIGNATURE_BYTES):
                raise ValueError(f"secure aggregation: {name!r} sent a malformed survivor-set signature")
            signatures[name] = sig
        self._quorum(len(signatures), "signed the survivor set")
        return signatures

    def aggregate(self, masked: Mapping[str, np.ndarray], unmask_replies: Mapping[str, Mapping]) -> np.ndarray:
        """The float64 sum of the survivors' inputs, from their masked inputs and stage-5 replies."""
        if not self._survivors or set(masked) != set(self._survivors):
            raise RuntimeError("secure aggregation: aggregate needs the masked inputs of the survivor set it named")
        _unknown(unmask_replies, self._survivors, "unmask replies")
        self._quorum(len(unmask_replies), "answered the unmask request")
        total = np.zeros(self.length, dtype=np.uint64)
        for y in masked.values():
            total += y
        for v in self._survivors:
            add_prg(total, self._rebuild(unmask_replies, "self_mask_shares", v), subtract=True)
        for d in self.dropped:
            s_key = self._mask_key(unmask_replies, d)
            for v in self._survivors:  # undo the mask v added for d: + where v precedes d
                seed = _agree(s_key, self._public_keys[v]["s_pk"], "mask", self.round_id)
                add_prg(total, seed, subtract=self.index[v] < self.index[d])
        return decode(total, self.settings.step)

    def _rebuild(self, replies: Mapping[str, Mapping], kind: str, owner: str) -> bytes:
        try:
            shares = {self.index[r]: reply[kind][owner] for r, reply in replies.items()}
        except (KeyError, TypeError):
            raise ValueError(f"secure aggregation: an unmask reply lacks its {kind} of {owner!r}") from None
        if not all(isinstance(s, bytes) and len(s) == SHARE_BYTES for s in shares.values()):
            raise ValueError(f"secure aggregation: malformed {kind} of {owner!r}")
        return shamir_combine(shares)

    def _mask_key(self, replies: Mapping[str, Mapping], dropped: str) -> X25519PrivateKey:
        """A dropped client's s key, checked against the public key it advertised."""
        key = X25519PrivateKey.from_private_bytes(self._rebuild(replies, "mask_key_shares", dropped))
        if key.public_key().public_bytes_raw() != self._public_keys[dropped]["s_pk"]:
            raise ValueError(f"secure aggregation: the shares of {dropped!r}'s mask key do not rebuild it")
        return key
