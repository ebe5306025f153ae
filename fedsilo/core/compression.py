"""Compressed upload: four upload transforms that send the update Δ = values − reference in fewer bytes.

Each codec C sends C(u) for u = Δ (+ the silo's residual, below); the server adds its decoding D(C(u))
to its own values of the tensors. Per element of u, in bytes on the wire and error |D(C(u)) − u|:

- `fp16`: u cast to float16, 2 bytes. Round to nearest: at most 2⁻¹¹·|u| in float16's normal range
  (|u| ≥ 2⁻¹⁴), at most 2⁻²⁵ below it (subnormal spacing 2⁻²⁴); |u| beyond 65504 is clamped to it.
- `bf16`: u cast to bfloat16, 2 bytes, at most 2⁻⁸·|u| (float32's range, so nothing is clamped). numpy
  has no bfloat16, so its bits travel as int16.
- `int8`: blockwise absmax. Each run of `block_size` consecutive values of the flattened tensor shares
  one scale s = max|u_block|/127 and sends codes round(u/s) in [−127, 127] (symmetric, so 0 is exact;
  an all-zero block has s = 0 and codes 0): 1 byte + 4/block_size, at most s/2 = max|u_block|/254.
  Scales are float32, not float16: an update's entries are often ~1e-6, and a float16 scale would
  then be subnormal or 0 (a lost block) for 2/block_size bytes saved (under 1% at 256).
- `topk`: per tensor, the k = max(1, round(fraction·n)) entries of largest |u| (none of an empty tensor)
  as float32 values and flat indices (int32 below 2³¹ entries, else int64), sorted: 8 bytes per kept
  entry (12 with int64 indices). Kept entries are exact (float32); the error is the dropped entries.

Wire form: only numpy-compatible dtypes, one flat tensor under the tensor's own name (fp16, int16 bits,
int8 codes, top-k values) and side tensors under `<name>::scale`, `<name>::index`, so `nbytes` of the
wire counts everything sent. The record: {"bytes", "raw_bytes" (4 per element, what float32 would
cost), "error": ‖u − D(C(u))‖/‖u‖ over the upload (0 when u = 0)}.

Error feedback (`error_feedback = true`, the default; Seide et al. 2014, Karimireddy et al. 2019): the
silo keeps e, what compression dropped, and sends C(Δ + e) next round, so a dropped part is sent later
instead of lost: after T rounds the server has received Σ Δ_t − e_T, e_T being only the last round's
compression error (for a steady update the sum's relative error falls as 1/T). e lives in the
transform's state on the silo (its store), so a resumed run continues with the same residual. A round
whose u holds a NaN or an Inf is refused on the silo (SiloRefused naming the tensor) before anything is
coded: kept in e, one such value would be added to every later round, so no residual ever holds one.

A codec is the chain's last transform: what it sends is no longer the tensors' values.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedsilo.registry import Policy, Registry

from .tensors import Tensors, nbytes
from .transforms import UPLOAD_TRANSFORMS, SiloRefused, TransformContext, UploadTransform

SEP = "::"  # `<name>::<part>` names a side tensor; a model whose tensor names hold it is refused (recipe.check_plan)


class CompressionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    error_feedback: bool = Field(True, description="keep what compression drops on the silo and add it to the "
                                                   "next round's update, so it is sent later instead of lost")


class BlockSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    block_size: int = Field(256, ge=8, le=2**20, description="consecutive values that share one float32 scale")


class Int8Settings(CompressionSettings, BlockSettings):
    pass


class TopkSettings(CompressionSettings):
    fraction: float = Field(0.01, gt=0, le=1, allow_inf_nan=False,
                            description="share of each tensor's entries sent, those of largest |Δ| (at least one)")


@dataclass(frozen=True)
class Codec:
    """compress(u, options) -> {part: wire tensor} for flat u ("" is the part under the tensor's own name);
    expand(name, parts, n, options) -> D as n float32 values, a ValueError naming the tensor if the parts
    do not decode. Client and server both decode with `expand`, so the residual is what the server lacks."""
    parts: tuple[str, ...]
    compress: Callable[[torch.Tensor, Any], Tensors]
    expand: Callable[[str, Tensors, int, Any], torch.Tensor]


def carried_values(wire: Tensors) -> Tensors:
    """The wire's value tensors without its side tensors (scales, indices): what counts as parameters sent
    (a top-k upload sends k of them); bytes count everything."""
    return {k: t for k, t in wire.items() if SEP not in k}


def _key(name: str, part: str) -> str:
    return f"{name}{SEP}{part}" if part else name


def _part(name: str, parts: Tensors, part: str, dtype: torch.dtype, length: int) -> torch.Tensor:
    """The wire's `part` of `name`, checked to be `length` values of `dtype`."""
    t = parts[part]
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (length,):
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{_key(name, part)!r}: expected {length} values of {dtype}, got {got}")
    return t


_HALF_MAX = torch.finfo(torch.float16).max


def _to_fp16(u: torch.Tensor, options: CompressionSettings) -> Tensors:
    return {"": u.clamp(-_HALF_MAX, _HALF_MAX).half()}


def _from_fp16(name: str, parts: Tensors, n: int, options: CompressionSettings) -> torch.Tensor:
    return _part(name, parts, "", torch.float16, n).float()


def _to_bf16(u: torch.Tensor, options: CompressionSettings) -> Tensors:
    return {"": u.bfloat16().view(torch.int16)}


def _from_bf16(name: str, parts: Tensors, n: int, options: CompressionSettings) -> torch.Tensor:
    return _part(name, parts, "", torch.int16, n).view(torch.bfloat16).float()


def _to_int8(u: torch.Tensor, options: Int8Settings) -> Tensors:
    n, size = u.numel(), options.block_size
    blocks = F.pad(u, (0, -n % size)).view(-1, size)
    scale = (blocks.abs().amax(dim=1) / 127).float()
    divisor = torch.where(scale > 0, scale, 1).to(u.dtype)
    codes = (blocks / divisor[:, None]).round().clamp(-127, 127).to(torch.int8)
    return {"": codes.flatten()[:n].clone(), "scale": scale}  # a clone: the padding is not sent


def _from_int8(name: str, parts: Tensors, n: int, options: Int8Settings) -> torch.Tensor:
    size = options.block_size
    codes = _part(name, parts, "", torch.int8, n)
    scale = _part(name, parts, "scale", torch.float32, -(-n // size))
    return codes.float() * scale.repeat_interleave(size)[:n]


def kept_entries(n: int, fraction: float) -> int:
    """How many of a tensor's n entries `topk` sends."""
    return max(1, round(fraction * n)) if n else 0


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _to_topk(u: torch.Tensor, options: TopkSettings) -> Tensors:
    n = u.numel()
    index = u.abs().topk(kept_entries(n, options.fraction), sorted=False).indices.sort().values
    return {"": u[index].float(), "index": index.to(_index_dtype(n))}


def _from_topk(name: str, parts: Tensors, n: int, options: TopkSettings) -> torch.Tensor:
    k = kept_entries(n, options.fraction)
    values = _part(name, parts, "", torch.float32, k)
    index = _part(name, parts, "index", _index_dtype(n), k).long()
    if k and (index.min() < 0 or index.max() >= n):
        raise ValueError(f"{_key(name, 'index')!r}: an index outside [0, {n})")
    if bool((index[1:] <= index[:-1]).any()):
        raise ValueError(f"{_key(name, 'index')!r}: indices not strictly increasing (a duplicate or out of order)")
    out = values.new_zeros(n)
    out[index] = values
    return out


def _encode(codec: Codec, values: Tensors, ctx: TransformContext,
            options: CompressionSettings) -> tuple[Tensors, dict]:
    """C(u) for u = Δ + e per tensor; with error feedback ctx.state[name] ← u − D(C(u)). Every u is
    checked before any is coded, and the residuals are kept only once all are: a NaN or Inf kept in a
    residual would be added to every later round (int8 then sends a whole block of NaN each round),
    so such a round is refused on the silo, naming the tensor, and leaves the residuals as they were."""
    updates = {name: _with_residual(name, value, ctx, options) for name, value in values.items()}
    for name, u in updates.items():
        _refuse_non_finite(name, u, "update")
    wire: Tensors = {}
    left_of: Tensors = {}
    raw, lost, total = 0, 0.0, 0.0
    for name, u in updates.items():
        parts = codec.compress(u, options)
        left = u - codec.expand(name, parts, u.numel(), options).to(u)
        _refuse_non_finite(name, left, "coding error")
        left_of[name] = left.view(values[name].shape)
        wire.update({_key(name, part): t for part, t in parts.items()})
        raw += 4 * u.numel()
        lost += float(left.double().square().sum())
        total += float(u.double().square().sum())
    if options.error_feedback:
        ctx.state.update(left_of)
    return wire, {"bytes": nbytes(wire), "raw_bytes": raw, "error": math.sqrt(lost / total) if total else 0.0}


def _with_residual(name: str, value: torch.Tensor, ctx: TransformContext, options: CompressionSettings) -> torch.Tensor:
    """u = Δ (+ the silo's residual e under error feedback), flat, in float32 (float64 for float64)."""
    work = torch.float64 if value.dtype == torch.float64 else torch.float32
    u = (value.to(work) - ctx.reference[name].to(value.device, work)).flatten()
    if options.error_feedback and name in ctx.state:
        residual = ctx.state[name]
        if residual.shape != value.shape:
            raise ValueError(f"{name!r}: the silo's residual has shape {tuple(residual.shape)}, "
                             f"the tensor {tuple(value.shape)}")
        u = u + residual.to(u).flatten()
    return u


def _refuse_non_finite(name: str, u: torch.Tensor, what: str) -> None:
    finite = torch.isfinite(u)
    if not bool(finite.all()):
        nan = int(torch.isnan(u).sum())
        raise SiloRefused(f"the {what} of {name!r} holds {nan} NaN and {u.numel() - int(finite.sum()) - nan} Inf of "
                          f"{u.numel()} values (error feedback included): refused before coding; nothing left the "
                          "silo and its residual is unchanged")


def _decode(codec: Codec, wire: Tensors, reference: Tensors, options: CompressionSettings) -> Tensors:
    """reference[name] + D(wire) per uploaded name, in the reference's dtype and shape; a ValueError naming
    the tensor for a wire that does not decode."""
    grouped: dict[str, Tensors] = {}
    for key, t in wire.items():
        name, _, part = key.partition(SEP)
        grouped.setdefault(name, {})[part] = t
    out: Tensors = {}
    for name, parts in grouped.items():
        if name not in reference:
            raise ValueError(f"{name!r}: not a tensor the server holds")
        missing = [_key(name, p) for p in codec.parts if p not in parts]
        unknown = [_key(name, p) for p in parts if p not in codec.parts]
        if missing or unknown:
            raise ValueError(f"{name!r}: the wire lacks {missing}" if missing else
                             f"{name!r}: the wire has parts this codec does not send: {unknown}")
        ref = reference[name]
        work = torch.float64 if ref.dtype == torch.float64 else torch.float32
        delta = codec.expand(name, parts, ref.numel(), options).to(ref.device, work)
        out[name] = (ref.to(work) + delta.reshape(ref.shape)).to(ref.dtype)
    return out


# Download: the server's values themselves, coded the same way (no reference the client is sure to hold,
# so no Δ and no error feedback); the client decodes them before it starts from them.
DOWNLOAD_CODECS: Registry[Codec] = Registry("download codec")


def register_codec(name: str, parts: tuple[str, ...], compress: Callable[[torch.Tensor, Any], Tensors],
                   expand: Callable[[str, Tensors, int, Any], torch.Tensor],
                   settings: type[CompressionSettings] = CompressionSettings,
                   download: bool | type[BaseModel] = False) -> Codec:
    """A codec as `exchange.upload_transforms = [{name = NAME, …}]` (and, with `download`, as
    `exchange.download_transforms`: True takes no options there, a settings class takes its own).

    `compress(u, options) -> {part: tensor}` codes one flat update u (float32, or float64); the part ""
    travels under the tensor's own name, every other under `<tensor>::<part>` (the seam names them; a
    codec never sees a wire name). `expand(tensor, parts, n, options)` decodes n values, a ValueError
    naming `tensor` when the parts do not fit. What comes for free: Δ against what the silo received,
    error feedback (`error_feedback`, the residual kept in the silo's store, so a resume continues it),
    the server's decode against its own values, bytes counted from the wire, and under secure
    aggregation the silo's own decode before the mask (nothing is saved then: the mask's vector travels).
    `settings`: the codec's options, a CompressionSettings subclass (error_feedback is its own)."""
    codec = Codec(tuple(parts), compress, expand)
    UPLOAD_TRANSFORMS.add(name, UploadTransform(partial(_encode, codec), partial(_decode, codec),
                                                needs_reference=True), settings)
    if download:
        DOWNLOAD_CODECS.add(name, codec, None if download is True else download)
    return codec


register_codec("fp16", ("",), _to_fp16, _from_fp16, download=True)
register_codec("bf16", ("",), _to_bf16, _from_bf16, download=True)
register_codec("int8", ("", "scale"), _to_int8, _from_int8, Int8Settings, download=BlockSettings)
register_codec("topk", ("", "index"), _to_topk, _from_topk, TopkSettings)


def encode_values(codec: Policy[Codec], values: Tensors) -> Tensors:
    """The wire form of `values` (what the server sends)."""
    wire: Tensors = {}
    for name, value in values.items():
        work = torch.float64 if value.dtype == torch.float64 else torch.float32
        parts = codec.value.compress(value.detach().to(work).flatten(), codec.options)
        wire.update({_key(name, part): t for part, t in parts.items()})
    return wire


def decode_values(codec: Policy[Codec], wire: Tensors, like: Tensors) -> Tensors:
    """The values `wire` codes, shaped and typed as `like`'s tensors (a ValueError naming a tensor that
    does not decode)."""
    zeros = {k: torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape) for k, t in like.items()}
    return _decode(codec.value, wire, zeros, codec.options)
