"""The federation server: global shared tensors, per-client payloads, aggregation, server optimiser.

Transport-free: engines (in-process, Flower) ask it what to send each client and hand it the
clients' updates. Clients upload tensor *values*; the server forms Δ_i = w_i − w itself, so a
client may send a tensor it did not receive this round (partial downloads).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from fedsilo.core.aggregate import RoundAggregator
from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import Tensors, clone, is_finite, nbytes
from fedsilo.core.weighting import WEIGHTINGS


@dataclass
class ClientUpdate:
    """What a client returns after local training: the uploaded tensors' values + its numbers."""
    tensors: Tensors
    n_examples: int
    stats: dict[str, float] = field(default_factory=dict)  # delta_loss, mean_loss, loss/<term>, metric/<name>
    steps: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def delta_loss(self) -> float:
        return self.stats.get("delta_loss", math.nan)

    @property
    def mean_loss(self) -> float:
        return self.stats.get("mean_loss", math.nan)


def sample_clients(clients: list[str], round_idx: int, seed: int, fraction: float = 1.0,
                   count: int | None = None) -> list[str]:
    """Seeded per round, so a resumed run samples the same clients."""
    k = count if count is not None else max(1, round(fraction * len(clients)))
    if k >= len(clients):
        return list(clients)
    chosen = set(random.Random(f"{seed}/{round_idx}").sample(clients, k))
    return [c for c in clients if c in chosen]


def reject_reason(update: ClientUpdate, expected: Tensors) -> str | None:
    """Why an update cannot be aggregated (unknown tensor, wrong shape, NaN/Inf), or None."""
    for name, t in update.tensors.items():
        if name not in expected:
            return f"unknown tensor {name!r}"
        if tuple(t.shape) != tuple(expected[name].shape):
            return f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
    if not is_finite(update.tensors):
        return "non-finite values (NaN/Inf) in the update"
    if not update.n_examples > 0:
        return "no training examples"
    return None


def _json_number(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class Server:
    def __init__(self, global_tensors: Tensors, optimizer: ServerOptimizer, weighting: str,
                 plan: ExchangePlan | None = None, weighting_stat: str | None = None) -> None:
        self.params = clone(global_tensors)
        self.optimizer = optimizer
        self.weighting = weighting
        self.stat = weighting_stat or WEIGHTINGS.get(weighting).reads
        self.plan = plan or ExchangePlan()
        self.uploaded: dict[str, list[str]] = {}  # per client: the names it uploaded last (download policies)
        self.round = 0
        self._agg: RoundAggregator | None = None
        self._record: dict = {}
        self._sent: dict[str, int] = {}

    def begin_round(self, round_idx: int) -> None:
        self.round = round_idx
        self._agg = RoundAggregator(self.weighting, like=self.params)
        self._record, self._sent = {}, {}

    def payload(self, client: str) -> Tensors:
        """The tensors this client receives this round; their bytes are counted as sent."""
        names = self.plan.choose_download(self.round, list(self.params), self.uploaded.get(client))
        tensors = {k: self.params[k] for k in names}
        self._sent[client] = nbytes(tensors)
        return tensors

    def receive(self, client: str, update: ClientUpdate) -> str | None:
        """Fold one client's update into the round; returns a rejection reason, or None."""
        reason = reject_reason(update, self.params)
        entry = {
            "n_examples": update.n_examples, "steps": update.steps, "losses": update.losses,
            "delta_loss": _json_number(update.delta_loss), "mean_loss": _json_number(update.mean_loss),
            "terms": {k[5:]: _json_number(v) for k, v in update.stats.items() if k.startswith("loss/")},
            "bytes_up": nbytes(update.tensors), "bytes_down": self._sent.get(client, 0),
            "seconds": update.seconds, "weight": None,
        }
        if reason:
            entry["rejected"] = reason
        else:
            # updates may arrive on another device (a GPU silo, a CPU server, Flower's CPU arrays)
            delta = {k: t.to(self.params[k].device, self.params[k].dtype) - self.params[k]
                     for k, t in update.tensors.items()}
            value = update.stats.get(self.stat, math.nan) if self.stat else math.nan
            self._agg.add(client, delta, update.n_examples, value)
            self.uploaded[client] = list(update.tensors)
        self._record[client] = entry
        return reason

    def end_round(self) -> dict:
        """Aggregate and step the server optimiser; returns the round's record."""
        delta, weights = self._agg.finish()
        for client, w in zip(self._agg.clients, weights.values):
            self._record[client]["weight"] = w
        with torch.no_grad():
            self.optimizer.step(self.params, delta)
        record = {"weighting": self.weighting, "fallback": weights.fallback, "clients": self._record,
                  "bytes_up": sum(c["bytes_up"] for c in self._record.values()),
                  "bytes_down": sum(self._sent.values()),
                  "sent": dict(self._sent)}
        self._agg = None
        return record

    def state_dict(self) -> dict:
        return {"params": self.params, "optimizer": self.optimizer.state_dict(),
                "uploaded": {c: ",".join(n) for c, n in self.uploaded.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.params = {k: v.clone() for k, v in state["params"].items()}
        self.optimizer.load_state_dict(state["optimizer"])
        self.uploaded = {c: (s.split(",") if s else []) for c, s in state.get("uploaded", {}).items()}
