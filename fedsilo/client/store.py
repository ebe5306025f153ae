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
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.fileio import atomic_write_bytes


@dataclass
class ClientState:
    slots: dict[str, Tensors] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

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
    """`root/<client>/round-NNNNN.safetensors`; tensors are stored as `<slot>/<name>`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.round = 0

    def set_round(self, round_idx: int) -> None:
        self.round = round_idx

    def _dir(self, client: str) -> Path:
        if not client or "/" in client or client.startswith("."):
            raise ValueError(f"client name {client!r} cannot name a store folder")
        return self.root / client

    def _rounds(self, client: str) -> dict[int, Path]:
        folder = self._dir(client)
        if not folder.is_dir():
            return {}
        return {int(m.group(1)): p for p in folder.iterdir() if (m := _FILE.match(p.name))}

    def clients(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def get(self, client: str) -> ClientState | None:
        from safetensors import safe_open

        files = self._rounds(client)
        r = _latest_at_or_before(files, self.round)
        if r is None:
            return None
        state = ClientState()
        try:
            with safe_open(str(files[r]), framework="pt") as fh:
                state.meta = json.loads((fh.metadata() or {}).get("meta", "{}"))
                for key in fh.keys():
                    slot, _, name = key.partition("/")
                    state.slots.setdefault(slot, {})[name] = fh.get_tensor(key)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user-facing problem
            raise ValueError(f"{files[r]}: unreadable client state ({err})") from None
        return state

    def put(self, client: str, state: ClientState) -> None:
        from safetensors.torch import save

        flat = {f"{slot}/{name}": t.detach().to("cpu").contiguous()
                for slot, tensors in state.slots.items() for name, t in tensors.items()}
        data = save(flat, metadata={"meta": json.dumps(state.meta)})
        folder = self._dir(client)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"round-{self.round:05d}.safetensors", data)

    def truncate(self, last_round: int) -> None:
        for client in self.clients():
            for r, path in self._rounds(client).items():
                if r > last_round:
                    path.unlink(missing_ok=True)
            for tmp in self._dir(client).glob("*.tmp"):
                tmp.unlink(missing_ok=True)

    def prune(self, keep: Iterable[int]) -> None:
        keep = list(keep)
        for client in self.clients():
            files = self._rounds(client)
            kept = _kept_rounds(files, keep)
            for r, path in files.items():
                if r not in kept:
                    path.unlink(missing_ok=True)

    def state_dict(self) -> dict:
        """A reference: the files are the state."""
        return {"kind": "disk", "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "disk":
            raise ValueError("checkpoint holds a memory store; resume with engine.store = \"memory\"")
        self.round = int(state["round"])


def make_store(kind: str, root: str | Path) -> ClientStore:
    return DiskStore(root) if kind == "disk" else MemoryStore()


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
