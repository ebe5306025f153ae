"""`fedsilo generate RUN --prompt TEXT [--input TEXT]`: what a causal run's best model answers, greedy-decoded.

The model is the one `fedsilo export` writes (best.pt checked as export checks it; `--silo`: that
silo's personal model) in the run's own config, so the answer is the one the run's evaluation would
generate: the prompt is one user turn (the instruction, then a blank line and the input when one is
given, as an Alpaca row's; after an optional system turn) rendered by the run's template,
as the task renders a record's prompt, read within the task's prompt budget by the task's own rule
(`fedsilo.tasks.instruct.budget`: a longer prompt loses its start, said, never silent), and decoded
greedily up to the task's max_new_tokens or the first EOS. New tokens past what the model's positions
hold are refused before decoding, not generated for minutes.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.recipe import model_config
from fedsilo.tasks.instruct.budget import fit_prompt, position_limit
from fedsilo.tasks.instruct.plugin import MAX_NEW_TOKENS, InstructSettings
from fedsilo.tasks.instruct.records import alpaca
from fedsilo.tasks.instruct.scoring import greedy_generate
from fedsilo.tasks.instruct.template import prompt_ids, use_chat

from .export import load_trained, run_config

__all__ = ["generate"]

GENERATED = "nothing generated"


def generate(run_dir: str | Path, prompt: str, silo: str | None = None, max_new_tokens: int | None = None,
             system: str = "", input: str = "") -> str:
    """The run's (or `silo`'s) greedy answer to `prompt` (with `input`, as an Alpaca row's), decoded
    without special tokens."""
    run, cfg = run_config(run_dir)
    kind = model_config(cfg).kind
    if kind != "causal":
        raise ConfigError(f"{run.path}: generate needs model.kind = \"causal\" (the instruct task's); this run's "
                          f"model is {kind!r}")
    if not isinstance(cfg.task, InstructSettings):
        raise ConfigError(f"{run.path}: generate renders the prompt as the instruct task does; this run's task is "
                          f"{cfg.task.name!r}")
    if not prompt.strip():
        raise ConfigError("generate: the prompt is empty")
    if max_new_tokens is not None and not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: give at least 1" if max_new_tokens < 1 else
                          f"--max-new-tokens {max_new_tokens}: give at most {MAX_NEW_TOKENS} (task.max_new_tokens' "
                          "limit)")
    new = max_new_tokens or cfg.task.max_new_tokens
    trained = load_trained(run_dir, silo, outcome=GENERATED)
    tokenizer = trained.tokenizer
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{run.path}: the run's tokenizer has no EOS token, where greedy decoding stops")
    ids = prompt_ids(alpaca(prompt, input, system=system), tokenizer, use_chat(tokenizer, cfg.task.template))
    fitted = fit_prompt(ids, cfg.task)
    limit = position_limit(trained.model)
    if limit is not None and len(fitted.ids) + new > limit:
        asked = f"--max-new-tokens {new}" if max_new_tokens else f"the run's task.max_new_tokens = {new}"
        raise ConfigError(f"{asked}: the prompt's {len(fitted.ids)} tokens and {new} new ones need "
                          f"{len(fitted.ids) + new} positions, more than the model's {limit} "
                          f"(max_position_embeddings): give {'' if max_new_tokens else '--max-new-tokens '}at most "
                          f"{limit - len(fitted.ids)}")
    if fitted.lost:
        warnings.warn(ConfigWarning(f"generate: the prompt is {len(ids)} tokens, longer than the run's "
                                    f"task.max_prompt_length = {cfg.task.max_prompt_length}: as the run's evaluation "
                                    f"does, generation reads it without its first {fitted.lost} tokens"), stacklevel=2)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answer = greedy_generate(trained.model, [fitted.ids], new, tokenizer.eos_token_id, pad)[0]
    return tokenizer.decode(answer, skip_special_tokens=True)
