"""A record as token ids and completion-only labels: the loss covers the response alone.

As trl's completion-only loss does, every prompt token is labelled -100, so the model learns to
answer, not to write questions. The prompt is rendered with the tokenizer's own chat template when
it has one (`task.template = "auto"`; "chat" insists on it, "plain" never uses it), else with this
plain (Alpaca-style) template. Its text for a record (system, user, assistant, user) and the response:

    {system}

    ### Instruction:
    {first user turn}

    ### Response:
    {earlier assistant turn}

    ### Instruction:
    {last user turn}

    ### Response:
    {response}<EOS>

That is: a system turn is "{content}\\n\\n"; a user turn "### Instruction:\\n{content}\\n\\n### Response:\\n";
an earlier assistant turn "{content}\\n\\n"; the response follows the last "### Response:\\n" and is
followed by the EOS token. A plain-text record (no turns: generic pre-training text) is its text
then EOS on either template, every token in the loss.

The prompt and the response are tokenised apart and concatenated: exactly what generation sees (the
model is given the prompt ids and continues), and the prompt mask is exact whatever a BPE would have
merged across the boundary. Plain: prompt with the tokenizer's own special tokens (Llama's BOS), the
response without, then EOS. Chat: both without special tokens (the template writes its own BOS and
end-of-turn text, which is in the completion and so in the loss); no EOS is appended.

Truncation keeps the first `max_length` tokens, as trl does (`task.truncation = "end"`; or
"prompt_start": the prompt's start is cut so the response survives), and is reported (`Rendered.truncated`),
never silent. A record whose response is cut away completely still comes back, all its labels -100:
it trains nothing (`Rendered.trains` is False) and the task counts it apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from fedsilo.errors import ConfigError

from .records import Record

__all__ = ["TEMPLATES", "TRUNCATIONS", "Rendered", "use_chat", "prompt_ids", "render", "trains"]

TEMPLATES = ("auto", "chat", "plain")
IGNORE = -100  # the label the loss skips (torch cross_entropy's ignore_index)


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    labels: list[int]      # IGNORE on every prompt token, the id itself on every response token
    full_length: int       # tokens before truncation
    truncated: bool

    @property
    def trains(self) -> bool:
        return trains(self.labels)


def trains(labels: list[int]) -> bool:
    """Whether any token is left in the loss (a causal LM never predicts the first token)."""
    return any(label != IGNORE for label in labels[1:])


def use_chat(tokenizer: Any, template: str) -> bool:
    """Whether records are rendered with the tokenizer's chat template (`task.template`)."""
    if template not in TEMPLATES:
        raise ConfigError(f"task.template = {template!r}: choose one of {', '.join(TEMPLATES)}")
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_chat:
        raise ConfigError(f"task.template = \"chat\": the tokenizer {type(tokenizer).__name__} has no chat "
                          "template; use \"plain\" (or \"auto\")")
    return has_chat if template == "auto" else template == "chat"


def _plain_prompt(record: Record) -> str:
    parts = []
    for role, content in record.turns:
        if role == "user":
            parts.append(f"### Instruction:\n{content}\n\n### Response:\n")
        else:  # a system turn, or an earlier assistant answer
            parts.append(f"{content}\n\n")
    return "".join(parts)


def _messages(record: Record) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in record.turns]


def _chat_text(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except TemplateError as err:
        raise ConfigError(f"task.template: the tokenizer's chat template refuses a record: {err}") from None


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"task.template: the tokenizer {type(tokenizer).__name__} has no EOS token, which ends "
                          "every plain-template response and plain-text record")
    return int(tokenizer.eos_token_id)


def _parts(record: Record, tokenizer: Any, chat: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): the completion is what the loss covers."""
    if record.is_plain_text:
        return [], _encode(tokenizer, record.response, True) + [_eos(tokenizer)]
    if not chat:
        return (_encode(tokenizer, _plain_prompt(record), True),
                _encode(tokenizer, record.response, False) + [_eos(tokenizer)])
    messages = _messages(record)
    prompt = _chat_text(tokenizer, messages, True)
    full = _chat_text(tokenizer, messages + [{"role": "assistant", "content": record.response}], False)
    if not full.startswith(prompt):
        raise ConfigError("task.template: the tokenizer's chat template does not render a conversation with its "
                          "answer as the generation prompt followed by the answer; use task.template = \"plain\"")
    return _encode(tokenizer, prompt, False), _encode(tokenizer, full[len(prompt):], False)


def prompt_ids(record: Record, tokenizer: Any, chat: bool) -> list[int]:
    """What generation and multiple-choice scoring condition on: the prompt as training renders it
    (a plain-text record: the tokenizer's leading special tokens alone, e.g. BOS)."""
    if record.is_plain_text:
        return _encode(tokenizer, "", True)
    if not chat:
        return _encode(tokenizer, _plain_prompt(record), True)
    return _encode(tokenizer, _chat_text(tokenizer, _messages(record), True), False)


TRUNCATIONS = ("end", "prompt_start")


def render(record: Record, tokenizer: Any, chat: bool, max_length: int, truncation: str = "end") -> Rendered:
    """The record's ids and completion-only labels, at most `max_length` of them. `truncation`: "end"
    keeps the first `max_length` tokens (trl's default); "prompt_start" cuts the prompt's start instead
    (its BOS kept), so that the response survives a long context (PubMedQA's abstracts) — and cuts the
    response's end only when the response alone is too long."""
    prompt, completion = _parts(record, tokenizer, chat)
    full = len(prompt) + len(completion)
    if truncation == "prompt_start" and full > max_length and len(completion) < max_length:
        bos = tokenizer.bos_token_id
        head = prompt[:1] if prompt and bos is not None and prompt[0] == bos else []
        room = max_length - len(completion) - len(head)
        prompt = head + (prompt[len(prompt) - room:] if room > 0 else [])
        ids, labels = prompt + completion, [IGNORE] * len(prompt) + completion
        return Rendered(ids[:max_length], labels[:max_length], full, True)
    ids = prompt + completion
    labels = [IGNORE] * len(prompt) + completion
    return Rendered(ids[:max_length], labels[:max_length], len(ids), len(ids) > max_length)
