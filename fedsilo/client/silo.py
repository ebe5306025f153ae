"""One silo's side of a round: receive the global tensors, train locally, build the upload.

In-process, every silo borrows the same working model; a silo owns only its data, its
hyper-parameters and its private tensors (DESIGN.md §4: no model copy per client).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedsilo.config import ClientConfig
from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.tensors import Tensors, clone
from fedsilo.server import ClientUpdate

from .train import train_local


def client_seed(seed: int, round_idx: int, silo_idx: int) -> int:
    """Distinct, reproducible randomness per (run seed, round, silo)."""
    return (seed * 1_000_003 + round_idx * 10_007 + silo_idx) % (2**63)


class SiloClient:
    def __init__(self, name: str, index: int, examples: Sequence, collate: Callable, cfg: ClientConfig,
                 model: torch.nn.Module, plan: ExchangePlan, private_init: Tensors) -> None:
        self.name, self.index = name, index
        self.examples, self.collate, self.cfg = examples, collate, cfg
        self.model, self.plan = model, plan
        self.private = clone(private_init)  # survives across rounds, never sent
        self.steps_done = 0  # cumulative optimiser steps, for the loss curve's x axis

    def load_into_model(self, shared: Tensors) -> None:
        """Working model ← global shared tensors + this silo's private tensors."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in list(shared.items()) + list(self.private.items()):
                params[name].copy_(t)

    def planned_steps(self) -> int:
        return self.cfg.epochs * -(-len(self.examples) // self.cfg.batch_size)

    def fit(self, round_idx: int, shared: Tensors, seed: int, on_step: Callable[[], None] | None = None
            ) -> ClientUpdate:
        device = next(self.model.parameters()).device
        shared = {k: v.to(device) for k, v in shared.items()}  # no copy when already there
        self.load_into_model(shared)
        result = train_local(
            self.model, self.examples, self.collate,
            epochs=self.cfg.epochs, lr=self.cfg.lr, batch_size=self.cfg.batch_size,
            optimizer=self.cfg.optimizer, weight_decay=self.cfg.weight_decay,
            logging_steps=self.cfg.logging_steps, prox_mu=self.cfg.prox_mu,
            anchor=shared if self.cfg.prox_mu > 0 else None,
            seed=client_seed(seed, round_idx, self.index), step_offset=self.steps_done,
            max_grad_norm=self.cfg.max_grad_norm or None, on_step=on_step,
        )
        self.steps_done += result.steps
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.private:
                self.private[name] = params[name].detach().clone()
            local = {k: params[k].detach() for k in shared}
            upload = self.plan.upload(round_idx, local, shared)
            delta = {k: local[k] - shared[k] for k in upload}
        return ClientUpdate(delta, result.n_examples, result.delta_loss, result.mean_loss,
                            result.steps, result.losses, result.seconds)

    def state_dict(self) -> dict:
        return {"private": self.private, "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        self.private = {k: v.clone() for k, v in state["private"].items()}
        self.steps_done = int(state["steps_done"])
