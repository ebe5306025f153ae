"""Local training on one client: the loop, the objective's named terms, and loss logging for ΔL.

Loss logging follows the Lorar authors' Hugging Face Trainer (transformers 4.10,
`logging_strategy="steps"`, `logging_first_step=True`): the loss of the first optimiser step alone,
then at every global step that is a multiple of `logging_steps` the mean loss of the optimiser steps
since the last log — windows run across epoch boundaries, there is no epoch-end flush, a trailing
partial window is dropped, values are rounded to 4 decimals. Gradient accumulation is the Trainer's
too: an optimiser step every `grad_accum` batches (or at an epoch's last batch when the whole epoch
is shorter than that); each batch's loss is divided by `grad_accum`, and leftover batches at an
epoch's end carry their gradients (and loss) into the next epoch's first step.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.core.weighting import delta_loss

from fedsilo.models.precision import autocast, grad_scaler

from .batching import BatchOrder, default_window, length_grouped, shuffled
from .objective import Term, objective_terms
from .optim import OptimizerFactory, adafactor
from .schedule import ScheduleFactory, StepSchedule, constant, round_steps


@dataclass(frozen=True)
class TrainingParts:
    """A client's training choices as objects, resolved once by the build (fedsilo.recipe.training_parts):
    the optimiser, the lr schedule, the batch order and the regularisers."""
    optimizer: OptimizerFactory = adafactor
    schedule: ScheduleFactory = constant
    batch_order: BatchOrder = length_grouped
    regularizers: tuple[Term, ...] = ()

    @property
    def varies_lr(self) -> bool:
        """Whether the rate changes from step to step (a round then reports its last rate)."""
        return self.schedule is not constant


class LossLog:
    """The Trainer's logged losses for one round: (step, value) pairs, `step` offset for plots."""

    def __init__(self, every: int, step_offset: int = 0) -> None:
        self.every = max(1, every)
        self.offset = step_offset
        self.step = 0
        self.points: list[tuple[int, float]] = []
        self._since: list[float] = []

    def record(self, loss: float | torch.Tensor) -> None:
        """The loss of one optimiser step (the sum of its batches' scaled losses). A tensor is read
        (a device sync) only at the steps that are logged."""
        self.step += 1
        self._since.append(loss)
        if self.step == 1 or self.step % self.every == 0:
            mean = float(sum(self._since)) / len(self._since)
            self.points.append((self.offset + self.step, round(mean, 4)))
            self._since = []


@dataclass
class LocalResult:
    n_examples: int
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    delta_loss: float = math.nan
    mean_loss: float = math.nan
    terms: dict[str, float] = field(default_factory=dict)  # mean of each objective term per batch
    seconds: float = 0.0
    lr: float = math.nan  # the first group's rate at the last optimiser step


def to_device(batch: Mapping, device: torch.device) -> dict:
    """The batch's tensors on `device`. To a GPU from pinned memory without blocking: a pageable
    copy would wait for the GPU to drain, so padding the next batch could not overlap the last step."""
    if device.type != "cuda":
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def param_groups(params: Mapping[str, torch.nn.Parameter], lr: float,
                 lr_overrides: Mapping[str, float]) -> list[dict]:
    """The trainable parameters in one optimiser group per learning rate, `lr`'s first, each in
    the model's order (so a saved optimiser state maps back onto the same tensors)."""
    groups: dict[float, list[torch.nn.Parameter]] = {lr: []}
    for name, p in params.items():
        if p.requires_grad:
            groups.setdefault(lr_overrides.get(name, lr), []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in groups.items() if ps]


def train_local(
    model: torch.nn.Module,
    examples: Sequence,
    collate: Callable[[Sequence], dict],
    loss_fn: Callable[[torch.nn.Module, dict], Mapping[str, torch.Tensor]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    lr_overrides: Mapping[str, float] | None = None,
    grad_accum: int = 1,
    parts: TrainingParts = TrainingParts(),
    weight_decay: float = 0.0,
    logging_steps: int = 4,
    anchor: Tensors | None = None,
    tracked_terms: Sequence[str] | None = None,
    seed: int = 0,
    step_offset: int = 0,
    max_grad_norm: float | None = 1.0,
    optimizer_state: Callable[[torch.optim.Optimizer], None] | None = None,
    on_step: Callable[[], None] | None = None,
    max_steps: int | None = None,
    lengths: Sequence[int] | None = None,
    length_window: int | None = None,
    precision: str = "fp32",
    warmup: float = 0.0,
    schedule_start: int = 0,
    schedule_total: int | None = None,
) -> tuple[LocalResult, torch.optim.Optimizer]:
    """Train `model` in place on `examples`; returns the result and the optimiser (for its state).

    `lr_overrides` gives some parameters (by name) their own learning rate.
    `loss_fn(model, batch)` gives the task's named loss terms; registered regularisers anchored to
    `anchor` (the received global tensors) are added. Training minimises the sum of all terms; the
    logged loss (ΔL, mean loss) is the sum of `tracked_terms` (default: all). Randomness (data order,
    dropout) comes from `seed` alone and leaves torch's global generator as it was.
    `parts.batch_order` (fedsilo.client.batching) orders the examples by their token `lengths`
    (without lengths, a plain shuffle). `precision` bf16/fp16 runs the forward pass under autocast
    (fp16 with a gradient scaler); weights and optimiser state stay fp32.
    `parts.schedule` (fedsilo.client.schedule, `warmup` a fraction of its steps) scales every
    group's rate per optimiser step, from step `schedule_start` of `schedule_total` (default: a
    schedule over this call's own steps).
    """
    start = time.perf_counter()
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    trainable = [p for p in params.values() if p.requires_grad]
    opt = parts.optimizer(param_groups(params, lr, lr_overrides or {}), lr, weight_decay)
    if optimizer_state is not None:
        optimizer_state(opt)
    total = schedule_total or round_steps(len(examples), batch_size, grad_accum, epochs, max_steps)
    schedule = StepSchedule(parts.schedule, opt, warmup, schedule_start, total)
    last_lr = math.nan
    anchor = anchor or {}
    log = LossLog(logging_steps, step_offset)
    order_rng = torch.Generator().manual_seed(seed)
    epoch_order = parts.batch_order
    if lengths is None:
        lengths, epoch_order = [0] * len(examples), shuffled
    window = length_window or default_window(len(examples), batch_size)
    scaler = grad_scaler(precision, device)
    term_sums: dict[str, torch.Tensor] = {}
    batches = 0
    tracked_sum = torch.zeros((), device=device)     # unscaled, for the mean loss
    step_loss = torch.zeros((), device=device)       # scaled, of the optimiser step being accumulated
    steps = 0
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with fork if fork is not None else nullcontext():
        torch.manual_seed(seed)  # dropout; restored on exit by fork_rng
        model.train()
        opt.zero_grad(set_to_none=True)
        epoch = 0
        while (steps < max_steps) if max_steps else (epoch < epochs):
            epoch += 1
            order = epoch_order(lengths, batch_size, order_rng, window)
            starts = range(0, len(order), batch_size)
            per_epoch = len(starts)
            for i, s in enumerate(starts):
                batch = to_device(collate([examples[j] for j in order[s:s + batch_size]]), device)
                with autocast(precision, device):
                    terms = objective_terms(loss_fn(model, batch), params, anchor, parts.regularizers)
                    total = sum(terms.values())
                    tracked = total if tracked_terms is None else sum(
                        (terms[t] for t in tracked_terms if t in terms), torch.zeros((), device=device))
                scaled = total / grad_accum if grad_accum > 1 else total
                (scaler.scale(scaled) if scaler else scaled).backward()
                with torch.no_grad():
                    for name, t in terms.items():
                        t = t.detach()
                        term_sums[name] = term_sums[name] + t if name in term_sums else t.clone()
                    tracked_sum += tracked.detach()
                    step_loss += tracked.detach() / grad_accum
                batches += 1
                if (i + 1) % grad_accum == 0 or (per_epoch <= grad_accum and i + 1 == per_epoch):
                    if scaler:
                        scaler.unscale_(opt)
                    if max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
                    last_lr = opt.param_groups[0]["lr"]
                    if scaler:
                        scaler.step(opt)  # skipped when the scaled gradients overflowed
                        scaler.update()
                    else:
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                    schedule.step()
                    steps += 1
                    log.record(step_loss)
                    step_loss = torch.zeros((), device=device)
                    if on_step:
                        on_step()
                    if max_steps and steps >= max_steps:
                        break
        model.eval()
    terms_mean = {k: float(v) / batches for k, v in term_sums.items()} if batches else {}
    result = LocalResult(
        n_examples=len(examples), steps=steps, losses=log.points,
        delta_loss=delta_loss([v for _, v in log.points]),
        mean_loss=float(tracked_sum) / batches if batches else math.nan,
        terms=terms_mean, seconds=time.perf_counter() - start, lr=last_lr,
    )
    return result, opt
