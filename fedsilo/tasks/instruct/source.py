"""An own instruction-tuning silo: Alpaca-style rows, or chat conversations.

    [task.sources.helpdesk]             # Alpaca-style: JSONL, CSV or TSV
    path = "helpdesk.csv"
    fields = {instruction = "prompt", response = "answer"}   # input, system: optional columns
    split = {dev = 0.1, test = 0.1}     # grouped by instruction: none in two splits

    [task.sources.clinic]               # chat: JSON rows {"messages": [{"role", "content"}, ...]}
    path = "clinic.jsonl"
    chat = true                         # fields = {messages = "conversation"} if the key differs
    split = {dev = 0.1, test = 0.1}

A chat row's last message is the assistant's response (the loss covers it); the messages before it
are the prompt, roles "system", "user" and "assistant", at least one user message among them.
Malformed rows are problems named by file:line, as every reader's are; a chat row among Alpaca rows
(or the reverse) is named as one. JSON rows are JSON lines (.jsonl) or one JSON array (.json, Alpaca's
alpaca_data.json).
"""
from __future__ import annotations

import json
from typing import ClassVar

from pydantic import Field, model_validator

from fedsilo.sources.load import Loaded
from fedsilo.sources.read import Problem, Row
from fedsilo.sources.settings import Roles, SourceSettings

from .records import ROLES as TURN_ROLES
from .records import Record, alpaca

__all__ = ["ALPACA_ROLES", "CHAT_ROLES", "InstructSource", "own_records", "converted"]

ALPACA_ROLES = Roles(("instruction", "response"), optional=("input", "system"), key="instruction", aliases=(
    ("instruction", ("prompt", "question", "query", "instructions", "user", "human")),
    ("response", ("output", "answer", "completion", "target", "reply", "assistant", "gpt")),
    ("input", ("context", "inputs")),
    ("system", ("system_prompt", "system_message"))), regroup=("input",))

CHAT_ROLES = Roles(("messages",), key="messages", lists=("messages",), objects=("messages",))
"""A chat row: one list of {"role", "content"} objects, split and compared as a whole conversation."""

_ALPACA_NAMES = frozenset(n for role in ALPACA_ROLES.all for n in ALPACA_ROLES.names_for(role))


def _is_conversation(value) -> bool:
    """A chat conversation: a non-empty list of objects that each have a "role"."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


class _RolesOf:
    """`ROLES` by the source's kind: a chat source's rows hold messages, another's Alpaca roles. On
    the class (what `fedsilo init` maps columns to) it is the Alpaca roles."""

    def __get__(self, source: "InstructSource | None", owner: type) -> Roles:
        return CHAT_ROLES if source is not None and source.chat else ALPACA_ROLES


class InstructSource(SourceSettings):
    """An own instruct silo: rows of (instruction, response, optional input and system), or with
    `chat = true` JSONL rows of chat messages."""
    ROLES: ClassVar[Roles] = _RolesOf()
    ROW_KINDS: ClassVar[dict[str, str]] = {"chat": "chat = true", "Alpaca": "chat = false (the default)"}

    chat: bool = Field(False, description="rows are chat conversations: a JSON list of {role, content} messages "
                                          "(key `messages`, or fields.messages), the last one the assistant's response")

    @model_validator(mode="after")
    def _chat_is_json(self) -> "InstructSource":
        if self.chat and not self.is_benchmark and self.format_name not in ("jsonl", "json"):
            raise ValueError(f"chat = true reads JSONL rows (or a .json array of them: a list of messages each), "
                             f"not {self.format_name}")
        return self

    @property
    def kind_read(self) -> str:
        return "chat" if self.chat else "Alpaca"

    def row_kind(self, obj: dict) -> str | None:
        """chat: a value is a conversation; Alpaca: a key is an Alpaca role's name (or an alias)."""
        if any(_is_conversation(v) for v in obj.values()):
            return "chat"
        names = _ALPACA_NAMES | ({str(c) for c in self.fields.values()} if not self.chat else set())
        return "Alpaca" if any(k in names or k.lower() in names for k in obj) else None


def own_records(loaded: Loaded) -> tuple[dict[str, list[Record]], list[Problem]]:
    """An own silo's rows as records per split, and the rows that cannot be one (a malformed chat)."""
    splits, problems = converted(loaded)
    return {split: [record for _, record in pairs] for split, pairs in splits.items()}, problems


def converted(loaded: Loaded) -> tuple[dict[str, list[tuple[str, Record]]], list[Problem]]:
    """(file:line, record) per split, malformed rows left out and listed as problems."""
    problems: list[Problem] = []
    out: dict[str, list[tuple[str, Record]]] = {}
    for split, rows in loaded.splits.items():
        out[split] = []
        for row in rows:
            record = _chat(row, problems) if "messages" in row.values else _alpaca(row)
            if record is not None:
                out[split].append((row.where, record))
    return out, problems


def _alpaca(row: Row) -> Record:
    v = row.values
    return alpaca(v["instruction"], v.get("input", ""), v["response"], v.get("system", ""))


def _chat(row: Row, problems: list[Problem]) -> Record | None:
    """The conversation before the last message as turns, the last (the assistant's) as the response."""
    raw = row.values["messages"]
    if not isinstance(raw, list):
        problems.append(Problem(row.where, "the messages are one text, not a list of {role, content} objects"))
        return None
    turns = []
    for i, text in enumerate(raw, start=1):
        message = json.loads(text)  # the reader's JSON text of one object
        role, content = message.get("role"), message.get("content")
        why = (f"message {i} has no role" if role is None else
               f"message {i}: role {role!r} is not one of {', '.join(TURN_ROLES)}" if role not in TURN_ROLES else
               f"message {i} ({role}) has no content" if content is None else
               f"message {i} ({role}): content is a {type(content).__name__}; expected text"
               if not isinstance(content, str) else
               f"message {i} ({role}): empty content" if not content.strip() else None)
        if why:
            problems.append(Problem(row.where, why))
            return None
        turns.append((role, content.strip()))
    if turns[-1][0] != "assistant":
        problems.append(Problem(row.where, f"the last message is the {turns[-1][0]}'s; it must be the assistant's "
                                           "(the response the loss covers)"))
        return None
    if not any(role == "user" for role, _ in turns[:-1]):
        problems.append(Problem(row.where, "no user message before the assistant's response"))
        return None
    if turns[-2][0] == "assistant":
        problems.append(Problem(row.where, "two assistant messages end the conversation; the one before the "
                                           "response must be the user's (or the system's)"))
        return None
    return Record(tuple(turns[:-1]), turns[-1][1])
