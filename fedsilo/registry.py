"""One registry style for every policy axis and plug-in point.

A registry maps a name (what a config writes) to an implementation. Config fields read their
choices from the registry at validation time, so a user's own policy registered before the run is a
valid choice with no edit elsewhere. An entry may carry a pydantic settings class, validated
strictly from the config section that names it (a task's section, a surgery's options).

A config's choice is resolved once (`Registry.resolve`) into a `Policy`: the entry's implementation
with its validated options. The engine holds policies, never a name to look up again.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from fedsilo.errors import UnknownChoice
from fedsilo.settings import SectionError, where_what

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    value: T
    settings: type | None = None  # pydantic model for this entry's own config keys, if any


@dataclass(frozen=True)
class Policy(Generic[T]):
    """A config's choice on one axis, resolved: its name (for records), implementation and options."""
    name: str
    value: T
    options: Any = None  # the entry's validated settings (None: it takes none)


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

    def resolve(self, name: str, options: dict | None = None, where: str = "options") -> Policy[T]:
        """`name`'s entry with its options validated by the entry's settings class: the one place any
        policy's options are checked. An error names `where.<key>` (SectionError, a ValueError)."""
        entry = self.entry(name)
        if entry.settings is None:
            if options:
                raise SectionError(f"{where}: the {self.axis} {name!r} takes no options")
            return Policy(name, entry.value)
        if isinstance(options, entry.settings):
            return Policy(name, entry.value, options)
        try:
            return Policy(name, entry.value, entry.settings.model_validate(options or {}))
        except ValidationError as err:
            raise SectionError(where_what(err, prefix=where)) from None

    def resolve_chain(self, items: Any, where: str) -> tuple[Policy[T], ...]:
        """An ordered list of `{name = "...", <its options>}` tables, each resolved (an error names
        `where[i]`)."""
        if not isinstance(items, (list, tuple)):
            raise SectionError(f"{where}: expected a list of tables, e.g. [{{name = \"{next(iter(self), 'x')}\"}}]")
        out = []
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise SectionError(f"{at}: expected a table with a name, e.g. {{name = \"{next(iter(self), 'x')}\"}}")
            if item["name"] not in self:
                raise SectionError(f"{at}.name: {item['name']!r} is not a known {self.axis}; choose from "
                                   f"{', '.join(map(repr, self))}")
            out.append(self.resolve(item["name"], {k: v for k, v in item.items() if k != "name"}, at))
        return tuple(out)

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
