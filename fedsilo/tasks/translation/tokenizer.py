"""A joint German–English subword tokenizer, fitted on the texts it is given and cached by their hash.

Which texts is the caller's choice and a privacy decision: the translation task fits it on one
domain's training sources + targets (news), never on pooled client text, so no silo's text leaves it.

- NFKC normalisation, Metaspace pre-tokenizer and decoder: ``decode`` gives back detokenised text
  with its spacing (a leading space is dropped), which is what sacreBLEU scores.
- ids 0/1/2 are ``<pad>``/``</s>``/``<unk>``; encoding with special tokens appends ``</s>`` (the
  seq2seq target + EOS convention). Special tokens in the *text* are text: a literal ``</s>`` in a
  sentence is split into pieces, never read as EOS (``split_special_tokens``).
- Unigram (SentencePiece-style) by default, BPE as the alternative; no byte fallback, so a character
  never seen in fitting becomes ``<unk>`` (the Unigram model fuses a run of them into one).
- Deterministic: the same texts and settings give the same ``tokenizer.json``, so machines that fit
  it separately agree on the ids. HF's Unigram trainer is not (it sums in hash-map order, and puts
  dropped characters back in hash-set order); :func:`_canonical_unigram` removes that noise.

The fitted vocabulary can be smaller than ``vocab_size`` (Unigram drops pieces the corpus cannot
support); size the model's embeddings by ``len(tokenizer)``.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from fedsilo.fileio import atomic_write_bytes

__all__ = ["fit_tokenizer", "load_or_fit", "fertility", "cache_key", "MODELS", "PAD", "EOS", "UNK"]

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIALS = (PAD, EOS, UNK)          # ids 0, 1, 2 in this order
MODELS = ("unigram", "bpe")
SCORE_DECIMALS = 6
"""Unigram log-probabilities are rounded to this many decimals: far coarser than the trainer's
run-to-run float noise (~1e-15), far finer than anything that changes a segmentation in practice."""
SPECIAL_SCORE = -1e6
"""Score of the special pieces in the Unigram vocabulary: the trainer gives them 0 (the best score),
so Viterbi would read a literal "</s>" in text as the EOS piece."""
PUT_BACK_STEP = 1e-4
"""The Unigram trainer's score step between the characters it puts back into the vocabulary."""
CACHE_FORMAT = 1  # bump when fitting changes, so cached tokenizers are refitted


def _check_settings(vocab_size: int, model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown tokenizer model {model!r}: expected one of {', '.join(MODELS)}")
    if not isinstance(vocab_size, int) or vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must be an integer above {len(SPECIALS)}, got {vocab_size!r}")


def _texts(texts: Iterable[str]) -> list[str]:
    texts = list(texts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"text {bad} is {type(texts[bad]).__name__}, not str")
    if not any(t.strip() for t in texts):
        raise ValueError("no text to fit a tokenizer on")
    return texts


def fit_tokenizer(texts: Iterable[str], vocab_size: int = 8000, model: str = "unigram") -> PreTrainedTokenizerFast:
    """Fit a subword tokenizer on exactly `texts` (see the module docstring for what it does)."""
    _check_settings(vocab_size, model)
    texts = _texts(texts)
    if model == "unigram":
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                          unk_token=UNK, show_progress=False)
    else:
        tok = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True))  # fused like Unigram's
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    try:
        tok.train_from_iterator(texts, trainer, length=len(texts))
    except Exception as err:  # noqa: BLE001 - the Rust trainer raises a bare Exception
        # e.g. Unigram's "The vocabulary is not large enough to contain all chars"
        raise ValueError(f"cannot fit a {model} tokenizer with vocab_size {vocab_size} on "
                         f"{len(texts)} texts: {err}") from None
    if model == "unigram":
        tok.model = _canonical_unigram(json.loads(tok.to_str())["model"]["vocab"])
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != [0, 1, 2]:
        raise RuntimeError(f"special tokens {SPECIALS} got ids {ids}, expected [0, 1, 2]")
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, 1)])
    return _wrap(tok)


def _canonical_unigram(vocab: list[list[Any]]) -> models.Unigram:
    """The trained Unigram model with run-to-run noise removed; ids: specials (0-2), then pieces by
    score, ties by piece.

    Two kinds of noise: scores differ in the last bits (rounded away), and characters the model had
    dropped are put back at ``min + k * 1e-4`` with k in hash-set order, so the same character gets
    a different score in each fit. Those get the minimum score, all of them."""
    pieces = [(p, float(s)) for p, s in vocab if p not in SPECIALS]
    low = min(s for _, s in pieces)
    n_chars = sum(len(p) == 1 for p, _ in pieces)

    def put_back(piece: str, score: float) -> bool:
        k = (score - low) / PUT_BACK_STEP
        return len(piece) == 1 and round(k) < n_chars and abs(k - round(k)) < 1e-6

    pieces = sorted(((p, round(low if put_back(p, s) else s, SCORE_DECIMALS)) for p, s in pieces),
                    key=lambda ps: (-ps[1], ps[0]))
    return models.Unigram([(s, SPECIAL_SCORE) for s in SPECIALS] + pieces, unk_id=SPECIALS.index(UNK),
                          byte_fallback=False)


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer the models use; decoding keeps spacing ("Hallo , Welt" stays)."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True)


def cache_key(texts: Iterable[str], key_parts: Mapping[str, Any], vocab_size: int, model: str) -> str:
    """sha256 over the settings, the tokenizers version and every text, so changed data refits."""
    h = hashlib.sha256()
    settings = {"format": CACHE_FORMAT, "tokenizers": tokenizers.__version__, "vocab_size": vocab_size,
                "model": model, "key_parts": dict(key_parts)}
    try:
        h.update(json.dumps(settings, sort_keys=True).encode())
    except TypeError as err:
        raise TypeError(f"tokenizer key_parts must be JSON-serialisable: {err}") from None
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: ["ab", "c"] != ["a", "bc"]
        h.update(data)
    return h.hexdigest()[:32]


def load_or_fit(texts_fn: Callable[[], list[str]], key_parts: Mapping[str, Any], cache_dir: Path,
                vocab_size: int = 8000, model: str = "unigram") -> PreTrainedTokenizerFast:
    """The tokenizer cached at ``cache_dir/<key>/tokenizer.json``, fitted (and cached) when absent.

    The key hashes the texts themselves (see :func:`cache_key`), so `texts_fn` runs every time. A
    cached file that does not load, or lacks the special tokens at ids 0-2, is refitted (with a
    warning), never trusted."""
    _check_settings(vocab_size, model)
    texts = _texts(texts_fn())
    path = Path(cache_dir) / cache_key(texts, key_parts, vocab_size, model) / "tokenizer.json"
    if path.exists():
        try:
            return _load(path, model)
        except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, refit
            warnings.warn(f"{path}: unusable cached tokenizer ({err}); refitting", stacklevel=2)
    tokenizer = fit_tokenizer(texts, vocab_size, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    return tokenizer


def _load(path: Path, model: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_file(str(path))
    kind = type(tok.model).__name__.lower()
    if kind != model:
        raise ValueError(f"a {kind} model, expected {model}")
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != [0, 1, 2]:
        raise ValueError(f"special tokens {SPECIALS} have ids {ids}, expected [0, 1, 2]")
    return _wrap(tok)


def fertility(tokenizer, texts: Iterable[str]) -> dict:
    """Subword pieces per whitespace-separated word, and the share of pieces that are ``<unk>``.

    Pieces are the encoding without added special tokens (``<unk>`` counts as a piece; pad and EOS,
    which text never produces, would not)."""
    texts = list(texts)
    words = sum(len(t.split()) for t in texts)
    if not words:
        raise ValueError("fertility of texts without words")
    unk = tokenizer.unk_token_id
    skip = set(tokenizer.all_special_ids) - {unk}
    pieces = unks = 0
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        kept = [i for i in ids if i not in skip]
        pieces += len(kept)
        unks += sum(i == unk for i in kept)
    return {"pieces_per_word": pieces / words, "unk_rate": unks / pieces if pieces else 0.0, "words": words}
