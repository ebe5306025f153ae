"""Secure aggregation's two stages: the silo's mask (the last position of its round) and the server's
sum (its round aggregation). fedsilo.privacy.secagg runs the protocol between them; fedsilo.core.masking
lays the vectors out. The server never holds one silo's update, so nothing here weighs, clips or screens
a single one."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from fedsilo.core.masking import Layout, mean_from_sum, weighted_vector
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.rounds import Outcome, Pending
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import decode
from fedsilo.core.weighting import WeightingPolicy


@dataclasses.dataclass(frozen=True)
class SecureMask:
    """The silo's side: its weighted update as one vector for the mask; its weight and every loss statistic
    stay inside it. A codec's wire is decoded here, on the silo, against what it received: the server
    could only undo it per silo, and it never holds one silo's update."""
    layout: Layout
    policy: WeightingPolicy
    statistic: str | None   # what the weighting reads (None: nothing)
    chain: tuple = ()       # the plan's upload transforms (a codec's decode runs here)

    @classmethod
    def factory(cls, policy: WeightingPolicy, statistic: str | None, chain: tuple = ()):
        """(model, shared names) -> the mask, once the silo's model is built."""
        def make(model: torch.nn.Module, shared: Sequence[str]) -> "SecureMask":
            return cls(Layout.of(dict(model.named_parameters()), shared, policy), policy, statistic, chain)
        return make

    def __call__(self, update: ClientUpdate, received: Tensors) -> ClientUpdate:
        value = update.statistic(self.statistic) if self.statistic else math.nan
        values = decode(self.chain, update.tensors, received)
        delta = {k: values[k].double() - received[k].double() for k in self.layout.names if k in values}
        vector = weighted_vector(delta, update.n_examples, value, self.policy, self.layout)
        # what the transforms did stays inside too: a clip's record holds the update's norm
        return dataclasses.replace(update, tensors={}, losses=[], delta_loss=math.nan, mean_loss=math.nan, terms={},
                                   personal_terms={}, transforms=[{"name": t["name"]} for t in update.transforms],
                                   secure_input=vector)


def secure_sum_round(recipe, params: Tensors) -> "SecureSumRound":
    """The server's round aggregation under secure aggregation (fedsilo.server.ServerRecipe.collect)."""
    return SecureSumRound(params)


class SecureSumRound:
    """One round under secure aggregation: the mean Δ decoded from the sum (`take_sum`), or why none."""

    def __init__(self, like: Tensors) -> None:
        self.like = like
        self._delta: Tensors | None = None
        self._protocol: dict = {"silos": [], "failed": "no sum"}

    def add(self, pending: Pending, entry: dict) -> None:
        raise RuntimeError("under secure aggregation the server takes only the silos' sum (take_sum)")

    def take_sum(self, total, layout: Layout, silos: list[str], protocol: dict) -> str | None:
        """The sum of `silos`' masked vectors; returns why it cannot be used, or None."""
        self._protocol = {"silos": sorted(silos), **protocol}
        try:
            self._delta = mean_from_sum(total, layout, self.like)
        except ValueError as err:
            self._protocol["failed"] = str(err)
            return str(err)
        return None

    def failed(self, reason: str, silos: list[str]) -> None:
        """The protocol could not form the sum (too few silos finished it)."""
        self._protocol = {"silos": sorted(silos), "failed": reason}

    def finish(self, records: dict[str, dict]) -> Outcome:
        return Outcome(self._delta, self._protocol["silos"], {"aggregation": "secure mean", "fallback": None},
                       body={"secure": self._protocol},
                       none_reason=f"secure aggregation: {self._protocol.get('failed', 'no sum')}")
