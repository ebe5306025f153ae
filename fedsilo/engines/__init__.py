"""Engines move tensors between the server and the silos: in-process (local.py) or on Flower (flower/).

The run loop (fedsilo.runs.runner) drives any object with `Engine`'s members; an engine that can
also score every model on every domain of a task's cross-domain matrix implements `CrossDomainEngine`
(the in-process engine does; on Flower the silos' data stays with them, so it does not).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fedsilo.progress import Progress
    from fedsilo.server import Server


@runtime_checkable
class Engine(Protocol):
    client_names: list[str]
    client_sizes: dict[str, int]  # training examples per silo (FedAvg's n_k)

    def train_round(self, server: Server, sampled: list[str], round_idx: int, progress: Progress | None) -> dict:
        """One round's client side: every sampled silo trains and its update reaches `server`."""

    def evaluate(self, server: Server, split: str, progress: Progress | None, final: bool = False) -> list[dict]:
        """Every silo's rows on `split`, each with the model it would use; with `final` (the run's test
        evaluation) a row also carries its test items' stats (`items`) where the task has them
        (`tasks.base.ItemStats`)."""

    def set_round(self, round_idx: int) -> None: ...

    def truncate(self, last_round: int) -> None: ...

    def after_checkpoint(self, keep: list[int]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class CrossDomainEngine(Protocol):
    def evaluate_matrix(self, server: Server, split: str, progress: Progress | None) -> dict[str, list[dict]]:
        """Every model × every domain of the task's matrix on `split` ({} when the task has none)."""
