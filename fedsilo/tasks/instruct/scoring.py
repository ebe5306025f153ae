"""What a decoder is scored by: response loss, multiple-choice log-likelihood, greedy answers and
GSM8K's final number.

Multiple choice is scored as lm-evaluation-harness scores it: the summed log-probability of each
option's tokens given the prompt, the prediction the option with the largest sum (unnormalised
`acc`). The tokens differ in one respect: lm-eval encodes context + continuation as one string and
splits the ids at the context's length (`_encode_pair`), so a merge across the boundary goes to the
continuation; here the options are tokenised alone (no special tokens) and appended to the prompt
ids, exactly as training renders a response after its prompt (`template.render`).

GSM8K follows lm-eval's "strict-match": the number after "#### " (regex `#### (\\-?[0-9\\.\\,]+)`),
commas removed and a trailing "." dropped. lm-eval takes the first such match, here the last: a
model that corrects itself ends with its final answer. On the gold answers, which hold one, both agree.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from fedsilo.tasks.tokens import pad_rows

__all__ = ["token_nll", "response_nll", "options_ids", "option_loglikelihoods", "batched_option_loglikelihoods",
           "greedy_generate",
           "extract_final_number", "same_number"]

FINAL_NUMBER = re.compile(r"#### (\-?[0-9\.\,]+)")


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal cross-entropy [b, L-1] in float32: logits[:, :-1] predict labels[:, 1:]; 0 at -100.
    The labels are shifted, not the logits (as transformers' own causal-LM loss does): the logits
    stay one contiguous [b·L, V] view, where slicing them would copy the largest tensor of the step
    and its gradient (measured 25% of a tiny model's step on a CPU, bench/instruct_throughput.py); and
    rows of the vocabulary, not the class-second [b, V, L] layout, which runs about twice as slow."""
    b, length = labels.shape
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    nll = torch.nn.functional.cross_entropy(logits.float().reshape(b * length, -1), shifted.reshape(-1),
                                            ignore_index=-100, reduction="none")
    return nll.view(b, length)[:, :-1]


def response_nll(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed response-token NLL [b] and its count of scored tokens [b] (a packed row
    holds several examples: the sums over rows are what stays exact)."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return token_nll(logits, labels).sum(1), (labels[:, 1:] != -100).sum(1)


def options_ids(tokenizer: Any, options: Sequence[str]) -> list[list[int]]:
    """Each option as it follows a prompt: tokenised alone, without special tokens."""
    return [list(tokenizer(option, add_special_tokens=False)["input_ids"]) for option in options]


@torch.no_grad()
def option_loglikelihoods(model: torch.nn.Module, prompt_ids: list[int], options_ids: list[list[int]]) -> list[float]:
    """log P(option | prompt) for each option, summed over its tokens; one batched forward."""
    if not prompt_ids or not all(options_ids):
        raise ValueError("multiple-choice scoring needs a non-empty prompt and non-empty options")
    rows = [torch.tensor(prompt_ids + option) for option in options_ids]
    labels = pad_rows([torch.tensor([-100] * len(prompt_ids) + option) for option in options_ids], -100)
    ids = pad_rows(rows, 0)
    mask = (labels != -100) | (torch.arange(ids.shape[1]) < len(prompt_ids))
    logits = model(input_ids=ids.to(model.device), attention_mask=mask.long().to(model.device)).logits
    return (-token_nll(logits, labels.to(model.device)).sum(1)).tolist()


@torch.no_grad()
def batched_option_loglikelihoods(model: torch.nn.Module, prompts: Sequence[list[int]],
                                  options: Sequence[list[list[int]]]) -> list[list[float]]:
    """`option_loglikelihoods` for several records at once, equal to it up to float summation order.
    A record whose options are one token each is scored from one pass over its prompt (the last
    position's log-softmax holds every option's score: PubMedQA's yes/no/maybe under a real model's
    tokenizer); the prompts of such records run as one left-padded batch that keeps only the last
    position's logits. Any other record's (prompt + option) rows join one right-padded batch."""
    if any(not p for p in prompts) or any(not all(o) for o in options):
        raise ValueError("multiple-choice scoring needs a non-empty prompt and non-empty options")
    scores: list[list[float]] = [[] for _ in prompts]
    short = [i for i, opts in enumerate(options) if all(len(o) == 1 for o in opts)]
    if short:
        last = _last_position_logprobs(model, [prompts[i] for i in short])
        for i, row in zip(short, last):
            scores[i] = [row[o[0]].item() for o in options[i]]
    one_token = set(short)
    long = [(i, o) for i, opts in enumerate(options) if i not in one_token for o in opts]
    if long:
        labels = pad_rows([torch.tensor([-100] * len(prompts[i]) + o) for i, o in long], -100)
        ids = pad_rows([torch.tensor(prompts[i] + o) for i, o in long], 0)
        mask = pad_rows([torch.ones(len(prompts[i]) + len(o), dtype=torch.long) for i, o in long], 0)
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
        for (i, _), total in zip(long, (-token_nll(logits, labels.to(model.device)).sum(1)).tolist()):
            scores[i].append(total)
    return scores


def _last_position_logprobs(model: torch.nn.Module, prompts: Sequence[list[int]]) -> torch.Tensor:
    """log P(next token | prompt) [b, V]: left padding, positions counted from each prompt's first token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                   position_ids=positions.to(model.device), logits_to_keep=1).logits
    return torch.log_softmax(logits[:, -1].float(), dim=-1).cpu()


@torch.no_grad()
def greedy_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    pad_id: int) -> list[list[int]]:
    """Greedy continuations, batched with left padding: each without its prompt, cut before its
    first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[:row.index(eos_id)] if eos_id in row else row)
    return answers


def extract_final_number(text: str) -> str | None:
    """The number after the last "#### ", commas removed and a trailing "." dropped; None if none."""
    found = FINAL_NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "")
    return number[:-1] if number.endswith(".") else number


def same_number(predicted: str | None, gold: str | None) -> bool:
    """Numeric equality ("72" == "72.0"); a missing or unreadable number equals nothing."""
    if predicted is None or gold is None:
        return False
    try:
        return Decimal(predicted) == Decimal(gold)
    except InvalidOperation:
        return False
