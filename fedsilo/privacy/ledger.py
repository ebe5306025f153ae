"""A silo's privacy ledger: every DP release that left the silo, one JSON line each, in a file of its own.

Why not the silo's store: the store is round-versioned, and its round is the coordinator's to say (a
`train` message for an earlier round truncates it; a new run key starts a new one), so an accountant
kept there could be reset by the very server DP guards against. The ledger is append-only, outside every
run's folder, and its place is the silo operator's (a SuperNode's node config; in-process, the run
directory): nothing a message carries names it, truncates it or starts a new one.

A line records the run (its key), the round, the scope (whose budget: by default the silo's data, a
fingerprint of its training examples, so that every run on the same data adds up), each DP mechanism of
the release with σ, q, steps and δ, and the sha256 of what was released and of what was received. The
silo writes it — flushed and fsynced, with its folder — before the update leaves. ε is computed from every
line of the scope, every run, with the accountant (fedsilo.privacy.accountant.Budget).

Rounds only go forward: in a run, a round that is not above the last round this silo released is refused,
but for a provable re-send. Before its ledger line the silo writes what it released (tensors, numbers, and
the store state the round left) atomically to a re-send record; when the same round arrives again with the
same received payload (sha256 equal to the line's `received`), the silo sends back that record — after
checking that its sha256 is the line's `released` — without training and without a new line: the same
bytes again, no new release, no budget spent. Under secure aggregation a re-send is refused instead: the
server would unmask the same input twice, against two survivor sets whose difference then reveals
what the masks hide.

Resetting a scope is a local command on the silo (`fedsilo ledger reset PATH --scope S`): its lines move
to an archive beside the ledger, never deleted.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from fedsilo.core.messages import ClientUpdate
from fedsilo.core.tensors import Tensors, tensor_digest
from fedsilo.core.transforms import SiloRefused
from fedsilo.errors import ConfigError
from fedsilo.fileio import atomic_write_bytes, regular_file

from .accountant import Budget
from .ledger_lines import VERSION, check_entry

LEDGER_FILE = "privacy-ledger.jsonl"  # a SuperNode's default, in its state folder (outside every run's)


class LedgerRefused(SiloRefused):
    """The ledger does not allow this release (a replayed round, an unprovable re-send, a spent budget)."""


class BudgetTaken(LedgerRefused):
    """Between the round's start and its release another run spent this scope's budget."""
    final = True


def data_scope(files: Mapping[str, Mapping]) -> str:
    """The default scope: the data the operator gave the silo — the sha256 of each file it reads (its own
    files or its benchmark silo's, whatever the config then subsamples, splits or filters), where they
    lie not counted — so every run on any subset of it shares one budget, whatever its run key or config."""
    h = hashlib.sha256()
    for digest in sorted(str(f["sha256"]) for f in files.values()):
        h.update(digest.encode())
    return f"data:{h.hexdigest()[:16]}"


def examples_scope(examples: Sequence) -> str:
    """The scope of a silo whose task reads no files it can name (a plug-in without `inspect`): a
    fingerprint of its training examples (order does not matter). A subset is another scope here: such a
    task's subsampling settings are the server's, so its docs must say so (docs/privacy.md)."""
    h = hashlib.sha256()
    for item in sorted(hashlib.sha256(repr(e).encode()).digest() for e in examples):
        h.update(item)
    return f"examples:{h.hexdigest()[:16]}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PrivacyLedger:
    """The file: read, append (durably, under an exclusive lock), archive a scope."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextmanager
    def _locked(self):
        """The ledger held exclusively (another run of the same silo appends through the same lock)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def entries(self) -> list[dict]:
        """Every complete line. A torn last line (no newline: the writer was killed inside the write) is
        no release: the line is fsynced before an update leaves. Any other bad line is a ValueError
        naming file:line (and the field: fedsilo.privacy.ledger_lines) — a ledger that cannot be read
        allows no DP round. What is there but is not a regular file (a FIFO would block the reader for
        ever) is refused by name before it is opened; nothing there is an empty ledger."""
        if not os.path.lexists(self.path):
            return []
        regular_file(self.path, "privacy ledger", ConfigError)
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"privacy ledger {self.path}: not a text file (a ledger is UTF-8 JSON lines)") from None
        lines = text.split("\n")
        if lines[-1].strip() and not lines[-1].startswith("{"):  # not the start of a line the ledger wrote
            raise ValueError(f"privacy ledger {self.path}:{len(lines)}: not a ledger line (each is a JSON object)")
        out = []
        for lineno, line in enumerate(lines[:-1], start=1):  # the part after the last newline is torn
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"privacy ledger {self.path}:{lineno}: malformed JSON ({err.msg})") from None
            out.append(check_entry(entry, f"{self.path}:{lineno}"))
        return out

    def append(self, entry: dict, admit: Callable[[list[dict]], None] | None = None) -> None:
        """One line, durable before this returns: written, flushed, fsynced, and its folder fsynced.
        `admit(entries)` runs under the lock first, on the ledger as it is now, and may refuse (raise)."""
        with self._locked():
            if admit is not None:
                admit(self.entries())
            created = not self.path.exists()
            with open(self.path, "a+b") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell():
                    fh.seek(-1, os.SEEK_END)
                    if fh.read(1) != b"\n":  # a torn line a killed writer left: it never counted
                        fh.seek(0)
                        keep = fh.read().rfind(b"\n") + 1
                        fh.truncate(keep)
                fh.seek(0, os.SEEK_END)
                fh.write((json.dumps(entry, sort_keys=True) + "\n").encode())
                fh.flush()
                os.fsync(fh.fileno())
            if created:
                _fsync_dir(self.path.parent)

    def reset(self, scope: str) -> tuple[Path, int]:
        """Move the scope's lines to an archive file beside the ledger (never deleted); (archive, count)."""
        with self._locked():
            entries = self.entries()
            gone = [e for e in entries if e["scope"] == scope]
            if not gone:
                raise ValueError(f"privacy ledger {self.path}: no entry of scope {scope!r} "
                                 f"(scopes: {', '.join(sorted({e['scope'] for e in entries})) or 'none'})")
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            archive = self.path.with_name(f"{self.path.stem}.archived-{stamp}.jsonl")
            n = 1
            while archive.exists():
                archive, n = self.path.with_name(f"{self.path.stem}.archived-{stamp}-{n}.jsonl"), n + 1
            lines = lambda rows: "".join(json.dumps(e, sort_keys=True) + "\n" for e in rows).encode()  # noqa: E731
            atomic_write_bytes(archive, lines(gone))
            atomic_write_bytes(self.path, lines([e for e in entries if e["scope"] != scope]))
            _fsync_dir(self.path.parent)
        return archive, len(gone)


def history(entries: Iterable[dict], scope: str, level: str) -> list[tuple[float, float, int]]:
    """(σ, q, steps) of every release of the scope at this level (record or silo), in order."""
    return [(float(m["noise_multiplier"]), float(m["sample_rate"]), int(m["steps"]))
            for e in entries if e["scope"] == scope for m in e["mechanisms"] if m["level"] == level]


def epsilon_of(entries: Iterable[dict], scope: str, level: str, delta: float) -> float:
    return Budget(0.0, 0.0, delta, history=history(entries, scope, level)).epsilon()


def describe(entries: list[dict]) -> list[str]:
    """What `fedsilo ledger show` prints: per scope, its releases by run, and ε from every one of them."""
    if not entries:
        return ["no release recorded"]
    out = []
    for scope in dict.fromkeys(e["scope"] for e in entries):
        mine = [e for e in entries if e["scope"] == scope]
        runs: dict[str, list[int]] = {}
        for e in mine:
            runs.setdefault(e["run"], []).append(int(e["round"]))
        out.append(f"scope {scope}: {len(mine)} release(s) in {len(runs)} run(s) (" + "; ".join(
            f"{run}: round(s) {', '.join(map(str, rounds))}" for run, rounds in runs.items()) + ")")
        for level in dict.fromkeys(m["level"] for e in mine for m in e["mechanisms"]):
            used = [m for e in mine for m in e["mechanisms"] if m["level"] == level]
            sigmas = sorted({round(float(m["noise_multiplier"]), 6) for m in used})
            line = f"  {level} level: {sum(int(m['steps']) for m in used)} step(s), σ {', '.join(map(str, sigmas))}"
            delta = next((m["delta"] for m in reversed(used) if m.get("delta") is not None), None)
            if delta is not None:
                line += f"; ε = {epsilon_of(mine, scope, level, float(delta)):.4f} at δ = {float(delta):.3g}"
            out.append(line)
    return out


# ---- the re-send record -------------------------------------------------------------------------------

_NUMBERS = [f.name for f in dataclasses.fields(ClientUpdate) if f.name not in ("tensors", "secure_input")]


def _numbers(update: ClientUpdate) -> str:
    return json.dumps({k: getattr(update, k) for k in _NUMBERS}, sort_keys=True)


def released_digest(update: ClientUpdate) -> str:
    """sha256 of what leaves: the update's tensors (before any mask) and every number it reports."""
    return tensor_digest(update.tensors, {"numbers": _numbers(update)})


def received_digest(received: Tensors) -> str:
    return tensor_digest(received, {})


@dataclass
class Resend:
    """A stored release: the update exactly as it left, and the store state its round left behind."""
    update: ClientUpdate
    slots: dict[str, Tensors]
    meta: dict


@dataclass
class Admission:
    """A round let through the ledger: the received payload's sha256 (None: this silo keeps no ledger)
    and, for a provable re-send, the stored release."""
    received: str | None = None
    resend: Resend | None = None


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def write_resend(path: Path, run: str, round_idx: int, update: ClientUpdate, slots: dict[str, Tensors],
                 meta: dict) -> None:
    """Atomically (temporary file, fsync, rename, folder fsync): the ledger line that names it comes after."""
    tensors = {f"update/{k}": _cpu(v) for k, v in update.tensors.items()}
    tensors.update({f"state/{slot}/{k}": _cpu(v) for slot, values in slots.items() for k, v in values.items()})
    info = {"run": run, "round": str(round_idx), "update": _numbers(update), "meta": json.dumps(meta)}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_bytes(path, save(tensors, metadata=info))
    _fsync_dir(path.parent)


def read_resend(path: Path) -> tuple[dict[str, str], Resend]:
    with safe_open(str(path), "pt") as f:
        info = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    numbers = json.loads(info["update"])
    numbers["losses"] = [tuple(x) for x in numbers.get("losses", [])]
    update = ClientUpdate(tensors={k[len("update/"):]: t for k, t in tensors.items() if k.startswith("update/")},
                          **numbers)
    slots: dict[str, Tensors] = {}
    for key, t in tensors.items():
        if key.startswith("state/"):
            slot, _, name = key[len("state/"):].partition("/")
            slots.setdefault(slot, {})[name] = t
    return info, Resend(update, slots, json.loads(info["meta"]))


# ---- a silo's side -----------------------------------------------------------------------------------

@dataclass
class SiloLedger:
    """The ledger stage of one silo's round (SiloClient.fit): `admit` before anything else, `record` after
    the update is built and before it leaves. `run_key`: this run's key (or a function giving it once
    the run exists); `scope`: whose budget (default: `data_scope` of the silo's files)."""
    ledger: PrivacyLedger
    run_key: str | Callable[[], str]
    scope: str
    silo: str = ""
    one_operator: bool = False  # the engine runs the server too (in-process, fedsilo's simulation): no second
    # sum over one model can tell it more than the data it holds, so a round skipped after masking is retried

    @property
    def run(self) -> str:
        if callable(self.run_key):
            self.run_key = self.run_key()
        return self.run_key

    def __getstate__(self) -> dict:
        """Pickled (to a spawned worker) with its run key resolved."""
        return {**self.__dict__, "run_key": self.run}

    @property
    def resend_path(self) -> Path:
        """One record per run (its last release), beside the ledger."""
        name = hashlib.sha256(self.run.encode()).hexdigest()[:16]
        return self.ledger.path.with_name(self.ledger.path.stem + ".resend") / f"{name}.safetensors"

    def entries(self) -> list[dict]:
        try:
            return self.ledger.entries()
        except ValueError as err:
            raise LedgerRefused(f"{err}; no DP round until the silo's operator repairs it") from None

    def history(self, level: str) -> list[tuple[float, float, int]]:
        """Every release of this scope at `level`, every run."""
        return history(self.entries(), self.scope, level)

    def this_run(self, level: str) -> list[tuple[float, float, int]]:
        return history([e for e in self.entries() if e["run"] == self.run], self.scope, level)

    def admit(self, round_idx: int, received: Tensors, secure: bool) -> Admission:
        """SiloRefused for a round not above this run's last release, unless it is a provable re-send
        (then the stored release); `secure`: the update would be masked (secure aggregation)."""
        digest = received_digest(received)
        entries = self.entries()
        mine = [e for e in entries if e["run"] == self.run]
        where = f"privacy ledger {self.ledger.path}"
        if not mine or round_idx > max(int(e["round"]) for e in mine):
            if secure and not self.one_operator:
                self._refuse_second_sum(entries, digest, round_idx, where)
            return Admission(digest)
        last = max(mine, key=lambda e: int(e["round"]))
        if round_idx < int(last["round"]) or last["received"] != digest:
            differs = "" if round_idx < int(last["round"]) else " with another global model than the one it answered"
            raise LedgerRefused(f"{where}: round {round_idx}{differs} is not above round {last['round']}, the last "
                                f"this silo released in run {self.run!r}; it sends nothing again that the ledger "
                                "cannot prove identical")
        if secure or last.get("masked"):
            raise LedgerRefused(f"{where}: round {round_idx} again under secure aggregation: a re-sent masked input "
                                "unmasked over a second survivor set would reveal it, so it is not sent twice")
        try:
            info, stored = read_resend(self.resend_path)
        except (OSError, KeyError, ValueError) as err:
            raise LedgerRefused(f"{where}: round {round_idx} again, but its stored release {self.resend_path} "
                                f"cannot be read ({err}); nothing is sent") from None
        if info.get("run") != self.run or info.get("round") != str(round_idx) or \
                released_digest(stored.update) != last["released"]:
            raise LedgerRefused(f"{where}: round {round_idx} again, but {self.resend_path} is not the release its "
                                "ledger line names (sha256 differs); nothing is sent")
        return Admission(digest, stored)

    def _refuse_second_sum(self, entries: list[dict], digest: str, round_idx: int, where: str) -> None:
        """No second masked input trained from a model this scope already masked an input from, in any run:
        two sums whose other inputs repeat (training is a function of what the server sends) differ by
        this silo's input (Lam et al. 2021). A secure round that failed or was skipped after the silo masked
        is not retried on the same model either: the silo cannot know what the server unmasked."""
        before = next((e for e in entries if e["scope"] == self.scope and e.get("masked") and e["received"] == digest),
                      None)
        if before is not None:
            raise LedgerRefused(f"{where}: round {round_idx} would mask a second input trained from the model this "
                                f"silo already masked one from (run {before['run']!r}, round {before['round']}); two "
                                "sums over the same model give their difference to the server, so it is not sent")

    def pinned_delta(self, level: str) -> tuple[float, str] | None:
        """The δ this scope spends its budget at (level `level`): the first release's, and where it is
        written; None before its first release. A message does not change it."""
        for lineno, e in enumerate(self.entries(), start=1):
            if e["scope"] != self.scope:
                continue
            for m in e["mechanisms"]:
                if m["level"] == level and m.get("delta") is not None:
                    return float(m["delta"]), f"{self.ledger.path} (run {e['run']!r}, round {e['round']})"
        return None

    def record(self, round_idx: int, admission: Admission, update: ClientUpdate, mechanisms: list[dict],
               slots: dict[str, Tensors], meta: dict, masked: bool) -> None:
        """The re-send record, then the ledger line (each durable) — the update leaves only after. A
        mechanism with a target ε is checked again under the ledger's lock: another run of this scope
        may have spent since the round began (BudgetTaken: nothing leaves)."""
        if not masked:  # a masked input is never sent twice (admit), so nothing to keep for it
            write_resend(self.resend_path, self.run, round_idx, update, slots, meta)
        entry = {"v": VERSION, "run": self.run, "round": round_idx, "scope": self.scope, "silo": self.silo,
                 "mechanisms": [{k: v for k, v in m.items() if k != "target_epsilon"} for m in mechanisms],
                 "released": released_digest(update), "received": admission.received, "masked": masked,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

        def within_targets(entries: list[dict]) -> None:
            for m in mechanisms:
                target = m.get("target_epsilon")
                if target is None:
                    continue
                spent = history(entries, self.scope, m["level"])
                after = Budget(m["noise_multiplier"], m["sample_rate"], m["delta"], history=spent).epsilon(m["steps"])
                if after > target * (1 + 1e-9) or math.isnan(after):
                    raise BudgetTaken(f"privacy budget: round {round_idx} would take {self.silo or 'the silo'} to "
                                      f"ε = {after:.3f} > its target ε = {target:g} (scope {self.scope}, "
                                      "spent meanwhile by another run); it trains no more")
        try:
            self.ledger.append(entry, within_targets)
        except ValueError as err:  # the ledger became unreadable since the round began
            raise LedgerRefused(f"{err}; no DP round until the silo's operator repairs it") from None
