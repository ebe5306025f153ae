"""Local training on one client: the loop, the objective terms, and loss logging for ΔL."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.core.weighting import delta_loss

OPTIMIZERS = ("adafactor", "adamw", "sgd")


def make_optimizer(name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adafactor as in the Lorar paper (fixed lr, no relative step), AdamW or plain SGD."""
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown client optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def prox_term(params: Tensors, anchor: Tensors, mu: float) -> torch.Tensor:
    """FedProx: μ/2·‖w − w_t‖² over the tensors that have an anchor (the shared ones)."""
    total = sum(((params[k] - anchor[k]) ** 2).sum() for k in anchor)
    return 0.5 * mu * total


class LossLog:
    """Logs the first step, the mean of every window of `every` steps, and each epoch's end."""

    def __init__(self, every: int, step_offset: int = 0) -> None:
        self.every = max(1, every)
        self.step = step_offset
        self.points: list[tuple[int, float]] = []
        self._window: list[float] = []
        self._first = True

    def record(self, loss: float) -> None:
        self.step += 1
        self._window.append(loss)
        if self._first:
            self.points.append((self.step, loss))
            self._first = False
        if len(self._window) >= self.every:
            self._flush()

    def end_epoch(self) -> None:
        if self._window:
            self._flush()

    def _flush(self) -> None:
        self.points.append((self.step, sum(self._window) / len(self._window)))
        self._window = []


@dataclass
class LocalResult:
    n_examples: int
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    delta_loss: float = math.nan
    mean_loss: float = math.nan
    seconds: float = 0.0


def train_local(
    model: torch.nn.Module,
    examples: Sequence,
    collate: Callable[[Sequence], dict],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: str = "adafactor",
    weight_decay: float = 0.0,
    logging_steps: int = 4,
    prox_mu: float = 0.0,
    anchor: Tensors | None = None,
    seed: int = 0,
    step_offset: int = 0,
    max_grad_norm: float | None = 1.0,
    on_step: Callable[[], None] | None = None,
) -> LocalResult:
    """Train `model` in place on `examples`; log losses (incl. the prox term) for ΔL."""
    start = time.perf_counter()
    torch.manual_seed(seed)  # dropout: same seed → same local run, also after a resume
    order_rng = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    trainable = [p for p in params.values() if p.requires_grad]
    opt = make_optimizer(optimizer, trainable, lr, weight_decay)
    log = LossLog(logging_steps, step_offset)
    model.train()
    total, count = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(examples), generator=order_rng).tolist()
        for i in range(0, len(order), batch_size):
            batch = {k: v.to(device) for k, v in collate([examples[j] for j in order[i:i + batch_size]]).items()}
            loss = model(**batch).loss
            if prox_mu > 0 and anchor is not None:
                loss = loss + prox_term(params, anchor, prox_mu)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            opt.step()
            value = float(loss.detach())
            log.record(value)
            total, count = total + value, count + 1
            if on_step:
                on_step()
        log.end_epoch()
    model.eval()
    return LocalResult(
        n_examples=len(examples), steps=count, losses=log.points,
        delta_loss=delta_loss([v for _, v in log.points]),
        mean_loss=total / count if count else math.nan,
        seconds=time.perf_counter() - start,
    )
