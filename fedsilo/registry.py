"""One registry style for every policy axis and plug-in point.

A registry maps a name (what a config writes) to an implementation. Config fields read their
choices from the registry at validation time, so a user's own policy registered before the run is a
valid choice with no edit elsewhere. An entry may carry a pydantic settings class, validated
strictly from the config section that names it (a task's section, a surgery's options).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownChoice(ValueError):
    """A name that no entry of a registry has; the message lists the choices."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    value: T
    settings: type | None = None  # pydantic model for this entry's own config keys, if any


class Registry(Generic[T]):
    def __init__(self, axis: str) -> None:
        self.axis = axis  # e.g. "weighting policy", used in messages
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, settings: type | None = None) -> Callable[[T], T]:
        """Decorator: make `value` available to configs as `name`."""
        def wrap(value: T) -> T:
            self._entries[name] = Entry(name, value, settings)
            return value
        return wrap

    def add(self, name: str, value: T, settings: type | None = None) -> T:
        return self.register(name, settings)(value)

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownChoice(f"{name!r} is not a known {self.axis}; choose from {', '.join(map(repr, self))}") from None

    def get(self, name: str) -> T:
        return self.entry(name).value

    def check(self, name: Any) -> str:
        """Pydantic validator: the name if registered, else a message listing the choices."""
        if not isinstance(name, str):
            raise UnknownChoice(f"{name!r} is not a {self.axis} name")
        self.entry(name)
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)
