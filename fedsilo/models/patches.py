"""FedMatch's private patches (Chen et al. 2021, §3.4; DESIGN.md §3 "FedMatch") as the model surgery
``patches``: small modules added in place to a BERT-family cross-encoder, kept private by the glob
``*patch*`` while the backbone is shared.

A patch is ``Patch(h) = V_D · g(V_E · h)`` with ``V_E = patch.down`` (Linear d → d_s, bias) and
``V_D = patch.up`` (Linear d_s → d, bias), d_s = ``size``. Two forms of g (``kind``):

- ``lowrank``: g = GELU, so ``Patch(h) = V_D · GELU(V_E·h + b_E) + b_D`` — the bottleneck
  feed-forward of the authors' code (``BERTLowRank``: aug_dense → gelu → aug_dense2) and of
  Stickland & Murray's low-rank layer. No extra d_s × d_s matrix: the low rank *is* V_E, V_D.
- ``pal``: g = multi-head self-attention in the d_s space over the sequence (Stickland & Murray's
  Projected Attention Layer, as the authors' ``BERTPals``): queries, keys and values are Linear
  d_s → d_s (bias) over ``heads`` heads, softmax(q·kᵀ/√(d_s/heads)) with padding keys masked out,
  no output matrix (V_D is it). The authors also apply a GELU after V_D; we follow the formula
  above (no activation after V_D).

Insertion (``insertion``), for each BERT layer with input h, attention sublayer
``SA(h) = LN₁(drop(dense₁(MH(h))) + h)`` and FFN sublayer ``BL(h) = LN₂(drop(dense₂(FFN(a))) + a)``,
a = SA(h):

- ``inner`` (paper Fig. 3b; two patches per layer, at ``attention.output.patch`` and
  ``output.patch``): after each output projection, inside the residual:
  ``x = dense₁(MH(h)); SA(h) = LN₁(drop(x + Patch₁(x)) + h)`` and
  ``y = dense₂(FFN(a)); BL(h) = LN₂(drop(y + Patch₂(y)) + a)``.
  (A forward hook on each ``dense``; the paper writes ``LN(Patch(MH(h)) + h)``, which would drop
  the backbone's own output at start — the residual ``x + Patch(x)`` keeps the model unchanged
  while V_D = 0, as the authors' Houlsby-style code does.)
- ``outer`` (Fig. 3c; at ``attention.output.patch`` and ``output.patch``): parallel to each
  sublayer, fed its input: ``SA(h) = LN₁(drop(dense₁(MH(h))) + h + Patch₁(h))`` and
  ``BL(h) = LN₂(drop(dense₂(FFN(a))) + a + Patch₂(a))`` (a forward pre-hook adds the patch to the
  residual input of ``attention.output`` / ``output``).
- ``horizontal`` (Fig. 3e; one patch per layer, at ``encoder.layer.i.patch``): parallel to the
  whole layer, outside its LayerNorm: ``BL'(h) = BL(h) + Patch(h)`` (a forward hook on the layer).
  The authors' code (``mult``) adds Patch(h) *inside* the last LayerNorm instead; we follow the
  paper's formula.
- ``vertical`` (Fig. 3d, the paper's formula; one patch for the model, at ``bert.encoder.patch``): a
  patch following the topmost layer, ``H = BL_top(h) + Patch(BL_top(h))`` (a forward hook on
  ``bert.encoder``). The paper writes ``BL_top(h) = Patch(BL_top(h))``, a replacement; read
  literally, the model's output would become a rank-d_s projection of the top states — all zeros
  at ``init = "zero"`` (every pair would get the same score), random noise at ``"random"`` — so the
  pretrained model would be destroyed before training starts. We read it, as ``inner``, with the
  residual that the paper's "adapting existing BERT representation" (§3.4) implies.
- ``vertical_code`` (the authors' code, ``BertModel.forward`` in ``src/modeling.py``; one patch, at
  ``bert.patch``): a side branch from the embeddings summed with the top layer's output,
  ``H = BL_top(·) + Patch(E)``, E = the output of ``bert.embeddings`` (a forward hook on
  ``bert.encoder``). The authors then apply a new LayerNorm to the sum; we leave it out, since a
  fresh LayerNorm would change the model's output at start (and re-normalises what the top layer
  already normalised). This is the variant the authors ran (their configs all set
  ``vertical_low_rank``).

Naming: the insertion names follow the paper's Fig. 3 / §3.4.1 formulas (as ``inner``, ``outer``,
``horizontal`` do), so ``vertical`` is the paper's form and the authors' code form carries the
explicit suffix. Until this split, ``vertical`` meant the code form; every config and doc of this
repository that named it now says ``vertical_code``. The two forms keep their patch at different
paths (``bert.encoder.patch`` / ``bert.patch``), so a state saved under the old meaning of
``vertical`` does not load silently into the new one (a strict load reports the names).

Initialisation (``init``): V_E's and g's weights are drawn from N(0, initializer_range²) (the model
config's, 0.02 by default, as BERT's own init), their biases are zero, from a ``torch.Generator``
seeded with ``seed`` (torch's global generator is not touched; the same seed gives the same patches
on every device). V_D depends on ``init``:

- ``zero`` (default): V_D weight and bias are zero, so right after surgery the model computes
  exactly what it computed before.
- ``random``: V_D's weight is drawn like V_E's (same generator, N(0, initializer_range²), drawn
  after the patch's other weights), its bias is zero. The paper: "β_t is randomly initialized"
  (§3.5). The authors' code does the same: ``BERT.__init__`` (``src/bert.py``) applies
  ``init_weights`` (every ``nn.Linear`` weight ~ N(0, initializer_range²), bias 0) and then loads
  the pretrained checkpoint with ``strict=False``, so ``aug_dense2`` (V_D) keeps its random draw.
  The model's output moves slightly at start.

``zero`` stays the default although the paper and the code both draw V_D at random: every config
written before the option existed keeps its meaning (the QA study's numbers were made with it), and
a patched model then starts as the model it patches; a paper recipe sets ``init = "random"``. The
``zero`` draws are unchanged by the option (V_D draws nothing there). Patches have no dropout.
Parameter names all contain the segment ``patch`` (``bert.encoder.layer.3.patch.down.weight``,
``bert.patch.up.bias``, ...); the surgery refuses a model whose own tensor names already contain
"patch".

PAL and padding: a forward pre-hook on ``bert`` records the 2-D ``attention_mask`` (batch, seq)
the model was called with (None: every token is attended to); PAL patches read it from there, so
transformers' internal mask formats (4-D, additive, SDPA, ...) never matter. The latest call's
mask stays recorded (a gradient-checkpointing recomputation of a layer still finds it); a PAL
patch refuses a recorded mask whose shape does not match its input. Only plain 0/1 (or bool)
2-D masks are supported for PAL.

Models: patches go into a BERT-family cross-encoder (``model.kind = "encoder"``: ``minilm``,
``tiny-bert`` or a local BERT checkpoint); a seq2seq model (T5, BART, Marian, ``minilm2bert``) has no
``bert.encoder.layer`` to patch and is refused by name when the config is validated where the config
names it, else when the surgery runs. ``size`` is at most ``MAX_SIZE`` (the bound of
``model.d_model``) when the config is validated, and at most the model's hidden size d when the
surgery runs: a patch projects the hidden states *down* to d_s, and a bound that only the allocator
enforces would be a traceback (``size = 10**12`` asks for 4·10¹² bytes).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from fedsilo.errors import SurgeryError

KINDS = ("lowrank", "pal")
INSERTIONS = ("inner", "outer", "vertical", "vertical_code", "horizontal")
INITS = ("zero", "random")
MAX_SIZE = 2**14  # = the bound of model.d_model: no patch is wider than the widest model fedsilo builds
SEQ2SEQ_NAMES = ("tiny-t5", "minilm2bert", "transformer")  # fedsilo.models.seq2seq.BUILTIN (not imported: transformers)
SUPPORTED = ('a BERT-family cross-encoder (model.kind = "encoder": minilm, tiny-bert or a local BERT '
             'checkpoint)')


class PatchSettings(BaseModel):
    """``[model.surgery] name = "patches"`` options."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lowrank", "pal"] = Field("lowrank", description="g: lowrank (GELU bottleneck) or pal "
                                                                   "(attention in the d_s space)")
    insertion: Literal["inner", "outer", "vertical", "vertical_code", "horizontal"] = Field(
        "horizontal", description="where the patches sit (FedMatch Fig. 3; vertical_code: the authors' code)")
    init: Literal["zero", "random"] = Field(
        "zero", description="V_D's start: zero (the model is unchanged at start) or random (the paper, §3.5)")
    size: int = Field(128, gt=0, le=MAX_SIZE, description="d_s, the patch's projection size (at most the model's "
                                                           "hidden size)")
    heads: int = Field(4, gt=0, description="attention heads of a pal patch")

    @model_validator(mode="after")
    def _heads_divide_size(self) -> PatchSettings:
        if self.kind == "pal" and self.size % self.heads:
            raise ValueError(f"patches: size = {self.size} is not a multiple of heads = {self.heads} (pal)")
        return self

    @staticmethod
    def check_model(kind: str | None, name: str | None) -> None:
        """Refuse a model the config names as seq2seq before it is built (the config calls this)."""
        if kind == "seq2seq" or (kind is None and name in SEQ2SEQ_NAMES):
            what = f"model.name = {name!r}" if name in SEQ2SEQ_NAMES else 'model.kind = "seq2seq"'
            raise ValueError(f"patches need {SUPPORTED}, not a seq2seq model ({what})")


class _MaskRecorder:
    """Forward pre-hook on ``model.bert``: records the 2-D padding mask of the latest call."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def __call__(self, module, args, kwargs):
        if "attention_mask" in kwargs:
            self.mask = kwargs["attention_mask"]
        elif len(args) > 1:  # BertModel.forward(input_ids, attention_mask, ...)
            self.mask = args[1]
        else:
            self.mask = None

    def keep(self, h: torch.Tensor) -> torch.Tensor | None:
        """(batch, seq) bool, True where a token may be attended to; None when every token may."""
        mask = self.mask
        if mask is None:
            return None
        if mask.dim() != 2 or tuple(mask.shape) != tuple(h.shape[:2]):
            raise ValueError(f"patches (pal): the recorded attention_mask has shape {tuple(mask.shape)}, but the "
                             f"patch's input is {tuple(h.shape[:2])} (batch, seq); pal patches need the 2-D "
                             "padding mask the model was called with")
        return mask.to(device=h.device) != 0


class Patch(nn.Module):
    """``V_D · g(V_E · h)`` on (..., d) inputs (``pal``: on (batch, seq, d))."""

    def __init__(self, d: int, settings: PatchSettings, recorder: _MaskRecorder, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        s = settings.size
        self.kind = settings.kind
        self.heads = settings.heads
        self.recorder = recorder  # a plain attribute, not a module: shared by the model's patches
        meta = {"device": "meta", "dtype": dtype}  # no init here: no draw from torch's global generator
        self.down = nn.Linear(d, s, **meta)  # V_E
        if self.kind == "pal":
            self.query = nn.Linear(s, s, **meta)
            self.key = nn.Linear(s, s, **meta)
            self.value = nn.Linear(s, s, **meta)
        self.up = nn.Linear(s, d, **meta)  # V_D
        self.to_empty(device=device)

    @torch.no_grad()
    def reset(self, gen: torch.Generator, std: float, init: str = "zero") -> None:
        """Seeded init: V_E and g weights ~ N(0, std²), their biases 0; V_D's weight 0 (``zero``) or
        ~ N(0, std²) drawn last (``random``: the ``zero`` draws stay what they were), its bias 0."""
        drawn = self._random() + ([self.up] if init == "random" else [])
        for lin in drawn:
            w = torch.randn(lin.weight.shape, generator=gen, dtype=torch.float32) * std
            lin.weight.copy_(w)
            lin.bias.zero_()
        if init != "random":
            self.up.weight.zero_()
        self.up.bias.zero_()

    def _random(self) -> list[nn.Linear]:
        return [self.down] + ([self.query, self.key, self.value] if self.kind == "pal" else [])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.down(h)
        x = F.gelu(x) if self.kind == "lowrank" else self._attend(x, self.recorder.keep(h))
        return self.up(x)

    def _attend(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"patches (pal): expected (batch, seq, d) hidden states, got shape {tuple(x.shape)}")
        b, t, s = x.shape
        hd = s // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, hd).transpose(1, 2)  # (b, heads, t, hd)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
        if keep is not None:  # a finite minimum, not -inf: a row with no valid key stays finite
            scores = scores.masked_fill(~keep[:, None, None, :], torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return out.transpose(1, 2).reshape(b, t, s)


# ---- hooks (module-level classes: a patched model deep-copies and pickles) -----------------

def _add_to_hidden(output: Any, delta: torch.Tensor) -> Any:
    """``output`` with ``delta`` added to its hidden states (a tensor, a tuple's first item, or a
    ModelOutput's ``last_hidden_state``)."""
    if isinstance(output, torch.Tensor):
        return output + delta
    if hasattr(output, "last_hidden_state"):
        output.last_hidden_state = output.last_hidden_state + delta
        return output
    if isinstance(output, tuple):
        return (output[0] + delta, *output[1:])
    raise TypeError(f"patches: cannot add a patch to an output of type {type(output).__name__}")


def _first(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    raise TypeError(f"patches: no {name!r} argument to patch")


class _Inner:
    """Forward hook on a sublayer's output projection ``dense``: x ↦ x + Patch(x)."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, output):
        return output + self.patch(output)


class _Outer:
    """Forward pre-hook on ``attention.output`` / ``output`` (forward(hidden_states, input_tensor)):
    the residual input a becomes a + Patch(a), so the output is LN(drop(dense(·)) + a + Patch(a))."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, kwargs):
        if len(args) >= 2:
            a = args[1]
            return (args[0], a + self.patch(a), *args[2:]), kwargs
        if "input_tensor" in kwargs:
            a = kwargs["input_tensor"]
            return args, {**kwargs, "input_tensor": a + self.patch(a)}
        raise TypeError(f"patches (outer): {type(module).__name__} was called without its residual input")


def _hidden(output: Any) -> torch.Tensor:
    """The hidden states of a module's output (a tensor, a ModelOutput, or a tuple's first item)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    if isinstance(output, tuple):
        return output[0]
    raise TypeError(f"patches: cannot read hidden states from an output of type {type(output).__name__}")


class _Follow:
    """Forward hook on the encoder (vertical, the paper's form): H ↦ H + Patch(H)."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, kwargs, output):
        return _add_to_hidden(output, self.patch(_hidden(output)))


class _Parallel:
    """Forward hook on a layer (horizontal) or on the encoder (vertical_code): output + Patch(input)."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, kwargs, output):
        return _add_to_hidden(output, self.patch(_first(args, kwargs, "hidden_states")))


# ---- the surgery -----------------------------------------------------------------------------

_LAYER_PARTS = ("attention.self", "attention.output.dense", "attention.output.dropout",
                "attention.output.LayerNorm", "intermediate", "output.dense", "output.dropout",
                "output.LayerNorm")


def _get(root: nn.Module, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _layers(model: nn.Module) -> list[nn.Module]:
    """The BERT layers, after checking the model has every part the patches use."""
    def missing(what: str) -> SurgeryError:
        return SurgeryError(f"model.surgery: patches need {SUPPORTED}; the model ({type(model).__name__}) is not "
                            f"a BERT-family cross-encoder: it has no `{what}`")

    for path in ("bert", "bert.embeddings", "bert.encoder", "bert.encoder.layer"):
        if not isinstance(_get(model, path), nn.Module):
            raise missing(path)
    layers = list(model.bert.encoder.layer)
    if not layers:
        raise missing("bert.encoder.layer[0]")
    for i, layer in enumerate(layers):
        for part in _LAYER_PARTS:
            if not isinstance(_get(layer, part), nn.Module):
                raise missing(f"bert.encoder.layer[{i}].{part}")
        for part in ("attention.output.dense", "output.dense"):
            if not isinstance(_get(layer, part), nn.Linear):
                raise SurgeryError(f"patches: bert.encoder.layer[{i}].{part} is a "
                                   f"{type(_get(layer, part)).__name__}, not a torch.nn.Linear")
    return layers


def patch_parameter_count(model: nn.Module) -> int:
    """Number of patch parameters (names containing "patch")."""
    return sum(p.numel() for n, p in model.named_parameters() if "patch" in n)


def apply_patches(model: nn.Module, settings: PatchSettings | None, seed: int) -> None:
    """The ``patches`` surgery: add FedMatch patches to ``model`` in place (see the module docstring)."""
    settings = settings if settings is not None else PatchSettings()
    if not isinstance(settings, PatchSettings):
        raise TypeError(f"patches: settings must be PatchSettings, not {type(settings).__name__}")
    layers = _layers(model)
    taken = [n for n, _ in (*model.named_parameters(), *model.named_buffers()) if "patch" in n]
    if taken:
        raise SurgeryError(f"patches: the model already has tensors named like patches ({taken[0]!r}"
                         f"{f' and {len(taken) - 1} more' if len(taken) > 1 else ''}); the glob *patch* would not "
                         "separate the patches from the backbone (was the surgery applied twice?)")

    ref = layers[-1].output.dense.weight
    d = layers[-1].output.dense.out_features
    for i, layer in enumerate(layers):
        if layer.attention.output.dense.out_features != d or layer.output.dense.out_features != d:
            raise SurgeryError(f"patches: bert.encoder.layer[{i}] does not map to the hidden size {d}")
    if settings.size > d:
        raise SurgeryError(f"model.surgery.options.size = {settings.size} is larger than the model's hidden size "
                           f"d = {d}: a patch projects the hidden states down to size (V_E: d → d_s)")
    config = getattr(model, "config", None)
    if settings.kind == "pal" and settings.insertion in ("inner", "outer") \
            and getattr(config, "chunk_size_feed_forward", 0):
        raise SurgeryError("patches: pal patches inside the feed-forward sublayer need the whole sequence; "
                         f"the model chunks it (config.chunk_size_feed_forward = {config.chunk_size_feed_forward})")
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)

    recorder = _MaskRecorder()
    gen = torch.Generator().manual_seed(seed)

    def new_patch() -> Patch:
        patch = Patch(d, settings, recorder, device=ref.device, dtype=ref.dtype)
        patch.reset(gen, std, settings.init)
        return patch

    def attach(owner: nn.Module, where: str) -> Patch:
        if hasattr(owner, "patch"):
            raise SurgeryError(f"patches: {where} already has an attribute named 'patch'")
        owner.patch = new_patch()
        return owner.patch

    model.bert.register_forward_pre_hook(recorder, with_kwargs=True)
    if settings.insertion == "vertical":
        patch = attach(model.bert.encoder, "bert.encoder")
        model.bert.encoder.register_forward_hook(_Follow(patch), with_kwargs=True)
        return
    if settings.insertion == "vertical_code":
        patch = attach(model.bert, "bert")
        model.bert.encoder.register_forward_hook(_Parallel(patch), with_kwargs=True)
        return
    for i, layer in enumerate(layers):
        where = f"bert.encoder.layer[{i}]"
        if settings.insertion == "horizontal":
            layer.register_forward_hook(_Parallel(attach(layer, where)), with_kwargs=True)
            continue
        for sub, name in ((layer.attention.output, "attention.output"), (layer.output, "output")):
            patch = attach(sub, f"{where}.{name}")
            if settings.insertion == "inner":
                sub.dense.register_forward_hook(_Inner(patch))
            else:
                sub.register_forward_pre_hook(_Outer(patch), with_kwargs=True)
