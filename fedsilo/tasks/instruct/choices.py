"""Multiple choice at the cost of the evaluation's loss pass: how the instruct task scores options.

Scored per record, an option costs a forward pass over prompt + option, so PubMedQA's three options
cost three passes over a 350-token abstract, on top of the loss pass over prompt + gold response. Two
things make most of that free. The loss pass already holds the scores wherever a record's rendered row
begins with the very prompt multiple choice reads and every option is one token (PubMedQA's yes / no
/ maybe under SmolLM2's tokenizer): the log-softmax at the prompt's last position scores every option
(`from_loss_pass`). Every other record is scored by `batched_option_loglikelihoods`, records batched
by prompt length. Both equal lm-evaluation-harness's per-record sums (`option_loglikelihoods`) up to
float summation order; tests/test_instruct_scoring.py checks 1e-5.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedsilo.tasks.tokens import sorted_batches

from .budget import Fitted, fit_prompt
from .plugin import InstructSettings
from .records import Record
from .scoring import batched_option_loglikelihoods, options_ids
from .template import prompt_ids

__all__ = ["Choice", "plan_choices", "from_loss_pass", "score_rest"]


@dataclass(frozen=True)
class Choice:
    prompt: Fitted              # the prompt as multiple choice reads it (`budget`)
    options: list[list[int]]    # each option's token ids, tokenised alone


def plan_choices(records: Sequence[Record], tokenizer, chat: bool, settings: InstructSettings) -> dict[int, Choice]:
    """The records with options, by index: what each one's scoring reads."""
    plans = {}
    for i, record in enumerate(records):
        if record.options:
            options = options_ids(tokenizer, record.options)
            plans[i] = Choice(fit_prompt(prompt_ids(record, tokenizer, chat), settings, options), options)
    return plans


def from_loss_pass(logits: torch.Tensor, batch: Sequence[int], rows: Sequence[Mapping[str, torch.Tensor]],
                   plans: Mapping[int, Choice]) -> dict[int, list[float]]:
    """Scores read off one loss batch's logits [b, L, V] (`batch`: its records' indices, in row order)
    for each record whose row starts with its prompt and whose options are one token each."""
    scores = {}
    for b, i in enumerate(batch):
        plan = plans.get(i)
        if plan is None or any(len(o) != 1 for o in plan.options):
            continue
        n = len(plan.prompt.ids)
        ids = rows[i]["input_ids"]
        if len(ids) < n or ids[:n].tolist() != plan.prompt.ids:
            continue
        logp = torch.log_softmax(logits[b, n - 1].float(), dim=-1)
        scores[i] = [logp[o[0]].item() for o in plan.options]
    return scores


def score_rest(model: torch.nn.Module, plans: Mapping[int, Choice], todo: Sequence[int],
               batch_size: int) -> dict[int, list[float]]:
    """Scores of the records `todo` (indices into `plans`), batched by prompt length."""
    scores = {}
    for batch in sorted_batches([len(plans[i].prompt.ids) for i in todo], batch_size):
        chunk = [todo[k] for k in batch]
        scored = batched_option_loglikelihoods(model, [plans[i].prompt.ids for i in chunk],
                                               [plans[i].options for i in chunk])
        scores.update(zip(chunk, scored))
    return scores
