"""A silo's persistent state between rounds, behind one interface with two backends.

State is a set of named tensor slots (private tensors, the client's whole model when it keeps one,
optimiser state) plus small JSON metadata (steps done, the names it uploaded last). Rounds are
versions: during round r, `get` returns the client's latest state saved at or before r and `put`
saves it as round r. A checkpoint of round r refers to the store's round r; `truncate(r)` forgets
later (unfinished) rounds on resume, and `prune` keeps only the rounds a checkpoint still refers to
(the current and the best).

`DiskStore` writes one safetensors file per client and round (atomic: temp file, fsync, rename), so
peak RAM holds one client's state at a time however many clients keep personal models; the Flower
ClientApp uses it in the silo's own state folder. `MemoryStore` keeps the same in RAM.

A file is a run's state outside its checkpoint, so it is checked like one: its metadata names its run,
client and round and carries a content hash, and the checkpoint records the hash of each file it
refers to. A file that is missing, unreadable, changed, of another run or moved is a `StoreError`
naming it, never a silently different (or restarted) client.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save

from fedsilo.core.tensors import Tensors, tensor_digest
from fedsilo.errors import StoreError
from fedsilo.fileio import atomic_write_bytes

_AGAIN = "restore it, or start a new run (another --out)"


@dataclass
class ClientState:
    slots: dict[str, Tensors] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    source: str = ""  # the file it was read from, for messages ("" when it comes from memory)

    def slot(self, name: str) -> Tensors:
        return self.slots.get(name, {})


class ClientStore(Protocol):
    round: int

    def set_round(self, round_idx: int) -> None: ...
    def get(self, client: str) -> ClientState | None: ...
    def put(self, client: str, state: ClientState) -> None: ...
    def truncate(self, last_round: int) -> None: ...
    def prune(self, keep: Iterable[int]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def _latest_at_or_before(rounds: Iterable[int], r: int) -> int | None:
    eligible = [x for x in rounds if x <= r]
    return max(eligible) if eligible else None


def _kept_rounds(rounds: Iterable[int], keep: Iterable[int]) -> set[int]:
    """For each round a checkpoint refers to, the saved round that state comes from."""
    rounds = list(rounds)
    return {x for k in keep if (x := _latest_at_or_before(rounds, k)) is not None}


class MemoryStore:
    def __init__(self) -> None:
        self.round = 0
        self._states: dict[str, dict[int, ClientState]] = {}

    def set_round(self, round_idx: int) -> None:
        self.round = round_idx

    def get(self, client: str) -> ClientState | None:
        versions = self._states.get(client, {})
        r = _latest_at_or_before(versions, self.round)
        return None if r is None else versions[r]

    def put(self, client: str, state: ClientState) -> None:
        self._states.setdefault(client, {})[self.round] = ClientState(
            {k: {n: t.detach().clone() for n, t in v.items()} for k, v in state.slots.items()},
            json.loads(json.dumps(state.meta)))

    def truncate(self, last_round: int) -> None:
        for versions in self._states.values():
            for r in [r for r in versions if r > last_round]:
                del versions[r]

    def prune(self, keep: Iterable[int]) -> None:
        keep = list(keep)
        for versions in self._states.values():
            kept = _kept_rounds(versions, keep)
            for r in [r for r in versions if r not in kept]:
                del versions[r]

    def state_dict(self) -> dict:
        """Embedded in the checkpoint (memory has no files to refer to)."""
        return {"kind": "memory", "round": self.round,
                "states": {c: {r: {"slots": s.slots, "meta": json.dumps(s.meta)} for r, s in v.items()}
                           for c, v in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.round = int(state["round"])
        self._states = {c: {int(r): ClientState({k: dict(t) for k, t in s["slots"].items()}, json.loads(s["meta"]))
                            for r, s in v.items()} for c, v in state["states"].items()}


_FILE = re.compile(r"round-(\d+)\.safetensors$")


class DiskStore:
    """`root/<client>/round-NNNNN.safetensors`; tensors are stored as `<slot>/<name>`.

    `run_id` (or a function giving it once the run directory exists) is written into each file and
    checked on reading; a store without one (inspecting files) reads any run's."""

    def __init__(self, root: str | Path, run_id: str | Callable[[], str] | None = None) -> None:
        self.root = Path(root)
        self.round = 0
        self._run_id = run_id
        self._hashes: dict[str, dict[int, str]] = {}  # client → round → hash of each file this run trusts

    def _run(self) -> str | None:
        if callable(self._run_id):
            self._run_id = self._run_id()
        return self._run_id

    def set_round(self, round_idx: int) -> None:
        self.round = round_idx

    def _dir(self, client: str) -> Path:
        if not client or "/" in client or client.startswith("."):
            raise ValueError(f"client name {client!r} cannot name a store folder")
        return self.root / client

    def _path(self, client: str, r: int) -> Path:
        return self._dir(client) / f"round-{r:05d}.safetensors"

    def _rounds(self, client: str) -> dict[int, Path]:
        folder = self._dir(client)
        if not folder.is_dir():
            return {}
        return {int(m.group(1)): p for p in folder.iterdir() if (m := _FILE.match(p.name))}

    def clients(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def _missing(self, client: str, r: int) -> StoreError:
        return StoreError(f"{self._path(client, r)} is missing, but the checkpoint refers to it ({client}'s state "
                          f"of round {r}); {_AGAIN}")

    def get(self, client: str) -> ClientState | None:
        files, known = self._rounds(client), self._hashes.get(client, {})
        r = _latest_at_or_before({*files, *known}, self.round)
        if r is None:
            return None
        if r not in files:
            raise self._missing(client, r)
        return self._read(client, r, files[r], known.get(r))

    def _read(self, client: str, r: int, path: Path, expected: str | None) -> ClientState:
        try:
            with safe_open(str(path), framework="pt") as fh:
                info = dict(fh.metadata() or {})
                flat = {key: fh.get_tensor(key) for key in fh.keys()}
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user-facing problem
            raise StoreError(f"{path}: unreadable client state ({err}); {_AGAIN}") from None
        problem = self._problem(client, r, info, flat, expected)
        if problem:
            raise StoreError(f"{path} {problem}")
        state = ClientState(meta=json.loads(info.get("meta", "{}")), source=str(path))
        for key, t in flat.items():
            slot, _, name = key.partition("/")
            state.slots.setdefault(slot, {})[name] = t
        return state

    def _problem(self, client: str, r: int, info: dict, flat: Tensors, expected: str | None) -> str | None:
        """What makes a file untrustworthy, or None: no hash, changed, another run's, moved, replaced."""
        claimed = info.pop("sha256", None)
        if claimed is None:
            return "carries no content hash (written by an older fedsilo); start a new run (another --out)"
        digest = tensor_digest(flat, info)
        if digest != claimed:
            bad = any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in flat.values())
            return (f"does not match {'the checkpoint' if expected else 'its content hash'} (changed after it was "
                    f"written{'; it now holds NaN/Inf values' if bad else ''}); {_AGAIN}")
        run = self._run()
        if run is not None and info.get("run") != run:
            return f"belongs to another run (run id {info.get('run')!r}, this run is {run!r}); {_AGAIN}"
        if (info.get("client"), info.get("round")) != (client, str(r)):
            return (f"holds {info.get('client')}'s state of round {info.get('round')}, not {client}'s of round {r} "
                    f"(moved or copied); {_AGAIN}")
        if expected is not None and digest != expected:
            return f"does not match the checkpoint (replaced after it was written); {_AGAIN}"
        return None

    def put(self, client: str, state: ClientState) -> None:
        flat = {f"{slot}/{name}": t.detach().to("cpu").contiguous()
                for slot, tensors in state.slots.items() for name, t in tensors.items()}
        info = {"meta": json.dumps(state.meta), "run": self._run() or "", "client": client, "round": str(self.round)}
        digest = tensor_digest(flat, info)
        folder = self._dir(client)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self._path(client, self.round), save(flat, metadata={**info, "sha256": digest}))
        self._hashes.setdefault(client, {})[self.round] = digest

    def truncate(self, last_round: int) -> None:
        for client in self.clients():
            for r, path in self._rounds(client).items():
                if r > last_round:
                    path.unlink(missing_ok=True)
            for tmp in self._dir(client).glob("*.tmp"):
                tmp.unlink(missing_ok=True)
        for known in self._hashes.values():
            for r in [r for r in known if r > last_round]:
                del known[r]

    def prune(self, keep: Iterable[int]) -> None:
        """Keeps the files (and hashes) `keep` refers to; a referred file already missing stays an error."""
        keep = list(keep)
        for client in sorted({*self.clients(), *self._hashes}):
            files, known = self._rounds(client), self._hashes.get(client, {})
            kept = _kept_rounds({*files, *known}, keep)
            for r, path in files.items():
                if r not in kept:
                    path.unlink(missing_ok=True)
            if client in self._hashes:
                self._hashes[client] = {r: h for r, h in known.items() if r in kept}

    def state_dict(self) -> dict:
        """A reference to the files (they are the state) with the hash of each one it refers to: each
        client's latest state at or before this round."""
        refs = {c: {r: known[r]} for c, known in self._hashes.items()
                if (r := _latest_at_or_before(known, self.round)) is not None}
        return {"kind": "disk", "round": self.round, "files": refs}

    def load_state_dict(self, state: dict) -> None:
        """Trusts the files the checkpoint refers to (checked for presence now, content when read)."""
        if state.get("kind") != "disk":
            raise StoreError("checkpoint holds a memory store; resume with engine.store = \"memory\"")
        if "files" not in state:
            raise StoreError(f"{self.root}: the checkpoint was written by an older fedsilo that kept no content hashes "
                             "of its client store files; start a new run (another --out)")
        self.round = int(state["round"])
        self._hashes = {c: {int(r): str(h) for r, h in known.items()} for c, known in state["files"].items()}
        for client, known in self._hashes.items():
            for r in known:
                if not self._path(client, r).is_file():
                    raise self._missing(client, r)


def make_store(kind: str, root: str | Path, run_id: str | Callable[[], str] | None = None) -> ClientStore:
    return DiskStore(root, run_id) if kind == "disk" else MemoryStore()


def optimizer_to_slot(opt: torch.optim.Optimizer) -> tuple[Tensors, dict]:
    """A torch optimiser's per-parameter state as flat tensors (+ which entries were Python numbers)."""
    tensors, scalars = {}, {}
    for idx, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            name = f"{idx}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().clone()
            else:
                tensors[name] = torch.tensor(float(value), dtype=torch.float64)
                scalars[name] = type(value).__name__
    return tensors, scalars


def optimizer_from_slot(opt: torch.optim.Optimizer, tensors: Tensors, scalars: dict) -> None:
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        idx, _, key = name.partition(".")
        kind = scalars.get(name)
        value = t if kind is None else (int(t.item()) if kind == "int" else float(t.item()))
        state.setdefault(int(idx), {})[key] = value
    full = opt.state_dict()
    full["state"] = state
    opt.load_state_dict(full)
