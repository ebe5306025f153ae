"""One instruction-tuning example, as every part of the instruct task reads it.

A record is the conversation before the answer (`turns`: (role, content) pairs, roles "system",
"user", "assistant") and the answer the loss covers (`response`). An Alpaca-style row
(instruction, input, output) is one user turn: the instruction, then a blank line and the input when
there is one. A plain-text record (generic pre-training on public text) has no turns: the loss covers
all of its text. `answer`, `options` and `label` are what a benchmark silo scores besides the loss:
GSM8K's gold final number, PubMedQA's options ("yes", "no", "maybe") and the gold option's index.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Record:
    turns: tuple[tuple[str, str], ...]
    response: str
    answer: str | None = None          # a final number scored by exact match after generation (GSM8K)
    options: tuple[str, ...] = ()      # multiple choice scored by log-likelihood (PubMedQA)
    label: int | None = None           # the gold option's index into `options`

    def __post_init__(self) -> None:
        for role, _ in self.turns:
            if role not in ROLES:
                raise ValueError(f"a turn's role is one of {', '.join(ROLES)}, not {role!r}")
        if self.turns and self.turns[-1][0] == "assistant":
            raise ValueError("the last turn before the response is the user's (or the system's), not the assistant's")
        if self.options and (self.label is None or not 0 <= self.label < len(self.options)):
            raise ValueError(f"label {self.label!r} is not an index into the {len(self.options)} options")

    @property
    def is_plain_text(self) -> bool:
        """Generic pre-training text: no prompt, the loss covers every token."""
        return not self.turns


def alpaca(instruction: str, input: str = "", output: str = "", system: str = "", **scores) -> Record:
    """An Alpaca-style row as one user turn: the instruction, a blank line, the input (if any)."""
    user = instruction.strip() + (f"\n\n{input.strip()}" if input and input.strip() else "")
    turns = ((("system", system),) if system else ()) + (("user", user),)
    return Record(turns, output, **scores)
