"""Round hooks: client-side work between receiving the global tensors and local training.

FewFedWeight labels the client's own inputs with the global model before it trains its personal
model; a hook gets a `HookContext` and returns the examples to train on this round.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.registry import Registry


@dataclass
class HookContext:
    client: str
    round: int
    seed: int
    model: torch.nn.Module            # the working model, holding what the client will train from
    examples: Sequence[Any]           # the client's annotated training examples
    received: Tensors                 # the tensors received this round (the global model's)
    own: Tensors                      # the client's kept tensors from its previous round (may be empty)
    pseudo_source: str                # "global" or "own": which model `labeler()` loads
    task: Any = None
    options: Any = None               # the hook's settings (`client.hook_options`, validated)

    def labeler(self) -> torch.nn.Module:
        """The working model loaded with the model chosen by `client.pseudo_source`, in eval mode.

        The caller trains afterwards from whatever it loads next, so this may overwrite the model."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            sources = (self.received,) if self.pseudo_source == "global" else (self.received, self.own)
            for tensors in sources:
                for name, t in tensors.items():
                    params[name].copy_(t)
        self.model.eval()
        return self.model


RoundHook = Callable[[HookContext], Sequence[Any]]
ROUND_HOOKS: Registry[RoundHook] = Registry("round hook")
"""An entry may carry a pydantic settings class for `client.hook_options`; a hook function with a
`task_protocol` attribute (a runtime-checkable Protocol) runs only on tasks that implement it."""
