"""What leaves a silo: an ordered chain of upload transforms, and the silo's own checks.

After local training a client has the values of the shared tensors it will upload (chosen by the
upload selector). Each transform of `exchange.upload_transforms`, in order, may change them before
they are sent — clip the update, add noise, quantise, mask — and returns a small record of what it did
(rounds.jsonl keeps it per client). The server undoes the chain in reverse order (`decode`: unmask,
dequantise; identity for a transform that needs nothing undone) before it forms Δ_i = w_i − w. A decode
is given the server's values of the tensors (the reference the client's Δ was taken against), so a codec
may send Δ alone (compressed) and the server add it back.

A transform may keep state on the silo between rounds (`TransformContext.state`, e.g. the residual
error feedback carries into the next round): the silo stores it with its other state, so a resumed run
continues with the same residual.

A transform sees the update Δ = sent − reference, where the reference is what the client received
this round (the server's global values), so every uploaded tensor must have been received: a
transform that reads Δ (`needs_reference`) refuses a plan whose download policy may leave one out.

A silo check (`client.upload_checks`) runs on the silo before it trains: it sees the round's
instructions (the plan's upload chain, the round) and may refuse the round with a reason; then nothing
is trained and nothing leaves the silo. The privacy issue's silo policy is such a check.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedsilo.registry import Policy, Registry

from .tensors import Tensors


@dataclass(frozen=True)
class TransformContext:
    round: int
    client: str
    reference: Tensors  # what the client received this round: the server's values of these tensors
    seed: int = 0
    state: Tensors = field(default_factory=dict)  # this transform's own tensors kept on the silo (in place)


@dataclass(frozen=True)
class UploadTransform:
    """encode(values, ctx, options) -> (values to send, record) on the client; decode(values, reference,
    options) -> values on the server, `reference` being its own values of those tensors (None: nothing
    to undo)."""
    encode: Callable[[Tensors, TransformContext, BaseModel | None], tuple[Tensors, dict]]
    decode: Callable[[Tensors, Tensors, BaseModel | None], Tensors] | None = None
    needs_reference: bool = True  # reads Δ = values − what the client received
    bound: Callable[[BaseModel | None], float] | None = None  # the L2 bound it clips the update to (a silo's
                                                             # require_clip check reads it)


UPLOAD_TRANSFORMS: Registry[UploadTransform] = Registry("upload transform")


def update_norm(values: Tensors, reference: Tensors) -> float:
    """‖values − reference‖₂ over all tensors, accumulated in float64."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(values[k] - reference[k], dtype=torch.float64)) ** 2
                         for k in values))


class ClipSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_norm: float = Field(gt=0, allow_inf_nan=False, description="the update's L2 bound C, over all uploaded tensors")


def _clip(values: Tensors, ctx: TransformContext, options: ClipSettings) -> tuple[Tensors, dict]:
    """Δ ← Δ·min(1, C/‖Δ‖): the update leaves the silo already bounded (the server's
    `federation.clip_norm` bounds it only on arrival)."""
    norm = update_norm(values, ctx.reference)
    if norm <= options.max_norm:
        return values, {"norm": norm, "clipped": False}
    scale = options.max_norm / norm
    out = {k: ctx.reference[k] + (t - ctx.reference[k]) * scale for k, t in values.items()}
    return out, {"norm": norm, "clipped": True}


UPLOAD_TRANSFORMS.add("clip", UploadTransform(_clip, bound=lambda options: options.max_norm), ClipSettings)


def encode(chain: Sequence[Policy[UploadTransform]], values: Tensors, ctx: TransformContext,
           states: Sequence[Tensors] | None = None) -> tuple[Tensors, list[dict]]:
    """The chain applied in order; one record per transform ({"name": …, **what it did}). `states[i]`:
    transform i's kept tensors (updated in place; default: none kept)."""
    missing = [k for k in values if k not in ctx.reference] if any(p.value.needs_reference for p in chain) else []
    if missing:
        raise ValueError(f"upload transforms need the received value of every uploaded tensor; "
                         f"{ctx.client} did not receive {missing[:3]} this round")
    records = []
    for i, policy in enumerate(chain):
        step = dataclasses.replace(ctx, state=states[i] if states is not None else {})
        values, record = policy.value.encode(values, step, policy.options)
        records.append({"name": policy.name, **record})
    return values, records


def decode(chain: Sequence[Policy[UploadTransform]], values: Tensors, reference: Tensors) -> Tensors:
    """The server's side: each transform's decode, in reverse order, against the server's own values."""
    for policy in reversed(chain):
        if policy.value.decode is not None:
            values = policy.value.decode(values, reference, policy.options)
    return values


@dataclass(frozen=True)
class RoundInstructions:
    """What a silo is asked to do this round, as its checks see it before anything is trained or sent."""
    round: int
    client: str
    upload_transforms: tuple[Policy[UploadTransform], ...]


class SiloRefused(Exception):
    """A silo's check refused the round: nothing was trained, nothing left the silo."""
    final = False  # True: the silo will refuse every later round too (its privacy budget is spent)


# check(instructions, options) -> a reason to refuse the round, or None
SiloCheck = Callable[[RoundInstructions, BaseModel | None], str | None]
SILO_CHECKS: Registry[SiloCheck] = Registry("silo check")


class RequireClipSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_norm: float = Field(gt=0, allow_inf_nan=False, description="the largest clip bound the silo accepts")


def _require_clip(ins: RoundInstructions, options: RequireClipSettings) -> str | None:
    """The silo sends only updates clipped on its side at most to `max_norm`."""
    bounds = [p.value.bound(p.options) for p in ins.upload_transforms if p.value.bound is not None]
    if not bounds:
        return f"the silo requires its update clipped before it leaves (at most {options.max_norm:g}); " \
               "the round's upload transforms do not clip"
    if min(bounds) > options.max_norm:
        return f"the silo requires a clip bound of at most {options.max_norm:g}; the round clips at {min(bounds):g}"
    return None


SILO_CHECKS.add("require_clip", _require_clip, RequireClipSettings)


def refusal(checks: Sequence[Policy[SiloCheck]], ins: RoundInstructions) -> str | None:
    """The first check's reason to refuse the round (naming the check), or None."""
    for check in checks:
        reason = check.value(ins, check.options)
        if reason:
            return f"{check.name}: {reason}"
    return None
