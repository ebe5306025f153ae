"""The pieces of secure aggregation's protocol (fedsilo.privacy.secagg): its settings, the fixed-point
ring encoding, the PRG, Shamir sharing, the key derivation, and the exact bytes each stage signs.

The PRG is AES-256-CTR keyed by a 32-byte seed: each seed keys one stream only. Flower's ``pseudo_rand_gen`` is not used: it XOR-folds the seed to 32
bits and seeds numpy's Mersenne Twister, so a server could try all 2^32 masks. Shamir sharing is
pycryptodome's, over GF(2^128): a 32-byte secret is shared as two 16-byte halves (as Flower does,
without its padding).

Encoding and error: a client sends ``round(x / step)`` mod 2^64 per coordinate; the server reads
the sum as a signed 64-bit integer times ``step``. For ``m`` survivors each coordinate of the
decoded sum is within ``m * step / 2`` of the exact sum (plus float64 rounding of the result,
relative 2^-53, once ``|sum| > 2^53 * step``). An input coordinate with ``|x| >= 2^62 * step / n``
(``n`` clients) is refused, so the sum never wraps. With the default ``step = 2^-32``: error at most
``m * 1.2e-10`` per coordinate, inputs up to ``2^30 / n`` (1.07e9 / n) in magnitude.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedsilo.privacy.roster import SIGNATURE_BYTES

HEADROOM = 2.0 ** 62          # |encoded input| < HEADROOM / n keeps the sum of n inside int64
SHARE_BYTES = 32              # one Shamir share of a 32-byte secret: two 16-byte halves
_CHUNK = 1 << 16              # coordinates per pass: masks and encodings work in cache, not in new arrays
_ZEROS = memoryview(bytes(8 * _CHUNK))  # the keystream is the AES-CTR encryption of zeros


@dataclass(frozen=True)
class SecAggSettings:
    """Shamir threshold ``t`` and the fixed-point step.

    ``threshold=None`` takes the smallest majority, ``n // 2 + 1`` (2 of 2 or 3, 3 of 4 or 5): with a
    roster, ``2t > n`` is what keeps a lying server from getting two survivor sets signed (see the
    module's threat model), while ``n - t`` drops (1 of 3, 2 of 5) are still tolerated.
    """

    threshold: int | None = None
    step: float = 2.0 ** -32

    def __post_init__(self) -> None:
        if not (isinstance(self.step, (int, float)) and math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"secure aggregation step must be a positive finite number, got {self.step!r}")
        if self.threshold is not None and (isinstance(self.threshold, bool) or not isinstance(self.threshold, int)):
            raise ValueError(f"secure aggregation threshold must be an integer or None, got {self.threshold!r}")

    def threshold_for(self, n: int) -> int:
        """The threshold for ``n`` clients, checked: 2 <= t <= n (one share must never suffice)."""
        if n < 2:
            raise ValueError(f"secure aggregation needs at least 2 clients (the sum of one is its input); got {n}")
        t = n // 2 + 1 if self.threshold is None else self.threshold
        if not 2 <= t <= n:
            raise ValueError(f"secure aggregation threshold must be between 2 and the number of clients ({n}); got {t}")
        return t


def derive_key(secret: bytes, purpose: str, round_id: int | str) -> bytes:
    """HKDF-SHA256 of a shared secret into a 32-byte key, separated by purpose and round."""
    info = f"fedsilo secagg {purpose} round {json.dumps(round_id)}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def add_prg(acc: np.ndarray, seed: bytes, subtract: bool = False) -> None:
    """``acc += PRG(seed)`` (or ``-=``) in Z_2^64: one AES-256-CTR stream, made and added a chunk at a time."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    keystream = np.empty(min(acc.size, _CHUNK), dtype=np.uint64)
    op = np.subtract if subtract else np.add
    for start in range(0, acc.size, _CHUNK):
        part = acc[start:start + _CHUNK]
        block = keystream[:part.size]
        encryptor.update_into(_ZEROS[:8 * part.size], memoryview(block).cast("B"))
        op(part, block, out=part)


def shamir_split(secret: bytes, threshold: int, n: int) -> list[bytes]:
    """Shares of a 32-byte secret; the share at position i has Shamir index i + 1."""
    halves = [Shamir.split(threshold, n, secret[i:i + 16], ssss=False) for i in (0, 16)]
    return [first + second for (_, first), (_, second) in zip(*halves)]


def shamir_combine(shares: Mapping[int, bytes]) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares keyed by their Shamir index."""
    return b"".join(Shamir.combine([(i, s[h:h + 16]) for i, s in shares.items()], ssss=False) for h in (0, 16))


def encode(x: np.ndarray, step: float, n_clients: int) -> np.ndarray:
    """``round(x / step)`` mod 2^64, refusing coordinates whose sum over n clients could wrap."""
    limit = HEADROOM * step / n_clients
    out = np.empty(x.shape, dtype=np.int64)
    for start in range(0, x.size, _CHUNK):
        part = x[start:start + _CHUNK]
        inside = np.abs(part) < limit  # False for NaN too
        if not inside.all():
            i = start + int(np.argmin(inside))
            if not np.isfinite(x[i]):  # no step encodes it: the silo's update itself is broken
                raise ValueError(f"secure aggregation input coordinate {i} is {x[i]} (not finite): the silo's own "
                                 "update is broken, and no step would encode it")
            raise ValueError(
                f"secure aggregation input coordinate {i} is {abs(x[i]):.6g} in magnitude; with step {step:g} "
                f"and {n_clients} clients it must be below {limit:.6g} (2^62 * step / n_clients), else the "
                "sum could wrap the 64-bit ring (use a larger step)")
        out[start:start + _CHUNK] = np.rint(part / step)
    return out.view(np.uint64)


def decode(total: np.ndarray, step: float) -> np.ndarray:
    """The float64 value of a ring sum read as signed 64-bit fixed point."""
    return np.multiply(total.view(np.int64), step, dtype=np.float64)


def colluders_tolerated(n: int, threshold: int, roster: bool) -> int:
    """The most colluding clients under which the server learns only a sum: ``t - 1`` for an
    honest-but-curious server; with a roster against an active one, the largest c with ``2t > n + c``."""
    return 2 * threshold - n - 1 if roster else threshold - 1


def _positions(clients: Sequence[str]) -> dict[str, int]:
    """{name: Shamir index (1-based position)}; the position also orders each pair's mask signs."""
    names = list(clients)
    if not all(isinstance(c, str) and c for c in names) or len(set(names)) != len(names):
        raise ValueError(f"secure aggregation clients must be distinct non-empty names, got {names!r}")
    return {name: i + 1 for i, name in enumerate(names)}


def _check_round(round_id: int | str) -> int | str:
    if isinstance(round_id, bool) or not isinstance(round_id, (int, str)):
        raise ValueError(f"secure aggregation round id must be an int or a str, got {round_id!r}")
    return round_id


def _quorum(k: int, threshold: int, n: int, what: str) -> None:
    if k < threshold:
        raise ValueError(f"secure aggregation needs at least {threshold} of {n} clients; only {k} {what}")


def _unknown(names: Collection[str], known: Collection[str], what: str) -> None:
    extra = sorted(set(names) - set(known))
    if extra:
        raise ValueError(f"secure aggregation: {what} from unknown clients {extra}")


def _agree(private: X25519PrivateKey, public: bytes, purpose: str, round_id: int | str) -> bytes:
    return derive_key(private.exchange(X25519PublicKey.from_public_bytes(public)), purpose, round_id)


def _aad(sender: str, recipient: str, round_id: int | str) -> bytes:
    return json.dumps(["fedsilo secagg share packet", sender, recipient, round_id]).encode()


COMMIT_BYTES = 32  # a round commitment: sha256 (fedsilo.privacy.secagg_parts.round_commitment)


def round_commitment(run_key: str, round_idx: int, model_digest: str, config_digest: str) -> bytes:
    """What a silo commits to in its stage-1 advert: the run, the round, the model it will train from and
    its training config, as it resolved them. Every peer of a round must commit the same, or none masks:
    a server that sends two silos different models or learning rates would learn the third's input."""
    return hashlib.sha256(json.dumps(["fedsilo round", run_key, round_idx, model_digest, config_digest]).encode()
                          ).digest()


def _advert_message(round_id: int | str, name: str, c_pk: bytes, s_pk: bytes, commit: bytes = b"") -> bytes:
    """What a client signs in stage 1: its two public keys for this round, under its name, and its round
    commitment."""
    return json.dumps(["fedsilo secagg keys", round_id, name, c_pk.hex(), s_pk.hex(), commit.hex()]).encode()


def _survivors_message(round_id: int | str, clients: Sequence[str], threshold: int, survivors: Sequence[str],
                       public_keys: Mapping[str, Mapping], commit: bytes = b"") -> bytes:
    """What a client signs in stage 4: the survivor set, with everything two clients' views must share for
    their signatures to count together (the round, the client list and its order, t, the survivors' keys,
    the round commitment)."""
    keys = [[v, public_keys[v]["c_pk"].hex(), public_keys[v]["s_pk"].hex()] for v in survivors]
    return json.dumps(["fedsilo secagg survivors", round_id, list(clients), threshold, keys, commit.hex()]).encode()


def _check_keys(public_keys: Mapping[str, Mapping]) -> None:
    for name, keys in public_keys.items():
        if not isinstance(keys, Mapping) or not all(isinstance(keys.get(k), bytes) and len(keys[k]) == 32
                                                    for k in ("c_pk", "s_pk")):
            raise ValueError(f"secure aggregation: {name!r} advertised malformed keys")
        sig, commit = keys.get("sig", b""), keys.get("commit", b"")
        if set(keys) - {"c_pk", "s_pk", "sig", "commit"} or not isinstance(sig, bytes) or \
                len(sig) not in (0, SIGNATURE_BYTES) or not isinstance(commit, bytes) or len(commit) not in (0, COMMIT_BYTES):
            raise ValueError(f"secure aggregation: {name!r} advertised malformed keys")
    seen: dict[bytes, str] = {}
    for name, keys in public_keys.items():
        for kind in ("c_pk", "s_pk"):
            other = seen.setdefault(keys[kind], name)
            if other != name or keys["c_pk"] == keys["s_pk"]:
                raise ValueError(f"secure aggregation: the keys advertised for {other!r} and {name!r} repeat "
                                 "one another (keys are fresh per client and round)")
