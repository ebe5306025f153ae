"""The client objective: the task's named loss terms plus registered regularisers.

A regulariser is a term on the parameters alone, anchored to the tensors the client received this
round (the global model): FedProx μ/2‖w − w_t‖², or the personal-model term λ/2‖v − w_global‖² of
Ditto / FewFedWeight (the same formula on a model the client keeps). Every term is logged by name.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.registry import Registry

Regularizer = Callable[[Mapping[str, torch.Tensor], Tensors, float], torch.Tensor]
REGULARIZERS: Registry[Regularizer] = Registry("regularizer")

LossFn = Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
CLIENT_OBJECTIVES: Registry[Callable[[Any, Any], LossFn]] = Registry("client objective")
"""name → (task, client config) → the loss function of local training (named terms per batch)."""
TASK_LOSS = CLIENT_OBJECTIVES.add("task", lambda task, cfg: task.loss)  # the task's own loss, example by example


def squared_distance(params: Mapping[str, torch.Tensor], anchor: Tensors) -> torch.Tensor:
    """‖w − anchor‖² over the tensors that have an anchor."""
    total = None
    for name, a in anchor.items():
        term = (params[name] - a).pow(2).sum()
        total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


@REGULARIZERS.register("prox")
def prox(params, anchor: Tensors, coef: float) -> torch.Tensor:
    """FedProx (Li et al. 2020): μ/2·‖w − w_t‖²."""
    return 0.5 * coef * squared_distance(params, anchor)


@REGULARIZERS.register("personal")
def personal(params, anchor: Tensors, coef: float) -> torch.Tensor:
    """Ditto / FewFedWeight PFL: λ/2·‖v − w_global‖² on the client's own model v."""
    return 0.5 * coef * squared_distance(params, anchor)


@dataclass(frozen=True)
class Term:
    """A regulariser as a run holds it: its name (its loss term's), function and coefficient."""
    name: str
    fn: Callable[..., torch.Tensor]
    coef: float


def objective_terms(task_terms: Mapping[str, torch.Tensor], params, anchor: Tensors,
                    regularizers: Sequence[Term]) -> dict[str, torch.Tensor]:
    """All named terms of one step: the task's, then each regulariser with a positive coefficient."""
    terms = dict(task_terms)
    for term in regularizers:
        if term.coef > 0:
            if term.name in terms:
                raise ValueError(f"regularizer {term.name!r} has the name of a task loss term")
            terms[term.name] = term.fn(params, anchor, term.coef)
    return terms
