"""The one check of named tensors against the model they are loaded into: names, shapes, dtypes, finite.

Resume (checkpoint.pt, best.pt), `model.init_from`, and export/generate (best.pt, a silo's own tensors)
all ask it, so a file one command refuses is refused by every other for the same reason: copying a
float16 or integer tensor into a float32 parameter casts it silently, and a tensor the file lacks
would keep the model's untrained value.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["tensor_problem"]


def tensor_problem(tensors: Mapping, model: Mapping[str, torch.Tensor], partial: bool = False) -> str | None:
    """What keeps `tensors` from being `model`'s tensors (the first problem, a phrase naming the tensor), or
    None. `partial`: a subset is expected, the model's other tensors keep their values (the caller says so)."""
    unexpected = [name for name in tensors if name not in model]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        return f"tensor {unexpected[0]!r}{more} is not in this model (another model architecture?)"
    missing = [] if partial else [name for name in model if name not in tensors]
    if missing:
        return (f"it lacks {len(missing)} of the model's {len(model)} tensors (e.g. {missing[0]!r}), which would keep "
                "their untrained values")
    for name, t in tensors.items():
        like = model[name]
        if not isinstance(t, torch.Tensor):
            return f"{name!r} is not a tensor"
        if tuple(t.shape) != tuple(like.shape):
            return (f"tensor {name!r} has shape {tuple(t.shape)}, the wrong shape: the model's is {tuple(like.shape)} "
                    "(another tokenizer or model size?)")
        if t.dtype != like.dtype:
            return f"tensor {name!r} is {_dtype(t)}, the model's is {_dtype(like)} (loading would cast it silently)"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"tensor {name!r} holds {int((~torch.isfinite(t)).sum())} NaN/Inf values"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
