"""A local checkpoint folder (`model.name` = a folder) loaded by transformers, or one line saying why not.

transformers loads what it can and initialises the rest: weights of another architecture than the one
config.json names (its `model_type`) load as nothing and a freshly initialised model trains; a
config.json whose sizes differ from the weights raises a RuntimeError whose details it only logs; a
truncated safetensors file raises SafetensorError; a tokenizer with more tokens than the embedding has
rows fails only in training (IndexError). Here each is one ConfigError naming the folder or file. The
loading report decides: a tensor of the architecture missing from the weights, a tensor of the weights
the architecture does not have, or one of another shape means the weights are not what config.json says.
"""
from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from fedsilo.errors import ConfigError
from fedsilo.fileio import regular_file

__all__ = ["load_local"]


def load_local(auto, path: Path, what: str, fresh_head: bool = False, **kwargs) -> tuple[object, object]:
    """(model, tokenizer) of the checkpoint in `path`, as `auto.from_pretrained` loads it (`kwargs`),
    checked; `what` names the kind in errors. `fresh_head`: the loader adds a new task head, so tensors
    outside the base model may be missing from the weights (the head) or unused (a pretraining head)."""
    from transformers import AutoTokenizer

    weights = _readable_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model, report = auto.from_pretrained(str(path), output_loading_info=True, ignore_mismatched_sizes=True,
                                             **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"model.name: cannot load a {what} checkpoint from {path}: {reason}") from None
    problem = _not_these_weights(model, report, fresh_head, path / "config.json")
    if problem is not None:
        raise ConfigError(f"model.name: {weights}: {problem}")
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ConfigError(f"model.name: the tokenizer in {path} has {len(tokenizer)} tokens, the model's embedding "
                          f"{rows} rows (config.json's vocab_size): ids from {rows} on would index past it; use the "
                          "tokenizer the model was trained with")
    return model, tokenizer


def _readable_files(path: Path) -> Path:
    """Every file of the folder a regular one (a FIFO would hang the reader), each safetensors file whole;
    returns the weights as errors name them (the one file, else the folder)."""
    for entry in sorted(path.iterdir()):
        if not entry.is_dir():
            regular_file(entry, "model.name", ConfigError)
    shards = sorted(path.glob("*.safetensors"))
    for shard in shards:
        try:
            with safe_open(str(shard), "pt"):
                pass
        except SafetensorError as err:
            raise ConfigError(f"model.name: {shard} is not a whole safetensors file ({err}): truncated, or still "
                              "being copied or downloaded?") from None
    return shards[0] if len(shards) == 1 else path


def _not_these_weights(model, report: dict, fresh_head: bool, config: Path) -> str | None:
    """What the loading report says is wrong with the weights for the model config.json builds, or None."""
    mismatched = sorted(report.get("mismatched_keys") or (), key=lambda m: m[0])
    if mismatched:
        shown = ", ".join(f"{name!r} {tuple(theirs)} in the weights, {tuple(ours)} by it"
                          for name, theirs, ours in mismatched[:3])
        more = f" and {len(mismatched) - 3} more" if len(mismatched) > 3 else ""
        return f"{config} does not describe these weights (its vocab_size, hidden_size, ...): {shown}{more}"
    body = f"{model.base_model_prefix}."
    kept = (lambda key: key.startswith(body)) if fresh_head else (lambda key: True)
    missing = sorted(k for k in report.get("missing_keys") or () if kept(k))
    unused = sorted(k for k in report.get("unexpected_keys") or () if kept(k))
    if not missing and not unused:
        return None
    said = [f"{len(missing)} of its tensors are not in the file (e.g. {missing[0]!r})"] if missing else []
    said += [f"{len(unused)} of the file's are not its own (e.g. {unused[0]!r})"] if unused else []
    return (f"the weights are not this architecture's ({config.name} names model_type {model.config.model_type!r}, "
            f"{type(model).__name__}): {' and '.join(said)}; a model built so would train from fresh values")
