"""What travels between a silo and the server each round, as typed fields (no model, no transport):
the client imports it to answer, the server to read, the engines to carry it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .tensors import Tensors

STATISTICS = ("delta_loss", "mean_loss", "loss/<term>")
"""The names a weighting policy may read (`federation.weighting_stat`)."""


@dataclass
class ClientUpdate:
    """A client's answer after local training: the uploaded tensors' values and its numbers."""
    tensors: Tensors
    n_examples: int                 # its own data (FedAvg's n_k), not counting pseudo-labelled extras
    steps: int = 0                  # optimiser steps taken
    losses: list[tuple[int, float]] = field(default_factory=list)  # the logged (step, loss) points
    seconds: float = 0.0            # the whole round on the client
    delta_loss: float = math.nan    # ΔL = max − min of the logged losses (Lorar)
    mean_loss: float = math.nan     # the mean tracked loss over its batches (FewFedWeight's weights)
    terms: dict[str, float] = field(default_factory=dict)           # mean of each objective term per batch
    personal_terms: dict[str, float] = field(default_factory=dict)  # Ditto: the personal model's terms
    phase_seconds: dict[str, float] = field(default_factory=dict)   # before_training, training, personal
    lr_last: float | None = None    # an lr schedule's rate at the last optimiser step (None: constant rate)
    transforms: list[dict] = field(default_factory=list)  # what each upload transform did ({"name": …, …})
    privacy: dict[str, float] = field(default_factory=dict)  # DP-SGD: the silo's ε so far, δ, σ, q, steps
    secure_input: object = None  # secure aggregation: its weighted vector (fedsilo.core.masking), masked before
                                 # it leaves; `tensors` and every loss statistic are then empty

    def statistic(self, name: str) -> float:
        """The number a weighting policy reads: delta_loss, mean_loss or loss/<term> (NaN when absent)."""
        if name == "delta_loss":
            return self.delta_loss
        if name == "mean_loss":
            return self.mean_loss
        if name.startswith("loss/"):
            return self.terms.get(name[len("loss/"):], math.nan)
        raise ValueError(f"unknown client statistic {name!r}; choose from {', '.join(STATISTICS)}")


def is_statistic(name: str) -> bool:
    """Whether `name` is a statistic a client reports (for validating `federation.weighting_stat`)."""
    return name in ("delta_loss", "mean_loss") or (name.startswith("loss/") and len(name) > len("loss/"))
