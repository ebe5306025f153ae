"""Named-tensor sets: the only currency of the FL core (no models, no data, no transport)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

Tensors = dict[str, torch.Tensor]


def clone(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """Detached copies, so later in-place training cannot change what was sent."""
    return {k: v.detach().clone() for k, v in tensors.items()}


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes on the wire: each distinct storage region once, so tied weights count once."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    total = 0
    for t in tensors.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def is_finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
