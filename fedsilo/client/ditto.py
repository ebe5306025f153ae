"""Ditto (Li et al. 2021): after its federated update, each client trains a personal model v of its
own on the same examples with λ/2·‖v − w_global‖² added, from its last v (the received global model
in its first round); evaluation uses v. Registered as the after-training pass "ditto", configured by
`client.personal` (PersonalConfig).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from fedsilo.core.tensors import Tensors

from .hooks import AFTER_TRAINING, AfterContext
from .objective import Term, personal
from .schedule import round_steps
from .settings import PersonalConfig
from .silo import federated_parameters, load_tensors
from .train import train_local


class Ditto:
    slot = "personal"

    def steps(self, n_examples: int, client_cfg: Any, options: PersonalConfig) -> int:
        return round_steps(n_examples, client_cfg.batch_size, client_cfg.grad_accum, options.epochs)

    def __call__(self, ctx: AfterContext, options: PersonalConfig) -> tuple[Tensors, dict[str, float]]:
        client, cfg = ctx.client, ctx.client.cfg
        load_tensors(client.model, ctx.received, ctx.kept)
        items, collate, lengths = client.batches_from(ctx.examples)
        result, _ = train_local(
            client.model, items, collate, client.loss_fn, lengths=lengths,
            length_window=cfg.length_window, precision=client.precision, epochs=options.epochs,
            lr=options.lr or cfg.lr, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
            weight_decay=cfg.weight_decay, logging_steps=cfg.logging_steps,
            parts=replace(client.recipe.trainer.parts, regularizers=(Term("personal", personal, options.coef),)),
            anchor={k: ctx.received[k] for k in ctx.received if k in client.shared_names},
            tracked_terms=cfg.tracked_terms, seed=ctx.seed + 1, max_grad_norm=cfg.max_grad_norm or None,
            on_step=ctx.on_step, warmup=cfg.warmup)  # its schedule restarts every round
        return {k: t.detach().clone() for k, t in federated_parameters(client.model).items()}, result.terms


AFTER_TRAINING.add("ditto", Ditto(), PersonalConfig)
