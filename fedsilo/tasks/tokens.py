"""Tokenise once: a silo's examples are encoded once per run, cached on disk, and batched from tensors.

A task that implements `PreTokenized` splits its collate into `tokenize` (examples → one row of
unpadded id tensors each) and `pad` (rows → a batch). The cache file of a set of examples is named
by a hash of everything that decides the ids: the tokenizer itself (its full serialisation: vocab,
normaliser, special tokens), the task's length limits and options (`token_settings`), and the
examples' text. Change any of them and another file is used; nothing is ever read stale.

Files are safetensors (one flat int32 tensor and one offsets tensor per field), written atomically,
so an interrupted write leaves no file a later run would trust. A file carries a content hash; one
that does not match it, lacks it (an older fedsilo), does not load or holds ids outside the
tokenizer's vocabulary is tokenised again with a warning naming it: a changed cache would silently
change results, or end every later run in an IndexError.

What tokenising says (a task that cuts long examples says how many) is said on a cache hit too: a task
that implements `TellsCuts` says it again from the cached rows, so a re-run is never quieter than the
run that wrote the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import safe_open
from safetensors.torch import save

from fedsilo.core.tensors import tensor_digest
from fedsilo.fileio import atomic_write_bytes

Row = dict[str, torch.Tensor]  # field → 1-D tensor of one example (ids, or per-token values)
FORMAT = 1  # bump when the file layout or a task's row fields change meaning
IGNORE = -100  # cross-entropy's ignore_index: in a `labels` row, a token the loss skips


@runtime_checkable
class PreTokenized(Protocol):
    name: str
    tokenizer: Any

    def tokenize(self, examples: Sequence[Any]) -> list[Row]:
        """One row per example, unpadded."""

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The batch `collate` would give for the same examples."""

    def token_settings(self) -> dict:
        """Everything besides the tokenizer that changes the ids (length limits, formats)."""


@runtime_checkable
class TellsCuts(Protocol):
    def tell_cuts(self, examples: Sequence[Any], rows: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Say what `tokenize` says of `examples` (e.g. how many were cut), from their cached `rows`."""


def row_length(row: Mapping[str, torch.Tensor]) -> int:
    """Tokens in a row (all its fields): what batching groups by."""
    return sum(int(t.shape[0]) for t in row.values())


def default_cache_dir() -> Path:
    """$FEDSILO_CACHE_DIR, else $XDG_CACHE_HOME/fedsilo, else ~/.cache/fedsilo; tokens under `tokens/`."""
    root = os.environ.get("FEDSILO_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedsilo"
    return Path(root) / "tokens"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: a fast tokenizer's whole serialisation (less its truncation
    and padding state, which each call sets), else its vocab."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        text = json.dumps(spec, sort_keys=True)
    elif hasattr(tokenizer, "get_vocab"):
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    else:
        raise TypeError(f"cannot fingerprint a {type(tokenizer).__name__} tokenizer (no backend_tokenizer "
                        "or get_vocab); disable the token cache (engine.token_cache = false)")
    extra = {"class": type(tokenizer).__name__, "special": {k: str(v) for k, v in
                                                           getattr(tokenizer, "special_tokens_map", {}).items()}}
    return hashlib.sha256((text + json.dumps(extra, sort_keys=True)).encode()).hexdigest()


def cache_key(task: PreTokenized, examples: Sequence[Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "task": task.name, "tokenizer": tokenizer_fingerprint(task.tokenizer),
                         "settings": task.token_settings()}, sort_keys=True, default=str).encode())
    for e in examples:
        h.update(repr(e).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _to_bytes(rows: Sequence[Row]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for field in (rows[0] if rows else {}):
        parts = [r[field] for r in rows]
        tensors[field] = torch.cat(parts) if parts else torch.zeros(0)
        tensors[f"{field}.offsets"] = torch.tensor([0] + [int(p.shape[0]) for p in parts]).cumsum(0)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    info = {"rows": str(len(rows))}
    return save(tensors, metadata={**info, "sha256": tensor_digest(tensors, info)})


def _from_file(path: Path, vocab: int | None = None) -> list[Row]:
    """The rows of a cache file; ValueError saying what is wrong with one that cannot be trusted."""
    with safe_open(str(path), "pt") as f:
        info = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    claimed = info.pop("sha256", None)
    if claimed is None:
        raise ValueError("it carries no content hash (written by an older fedsilo)")
    if tensor_digest(tensors, info) != claimed:
        raise ValueError("it does not match its content hash (changed after it was written)")
    n = int(info["rows"])
    fields = [k for k in tensors if not k.endswith(".offsets")]
    flat = {k: tensors[k] for k in fields}
    offsets = {k: tensors[f"{k}.offsets"].tolist() for k in fields}
    for k in fields:
        t = flat[k]
        if len(offsets[k]) != n + 1 or offsets[k][0] != 0 or offsets[k][-1] != t.shape[0] or \
                any(a > b for a, b in zip(offsets[k], offsets[k][1:])):
            raise ValueError(f"its {k!r} offsets do not cut {n} rows")
        ids = t[t != IGNORE] if k == "labels" else t  # a label row may skip tokens (a completion-only loss)
        if vocab is not None and not ids.is_floating_point() and ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"its {k!r} holds ids outside the tokenizer's vocabulary (0..{vocab - 1})")
    return [{k: flat[k][offsets[k][i]:offsets[k][i + 1]] for k in fields} for i in range(n)]


def _vocab_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer gives (added tokens included), or None when it does not say."""
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


def tokenized(task: PreTokenized, examples: Sequence[Any], cache_dir: Path | None) -> list[Row]:
    """`task.tokenize(examples)`, read from `cache_dir` when an earlier run wrote it (None: no cache).
    Ids are stored as int32 (any vocabulary below 2³¹) and padded into int64 batches."""
    if not examples:
        return []
    path = Path(cache_dir) / f"{task.name}-{cache_key(task, examples)}.safetensors" if cache_dir else None
    if path is not None and path.exists():
        try:
            rows = _from_file(path, _vocab_size(task.tokenizer))
            if len(rows) != len(examples):
                raise ValueError(f"it holds {len(rows)} rows for {len(examples)} examples")
        except Exception as err:  # noqa: BLE001 - a damaged cache file is re-made, never trusted
            warnings.warn(f"token cache {path}: {err}; tokenising again", stacklevel=2)
        else:
            if isinstance(task, TellsCuts):
                task.tell_cuts(examples, rows)
            return rows
    rows = [{k: (v.to(torch.int32) if not v.is_floating_point() else v) for k, v in r.items()}
            for r in task.tokenize(examples)]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, _to_bytes(rows))
    return rows


def pad_rows(rows: Sequence[torch.Tensor], value: int) -> torch.Tensor:
    """[b, longest] int64, each row left-aligned, the rest `value`."""
    out = torch.full((len(rows), max((int(r.shape[0]) for r in rows), default=0)), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out


def pad_seq2seq(rows: Sequence[Mapping[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """A seq2seq batch from rows of `input_ids` and `labels`: ids padded with `pad_id`, labels with -100."""
    ids = [r["input_ids"] for r in rows]
    return {"input_ids": pad_rows(ids, pad_id), "attention_mask": attention_mask(ids),
            "labels": pad_rows([r["labels"] for r in rows], -100)}


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy [batch, length], 0 at padding (labels -100)."""
    return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                             reduction="none")


def sequence_losses(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each row's token-mean cross-entropy [batch]: one example's loss that depends on that example
    alone (a batch's token mean weighs each row by the others' lengths), which DP-SGD needs."""
    labels = batch["labels"]
    nll = sequence_nll(model(**batch).logits, labels)
    return nll.sum(1) / (labels != -100).sum(1).clamp(min=1)


def attention_mask(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    lengths = torch.tensor([int(r.shape[0]) for r in rows])
    return (torch.arange(int(lengths.max()) if len(rows) else 0)[None, :] < lengths[:, None]).long()


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Evaluation batches, longest examples first (an out-of-memory shows at once), each a list of
    indices into the original order; callers put outputs back in that order."""
    ranked = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [ranked[s:s + batch_size] for s in range(0, len(ranked), batch_size)]


class RowMemo:
    """Rows tokenised at their first use and kept: an evaluation split is tokenised once per run."""

    def __init__(self, task: PreTokenized) -> None:
        self.task = task
        self._rows: dict[Any, list[Row]] = {}

    def __call__(self, key: Any, examples: Sequence[Any]) -> list[Row]:
        if key not in self._rows:
            self._rows[key] = self.task.tokenize(examples)
        return self._rows[key]
