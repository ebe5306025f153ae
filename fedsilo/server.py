"""The federation server: global shared tensors, client sampling, aggregation, server optimiser.

Transport-free: engines (in-process, Flower) hand it client updates and ask it what to send.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from fedsilo.core.aggregate import RoundAggregator
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import Tensors, clone, is_finite, nbytes


@dataclass
class ClientUpdate:
    """What a client returns after local training: tensors (Δ for the uploaded names) + numbers."""
    tensors: Tensors
    n_examples: int
    delta_loss: float
    mean_loss: float
    steps: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0


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
    if update.n_examples <= 0:
        return "no training examples"
    return None


class Server:
    def __init__(self, global_tensors: Tensors, optimizer: ServerOptimizer, weighting: str) -> None:
        self.params = clone(global_tensors)
        self.optimizer = optimizer
        self.weighting = weighting
        self._agg: RoundAggregator | None = None
        self._record: dict = {}

    def begin_round(self) -> None:
        self._agg = RoundAggregator(self.weighting)
        self._record = {}

    def payload(self) -> Tensors:
        """The global shared tensors every sampled client receives."""
        return self.params

    def receive(self, client: str, update: ClientUpdate) -> str | None:
        """Fold one client's update into the round; returns a rejection reason, or None."""
        reason = reject_reason(update, self.params)
        if not reason:  # updates may arrive on another device (a GPU silo, a CPU server, or Flower's CPU arrays)
            update.tensors = {k: t.to(self.params[k].device) for k, t in update.tensors.items()}
        entry = {
            "n_examples": update.n_examples, "steps": update.steps, "losses": update.losses,
            "delta_loss": None if math.isnan(update.delta_loss) else update.delta_loss,
            "mean_loss": None if math.isnan(update.mean_loss) else update.mean_loss,
            "bytes_up": nbytes(update.tensors), "bytes_down": nbytes(self.params),
            "seconds": update.seconds, "weight": None,
        }
        if reason:
            entry["rejected"] = reason
        else:
            self._agg.add(client, update.tensors, update.n_examples, update.delta_loss, update.mean_loss)
        self._record[client] = entry
        return reason

    def end_round(self) -> dict:
        """Aggregate and step the server optimiser; returns the round's per-client record."""
        delta, weights = self._agg.finish()
        for client, w in zip(self._agg.clients, weights.values):
            self._record[client]["weight"] = w
        self.optimizer.step(self.params, delta)
        record = {"weighting": self.weighting, "fallback": weights.fallback, "clients": self._record}
        self._agg = None
        return record

    def state_dict(self) -> dict:
        return {"params": self.params, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.params = {k: v.clone() for k, v in state["params"].items()}
        self.optimizer.load_state_dict(state["optimizer"])
