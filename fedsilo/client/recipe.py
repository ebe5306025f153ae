"""One silo's resolved parts: everything its round runs, built once (fedsilo.recipe.build_recipe).

A silo's round is a fixed pipeline (SiloClient.fit): check → receive → before-training hook → train →
select the upload → after-training pass → release → encode → mask. The recipe fills each position with
an object: the trainer (plain or DP-SGD), the optional release (silo-level DP) and mask (secure
aggregation) stages, the codec chain of the exchange plan. A new mechanism at one position is one new
object there, not a branch in the loop.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import SiloCheck
from fedsilo.registry import Policy

from .settings import ClientConfig


class Release(Protocol):
    """What leaves the silo is released here first (silo-level DP: clipped, noised): `values` are the
    upload's tensors, `received` what the round started from; returns the released values."""
    def __call__(self, values: Tensors, received: Tensors, run_seed: int) -> Tensors: ...

    def accounted(self) -> list[dict]:
        """Each DP mechanism of a release, as the silo's privacy ledger records it ([]: none)."""


class Mask(Protocol):
    """The last stage (secure aggregation): the update as the server may see it. `layout_for(model,
    shared)` prepares what the mask needs from the model once."""
    def __call__(self, update: ClientUpdate, received: Tensors) -> ClientUpdate: ...


@dataclass(frozen=True)
class ClientRecipe:
    """Everything one silo's round needs, resolved from the run's config."""
    index: int                                   # the silo's place among the run's members (its seeds)
    settings: ClientConfig
    plan: ExchangePlan
    objective: Callable[[Any, ClientConfig], Callable]  # (task, settings) -> the loss function
    trainer: Any                                 # fedsilo.client.trainers: plain or DP-SGD
    checks: tuple[Policy[SiloCheck], ...] = ()
    hook: Policy | None = None                   # before training (FewFedWeight's pseudo labels)
    pseudo_source: Policy | None = None
    after: Policy | None = None                  # after training (Ditto's personal model)
    release: Release | None = None               # silo-level DP
    mask: Callable[[Any, list[str]], Mask] | None = None  # (model, shared names) -> the mask (secure aggregation)
    rounds: int = 1                              # federation.rounds: a `run`-span schedule's length
    persist_optimizer: bool = False
    token_cache: Path | None = None
    precision: str = "fp32"
    lora_rank: int | None = None                 # heterogeneous LoRA: this silo's adapters held at this rank
