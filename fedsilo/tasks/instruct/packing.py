"""Packing (`task.packing = true`): a training batch's examples share sequences instead of padding.

The rows are placed first-fit, in order, into as few sequences of at most `max_length` tokens as
hold them. Each example must see only itself, so the result equals the unpacked batch's loss:
position ids restart at 0 for each example, attention is block-diagonal causal, and each example's
first label is dropped (in a packed sequence the token before it is the previous example's last).

How the mask reaches the model (transformers 5.24, `masking_utils.create_causal_mask`): a 4-D
attention mask [batch, 1, query, key] is used as it is. The alternative, packed-sequence detection
from restarting position ids, is skipped whenever the model builds a KV cache (`use_cache`, on by
default even in training), and then attention would silently cross examples; the explicit mask
holds either way. It is additive (0 where a token may attend, -inf elsewhere), the form eager and
SDPA attention both add to their scores; flash and flex attention take other forms, so
`require_packable` refuses them. Padding tokens attend to each other only (no row is all -inf, so
no NaN) and carry no label.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedsilo.errors import ConfigError
from fedsilo.tasks.tokens import pad_rows, pad_seq2seq

__all__ = ["pack", "unpacked", "require_packable"]

ADDITIVE_MASK_ATTENTION = ("eager", "sdpa")


def require_packable(model: torch.nn.Module) -> None:
    """Refuse packing for an attention implementation that does not add a 4-D mask to its scores."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ADDITIVE_MASK_ATTENTION:
        raise ConfigError(f"task.packing = true needs eager or sdpa attention; this model uses {implementation!r}: "
                          "set task.packing = false")


def _first_fit(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"a row of {n} tokens does not fit a packed sequence of {max_length}")
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([])
            room.append(max_length)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= n
    return bins


def pack(rows: Sequence[Mapping[str, torch.Tensor]], max_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of `input_ids` and `labels` packed: input_ids, labels (-100 at padding and at each
    example's first token), position_ids (from 0 per example) and the 4-D additive attention_mask."""
    ids, labels, positions, segments = [], [], [], []
    for members in _first_fit([int(r["input_ids"].shape[0]) for r in rows], max_length):
        parts = [rows[i] for i in members]
        ids.append(torch.cat([r["input_ids"].long() for r in parts]))
        labels.append(torch.cat([torch.cat([torch.tensor([-100]), r["labels"][1:].long()]) for r in parts]))
        positions.append(torch.cat([torch.arange(int(r["input_ids"].shape[0])) for r in parts]))
        segments.append(torch.cat([torch.full((int(r["input_ids"].shape[0]),), k) for k, r in enumerate(parts)]))
    segment = pad_rows(segments, -1)  # padding is one more segment of its own
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return {"input_ids": pad_rows(ids, pad_id), "labels": pad_rows(labels, -100),
            "position_ids": pad_rows(positions, 0), "attention_mask": mask[:, None]}


def unpacked(rows: Sequence[Mapping[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """The ordinary batch: right-padded input_ids, a 2-D attention_mask, labels -100 at padding."""
    return pad_seq2seq(rows, pad_id)
