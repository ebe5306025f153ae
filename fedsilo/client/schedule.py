"""Client learning-rate schedules (a registry): Hugging Face's warm-up schedules, per optimiser step.

A schedule scales each optimiser group's own rate (so `private_lr` stays proportional to `lr`) by a
pure function of (position, total steps). The position is a global optimiser step the caller knows
(the client's steps in earlier rounds plus the step within this round), so a resumed run rebuilds the
scheduler where it stopped: nothing of it is saved. One schedule step is one optimiser step (a
gradient-accumulated step counts once), as in the Trainer.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch.optim.lr_scheduler import LRScheduler

from fedsilo.registry import Registry

# (optimizer, warm-up steps, total steps, last_epoch) → a scheduler, or None to leave the rates alone
ScheduleFactory = Callable[[torch.optim.Optimizer, int, int, int], LRScheduler | None]
LR_SCHEDULES: Registry[ScheduleFactory] = Registry("learning-rate schedule")

Span = Literal["run", "round", "server_rounds"]


@LR_SCHEDULES.register("constant")
def constant(optimizer, num_warmup_steps: int, num_training_steps: int, last_epoch: int) -> None:
    """No scheduler at all: training and the saved optimiser state stay what they were without one."""
    return None


@LR_SCHEDULES.register("linear")
def linear(optimizer, num_warmup_steps: int, num_training_steps: int, last_epoch: int) -> LRScheduler:
    """0 → lr over the warm-up, then linearly to 0 at the end (FedMatch: 10% warm-up)."""
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch)


@LR_SCHEDULES.register("cosine")
def cosine(optimizer, num_warmup_steps: int, num_training_steps: int, last_epoch: int) -> LRScheduler:
    """0 → lr over the warm-up, then a half cosine to 0 at the end."""
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=last_epoch)


def round_steps(n_items: int, batch_size: int, grad_accum: int, epochs: int, max_steps: int | None = None) -> int:
    """The optimiser steps one `train_local` call takes (its loop's rule: `max_steps`, else an epoch's
    batches // grad_accum, at least one step per epoch)."""
    if max_steps:
        return max_steps
    batches = -(-n_items // batch_size)
    return epochs * (max(1, batches // grad_accum) if batches else 0)


def span_of(span: Span, steps_done: int, rounds: int, per_round: int, round_idx: int = 1) -> tuple[int, int]:
    """(position of this round's first step, total steps) of a client's schedule.

    `run`: one schedule over all of the client's rounds (rounds × this round's steps), at the
    client's own steps done so far. A client not sampled every round moves along it only when it
    trains, so it may end the run short of the schedule's end (the position is its own progress, not
    the round number: it never skips warm-up or decay); steps past the end keep the last step's rate.
    `round`: the schedule restarts each round over that round's steps.
    `server_rounds`: one schedule over the run's rounds, at the server's round `round_idx` (1-based),
    whatever the client did before: FlowerTune's cosine annealing over rounds, where a client
    sampled in round r trains at round r's rate (there constant within a round, here continuing
    over the round's steps).
    """
    if span == "server_rounds":
        return ((round_idx - 1) * per_round, rounds * per_round)
    return (steps_done, rounds * per_round) if span == "run" else (0, per_round)


class StepSchedule:
    """`factory`'s scheduler over `total` optimiser steps, set for step `start`; `step()` after each
    optimiser step. A step past the last planned one keeps that step's rate (neither a cosine rising
    again nor steps at rate 0)."""

    def __init__(self, factory: ScheduleFactory, optimizer: torch.optim.Optimizer, warmup: float, start: int,
                 total: int) -> None:
        self.last = max(total, 1) - 1
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]  # each group's own rate, as configured, is its base
        warmup_steps = math.ceil(total * warmup)  # as the Trainer's `warmup_ratio`
        self.scheduler = factory(optimizer, warmup_steps, total, min(start, self.last) - 1)
        if self.scheduler is None:  # constant: leave the optimiser exactly as it was
            for group in optimizer.param_groups:
                del group["initial_lr"]

    def step(self) -> None:
        if self.scheduler is not None and self.scheduler.last_epoch < self.last:
            self.scheduler.step()
