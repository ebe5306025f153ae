"""Client optimisers (a registry): Adafactor as in the Lorar paper, AdamW, plain SGD."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fedsilo.registry import Registry

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter], float, float], torch.optim.Optimizer]
CLIENT_OPTIMIZERS: Registry[OptimizerFactory] = Registry("client optimizer")


@CLIENT_OPTIMIZERS.register("adafactor")
def adafactor(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Fixed learning rate, no relative step (the Lorar authors' setting)."""
    from transformers.optimization import Adafactor
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False,
                     weight_decay=weight_decay)


@CLIENT_OPTIMIZERS.register("adamw")
def adamw(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@CLIENT_OPTIMIZERS.register("sgd")
def sgd(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)

