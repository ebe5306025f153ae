"""Client-side work around a round's federated training, one registry per point.

Before training (`ROUND_HOOKS`): FewFedWeight labels the client's own inputs with the global model
before it trains; a hook gets a `HookContext` and returns the examples to train on this round.
After training (`AFTER_TRAINING`): Ditto trains a personal model of the client's own once its
federated update is built; a pass gets an `AfterContext`, returns the tensors it keeps in its store
slot, and evaluation uses them once there are some.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.registry import Policy, Registry

# which tensors the model a hook labels with is made of, later sets winning: (received, own) -> sets
PseudoSource = Callable[[Tensors, Tensors], tuple[Tensors, ...]]
PSEUDO_SOURCES: Registry[PseudoSource] = Registry("pseudo-label source")
PSEUDO_SOURCES.add("global", lambda received, own: (received,))          # the received global model
PSEUDO_SOURCES.add("own", lambda received, own: (received, own))        # its own model (Data Silo DA)


@dataclass
class HookContext:
    client: str
    round: int
    seed: int
    model: torch.nn.Module            # the working model, holding what the client will train from
    examples: Sequence[Any]           # the client's annotated training examples
    received: Tensors                 # the tensors received this round (the global model's)
    own: Tensors                      # the client's kept tensors from its previous round (may be empty)
    pseudo_source: Policy[PseudoSource]  # `client.pseudo_source`, resolved: which model `labeler()` loads
    task: Any = None
    options: Any = None               # the hook's settings (`client.hook_options`, validated)

    def labeler(self) -> torch.nn.Module:
        """The working model loaded with the model chosen by `client.pseudo_source`, in eval mode.

        The caller trains afterwards from whatever it loads next, so this may overwrite the model."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for tensors in self.pseudo_source.value(self.received, self.own):
                for name, t in tensors.items():
                    params[name].copy_(t)
        self.model.eval()
        return self.model


@dataclass(frozen=True)
class RoundHook:
    """`run(ctx)` returns the examples to train on this round. `needs`: a runtime-checkable Protocol
    the task must implement, or None; the clients are refused at build time (before round 1) when
    the task does not."""
    run: Callable[[HookContext], Sequence[Any]]
    needs: type | None = None


ROUND_HOOKS: Registry[RoundHook] = Registry("round hook")
"""An entry may carry a pydantic settings class for `client.hook_options`."""


def round_hook(name: str, settings: type | None = None, needs: type | None = None) -> Callable:
    """Decorator: register a hook function as round hook `name`."""
    def wrap(run: Callable[[HookContext], Sequence[Any]]) -> Callable[[HookContext], Sequence[Any]]:
        ROUND_HOOKS.add(name, RoundHook(run, needs), settings)
        return run
    return wrap


@dataclass
class AfterContext:
    client: Any                       # the SiloClient: model, cfg, loss_fn, precision, batches_from()
    received: Tensors                 # the tensors received this round (the global model's)
    kept: Tensors                     # what this pass kept in its slot last round (empty at first)
    examples: Sequence[Any]           # the examples the round trained on (pseudo labels included)
    seed: int                         # the client's seed for this round
    on_step: Callable[[], None] | None = None


class AfterTraining(Protocol):
    """An after-training pass: `slot` names the store slot it keeps (evaluation loads it when
    filled); `steps` its optimiser steps per round (for progress); calling it runs the pass and
    returns (tensors to keep, its mean loss terms)."""
    slot: str

    def steps(self, n_examples: int, client_cfg: Any, options: Any) -> int: ...

    def __call__(self, ctx: AfterContext, options: Any) -> tuple[Tensors, dict[str, float]]: ...


AFTER_TRAINING: Registry[AfterTraining] = Registry("after-training pass")
