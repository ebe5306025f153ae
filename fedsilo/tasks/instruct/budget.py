"""How much of a prompt the model reads before what it generates or scores: one rule for the task's
evaluation and `fedsilo generate` (and for batched generation after them).

Greedy generation reads at most `task.max_prompt_length` prompt tokens, a budget of its own. It used
to be `task.max_length` less the answer's `max_new_tokens`, which ties a question's room to the
length training records are cut at: with experiments/instruct/small.toml (192 − 96 = 96) it cut the
opening off 837 of the 1,319 GSM8K test questions (15 of the 24 the study reads). Multiple-choice
scoring reads the prompt as training reads a record, `task.max_length` less the longest option.
Either way a longer prompt keeps its last tokens, as lm-evaluation-harness cuts a context, and what
it loses is counted (`Fitted.lost`): the task and `generate` say every cut.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plugin import InstructSettings

__all__ = ["Fitted", "fit_prompt", "position_limit"]


@dataclass(frozen=True)
class Fitted:
    ids: list[int]   # what the model reads
    lost: int        # tokens cut from the prompt's start


def fit_prompt(ids: Sequence[int], settings: InstructSettings, options: Sequence[Sequence[int]] = ()) -> Fitted:
    """The prompt's last tokens the model reads before its generated answer (no `options`) or before
    the multiple-choice `options` it scores (token ids each); at least one."""
    room = settings.max_length - max(map(len, options)) if options else settings.max_prompt_length
    kept = list(ids[-max(1, room):])
    return Fitted(kept, len(ids) - len(kept))


def position_limit(model) -> int | None:
    """The most positions the model's config says it holds (max_position_embeddings), None where unknown."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None
