"""Named-tensor sets: the only currency of the FL core (no models, no data, no transport)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

Tensors = dict[str, torch.Tensor]


def clone(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """Detached copies, so later in-place training cannot change what was sent."""
    return {k: v.detach().clone() for k, v in tensors.items()}


def _distinct(tensors: Mapping[str, torch.Tensor]):
    """Each distinct storage region once, so tied weights count once."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for t in tensors.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            yield t


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes on the wire (tied weights once)."""
    return sum(t.numel() * t.element_size() for t in _distinct(tensors))


def numel(tensors: Mapping[str, torch.Tensor]) -> int:
    """Parameters on the wire (tied weights once): what the paper counts, independent of dtype."""
    return sum(t.numel() for t in _distinct(tensors))


def is_finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def tensor_digest(flat: Mapping[str, torch.Tensor], info: Mapping[str, str]) -> str:
    """sha256 of named tensors (names, dtypes, shapes, bytes) and string metadata: a file's content
    hash, computed alike from what is written and from what is read back."""
    head = {"info": dict(info), "tensors": {k: [str(t.dtype), list(t.shape)] for k, t in flat.items()}}
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    for name in sorted(flat):
        h.update(flat[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
