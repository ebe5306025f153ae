"""What secure aggregation against a lying server costs: bytes on the wire and seconds per round, side by side.

One round over N silos' float64 vectors (default 5 silos × 22,713,601 coordinates, MiniLM-L6's trainable
parameters), all parties in this process, in five ways, alternating within each repeat so that a busy
machine slows them alike:

* plain    FedAvg without masking: each silo uploads its vector as float32 (what fedsilo sends in the
           clear) and the server sums them;
* today    the semi-honest SecAgg of commit 738ed7c (four stages, no signatures, no consistency
           round), loaded from git as it was;
* unsigned fedsilo.privacy.secagg without a roster: the five stages, the consistency round unsigned;
* roster   fedsilo.privacy.secagg with a roster: signed advertisements, the consistency round with
           Ed25519 signatures, and every check a silo makes, no round commitment;
* committed the same with each silo's round commitment (issue 49): the server sends the model's sha256
           with stage 1 (64 hex characters per silo), each silo hashes the model it will train from (the
           float32 model, as it arrives) and the resolved config, and every advert carries 32 bytes more
           (n × 32 in every key set sent down); the commitment's own seconds are given apart.

Bytes are the payloads each message carries (keys, signatures, share packets, masked vectors, survivor
lists, shares; silo names as UTF-8), up (silos to server) and down (server to silos), summed over the
silos; the model sent down before training is the same in all four and not counted, nor is Flower's
framing. Seconds are the whole round's computation, every silo and the server one after another (on a
federation the silos work in parallel); the consistency round's share (stage 4 and the signature
checks of stage 5) is given apart.

    python bench/secagg_active.py [--length 22713601] [--silos 5] [--repeats 3]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from fedsilo.core.tensors import tensor_digest
from fedsilo.privacy import secagg
from fedsilo.privacy.roster import ephemeral_identities
from fedsilo.privacy.secagg_parts import round_commitment

TODAY = "738ed7c"  # the last commit with the semi-honest four-stage protocol
ROOT = Path(__file__).resolve().parents[1]


def todays_protocol() -> types.ModuleType:
    """fedsilo/privacy/secagg.py as it was at TODAY, imported from git (it needs only third-party modules)."""
    source = subprocess.run(["git", "show", f"{TODAY}:fedsilo/privacy/secagg.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"secagg_{TODAY}")
    module.__dict__["__name__"] = module.__name__
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{TODAY}:fedsilo/privacy/secagg.py", "exec"), module.__dict__)
    return module


def size(obj) -> int:
    """Payload bytes of a message: bytes and arrays as they are, names as UTF-8, containers as their parts."""
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(size(k) + size(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return sum(size(v) for v in obj)
    if isinstance(obj, (int, float)):
        return 8
    raise TypeError(type(obj))


class Round:
    """Counts one round's bytes and times its stages."""

    def __init__(self) -> None:
        self.up = self.down = 0
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._start
        self._start = now

    def result(self, total: np.ndarray, inputs: dict) -> dict:
        exact = sum(inputs.values())
        return {"up": self.up, "down": self.down, "seconds": sum(self.seconds.values()),
                "consistency_seconds": self.seconds.get("consistency", 0.0),
                "commit_seconds": self.seconds.get("commit", 0.0),
                "max_error": float(np.max(np.abs(total - exact)))}


def plain(inputs: dict, rid: str) -> dict:
    r = Round()
    uploads = {n: x.astype(np.float32) for n, x in inputs.items()}
    r.up += size(uploads)
    total = np.zeros(len(next(iter(inputs.values()))))
    for y in uploads.values():
        total += y
    r.stage("sum")
    return r.result(total, inputs)


def today(inputs: dict, rid: str, mod: types.ModuleType) -> dict:
    names, n = list(inputs), len(inputs)
    r = Round()
    server = mod.SecAggServer(names, mod.SecAggSettings(), len(inputs[names[0]]), rid)
    clients = {c: mod.SecAggClient(c, names, mod.SecAggSettings(), rid) for c in names}
    adverts = {c: clients[c].advertise_keys() for c in names}
    keys = server.collect_keys(adverts)
    r.up, r.down = r.up + size(adverts), r.down + n * size(keys)
    sent = {c: clients[c].share_keys(keys) for c in names}
    inboxes = server.route_packets(sent)
    r.up, r.down = r.up + size(sent), r.down + size(inboxes)
    r.stage("keys")
    masked = {c: clients[c].masked_input(inputs[c], inboxes[c]) for c in names}
    r.up += size(masked)
    r.stage("mask")
    request = server.unmask_request(masked)
    replies = {c: clients[c].unmask(**request) for c in request["survivors"]}
    r.up, r.down = r.up + size(replies), r.down + n * size(request)
    total = server.aggregate(masked, replies)
    r.stage("unmask")
    return r.result(total, inputs)


CONFIG = '{"name": "bench", "client": {"lr": 0.001}}'  # stands for a resolved config (a few kB at most)


def commitments(names: list[str], model: torch.Tensor, rid: str, r: Round) -> dict[str, bytes]:
    """Each silo's round commitment: the server's digest of the model sent down, then each silo's own."""
    r.down += len(names) * 64  # the model's sha256 in every stage-1 request
    out = {}
    for c in names:  # each silo hashes the model it received and its resolved config
        digest = tensor_digest({"model": model}, {})
        out[c] = round_commitment(rid, 1, digest, hashlib.sha256(CONFIG.encode()).hexdigest())
    r.stage("commit")
    return out


def fedsilo_protocol(inputs: dict, rid: str, signed: bool, committed: bool = False) -> dict:
    names, n = list(inputs), len(inputs)
    settings = secagg.SecAggSettings()
    r = Round()
    ids = ephemeral_identities(names) if signed else {}  # made out of band on a federation: not timed
    model = torch.from_numpy(next(iter(inputs.values())).astype(np.float32)) if committed else None
    r.stage("setup")
    r.seconds.pop("setup")
    commits = commitments(names, model, rid, r) if committed else {}
    server = secagg.SecAggServer(names, settings, len(inputs[names[0]]), rid)
    clients = {c: secagg.SecAggClient(c, names, settings, rid, ids.get(c), commits.get(c, b"")) for c in names}
    adverts = {c: clients[c].advertise_keys() for c in names}
    keys = server.collect_keys(adverts)
    r.up, r.down = r.up + size(adverts), r.down + n * size(keys)
    sent = {c: clients[c].share_keys(keys) for c in names}
    inboxes = server.route_packets(sent)
    r.up, r.down = r.up + size(sent), r.down + size(inboxes)
    r.stage("keys")
    masked = {c: clients[c].masked_input(inputs[c], inboxes[c]) for c in names}
    r.up += size(masked)
    r.stage("mask")
    survivors = server.survivors(masked)
    signed_sets = {c: clients[c].consistency(survivors) for c in survivors}
    signatures = server.unmask_request(signed_sets)
    r.up, r.down = r.up + size(signed_sets), r.down + n * size(survivors)
    r.stage("consistency")
    replies = {c: clients[c].unmask(signatures) for c in signatures}
    r.up, r.down = r.up + size(replies), r.down + n * size(signatures)
    total = server.aggregate(masked, replies)
    r.stage("unmask")
    if signed:  # the signature checks inside stage 5, timed once more alone
        start = time.perf_counter()
        for c in signatures:
            clients[c]._check_signatures(signatures)
        checks = time.perf_counter() - start  # moved from stage 5's time to the consistency round's
        r.seconds["consistency"] += checks
        r.seconds["unmask"] -= checks
    return r.result(total, inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=22_713_601)
    ap.add_argument("--silos", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    inputs = {f"silo{i}": rng.standard_normal(args.length) * 0.05 for i in range(args.silos)}
    mod = todays_protocol()
    ways = {"plain": lambda rid: plain(inputs, rid), "today": lambda rid: today(inputs, rid, mod),
            "unsigned": lambda rid: fedsilo_protocol(inputs, rid, False),
            "roster": lambda rid: fedsilo_protocol(inputs, rid, True),
            "committed": lambda rid: fedsilo_protocol(inputs, rid, True, committed=True)}
    got: dict[str, list[dict]] = {w: [] for w in ways}
    for rep in range(args.repeats):
        order = list(ways)[rep % len(ways):] + list(ways)[:rep % len(ways)]
        for way in order:
            got[way].append(ways[way](f"bench/{rep}"))
            print(f"  repeat {rep + 1} {way}: {got[way][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    print(f"{args.silos} silos x {args.length:,} float64 coordinates, {args.repeats} repeats (median seconds)")
    print(f"{'':10} {'bytes up':>15} {'bytes down':>12} {'seconds':>8} {'(range)':>14} {'consistency s':>14} "
          f"{'commit s':>9} {'max error':>10}")
    med = {}
    for way, runs in got.items():
        secs = [r["seconds"] for r in runs]
        med[way] = {"up": runs[0]["up"], "down": runs[0]["down"], "seconds": statistics.median(secs),
                    "consistency": statistics.median(r["consistency_seconds"] for r in runs),
                    "commit": statistics.median(r["commit_seconds"] for r in runs)}
        print(f"{way:10} {runs[0]['up']:>15,} {runs[0]['down']:>12,} {med[way]['seconds']:>8.2f} "
              f"{min(secs):>6.2f}-{max(secs):<6.2f} {med[way]['consistency']:>14.4f} {med[way]['commit']:>9.4f} "
              f"{runs[0]['max_error']:>10.2e}")
    print("ratios (bytes up+down, seconds):")
    for a, b in [("committed", "roster"), ("roster", "today"), ("roster", "unsigned"), ("roster", "plain"),
                 ("today", "plain")]:
        bytes_ratio = (med[a]["up"] + med[a]["down"]) / (med[b]["up"] + med[b]["down"])
        print(f"  {a} / {b}: bytes {bytes_ratio:.6f}, seconds {med[a]['seconds'] / med[b]['seconds']:.2f}")


if __name__ == "__main__":
    main()
