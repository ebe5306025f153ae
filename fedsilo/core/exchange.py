"""What crosses the wire: shared vs private tensors, and per-round upload selection.

Patterns are fnmatch globs over tensor names. A tensor is *shared* when it matches `shared` and no
`private` pattern; every other tensor is private: it never leaves its client and the client keeps
it across rounds. Among shared tensors, a selector may pick a per-round subset to upload.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from .tensors import Tensors

# selector(round, local tensors after training, reference tensors) -> names to upload
Selector = Callable[[int, Tensors, Tensors], Iterable[str]]

SELECTORS: dict[str, Selector] = {}


def register_selector(name: str) -> Callable[[Selector], Selector]:
    """Make a per-round upload policy available to configs as `exchange.select = name`."""
    def wrap(fn: Selector) -> Selector:
        SELECTORS[name] = fn
        return fn
    return wrap


def matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True)
class ExchangePlan:
    shared: tuple[str, ...] = ("*",)
    private: tuple[str, ...] = ()
    select: str | None = None

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(shared names, private names), in the given order."""
        shared, private = [], []
        for n in names:
            (shared if matches(n, self.shared) and not matches(n, self.private) else private).append(n)
        return shared, private

    def upload(self, round_idx: int, local: Tensors, reference: Tensors) -> list[str]:
        """Names of the shared tensors this client sends this round."""
        if self.select is None:
            return list(local)
        try:
            selector = SELECTORS[self.select]
        except KeyError:
            raise ValueError(f"unknown exchange selector {self.select!r}; known: {sorted(SELECTORS)}") from None
        chosen = set(selector(round_idx, local, reference))
        unknown = chosen - set(local)
        if unknown:
            raise ValueError(f"selector {self.select!r} chose tensors that are not shared: {sorted(unknown)}")
        return [n for n in local if n in chosen]
