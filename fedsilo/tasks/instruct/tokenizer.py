"""The built-in decoder's tokenizer: a byte-level BPE fitted on the public text it is given, cached by
its hash (which text is the caller's choice and a privacy decision: the instruct task fits it on
text no silo owns, never on pooled client text).

- Byte-level (GPT-2's alphabet of 256 byte symbols): every character is encodable, code and maths
  included, with no ``<unk>``, and ``decode(encode(x)) == x`` (no normaliser, no added prefix space).
- Digits are split one by one before the byte-level split, as Llama's and PaLM's tokenizers do:
  a number's pieces do not depend on which digit strings were frequent in fitting (GSM8K arithmetic).
- ids 0/1/2 are ``<pad>``/``<s>``/``</s>``; encoding with special tokens prepends ``<s>`` and appends
  nothing (the instruct task appends ``</s>`` after a response). Special tokens in the *text* are
  text: a literal ``</s>`` in code is split into pieces, never read as EOS.
- No chat template: the instruct task renders records with its plain template.
- Deterministic: the same texts and settings give the same ``tokenizer.json``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from fedsilo.fileio import atomic_write_bytes
from fedsilo.tasks.translation.tokenizer import cache_key

__all__ = ["fit_tokenizer", "load_or_fit", "PAD", "BOS", "EOS"]

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2 in this order
BYTES = pre_tokenizers.ByteLevel.alphabet()
MODEL = "byte-level-bpe"
CACHE_FORMAT = 1  # bump when fitting changes, so cached tokenizers are refitted


def _check(texts: list[str], vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size <= len(SPECIALS) + len(BYTES):
        raise ValueError(f"vocab_size must be an integer above {len(SPECIALS) + len(BYTES)} (the special tokens and "
                         f"the 256 bytes), got {vocab_size!r}")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"text {bad} is {type(texts[bad]).__name__}, not str")
    if not any(t.strip() for t in texts):
        raise ValueError("no text to fit a tokenizer on")


def fit_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Fit a byte-level BPE on exactly `texts` (see the module docstring for what it does)."""
    texts = list(texts)
    _check(texts, vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=BYTES,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != [0, 1, 2]:
        raise RuntimeError(f"special tokens {SPECIALS} got ids {ids}, expected [0, 1, 2]")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, 1)])
    return _wrap(tok)


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True)


def load_or_fit(texts: Callable[[], list[str]], key: dict, cache_dir: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """The tokenizer cached at ``cache_dir/<hash>/tokenizer.json``, fitted (and cached) when absent.

    The hash covers the texts themselves, `key` and `vocab_size`, so `texts` runs every time and
    changed data refits. A cached file that does not load as this kind of tokenizer is refitted
    (with a warning), never trusted."""
    corpus = list(texts())
    _check(corpus, vocab_size)
    path = Path(cache_dir) / cache_key(corpus, {"key": dict(key), "format": CACHE_FORMAT}, vocab_size, MODEL) \
        / "tokenizer.json"
    if path.exists():
        try:
            return _load(path)
        except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, refit
            warnings.warn(f"{path}: unusable cached tokenizer ({err}); refitting", stacklevel=2)
    tokenizer = fit_tokenizer(corpus, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    return tokenizer


def _load(path: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_file(str(path))
    if not isinstance(tok.model, models.BPE) or not isinstance(tok.decoder, decoders.ByteLevel):
        raise ValueError(f"a {type(tok.model).__name__} tokenizer, expected a byte-level BPE")
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != [0, 1, 2]:
        raise ValueError(f"special tokens {SPECIALS} have ids {ids}, expected [0, 1, 2]")
    return _wrap(tok)
