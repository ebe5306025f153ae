"""Controllers (Roosta et al. 2021), the baseline of Dynamic Pulling's Table 7, as the model surgery
``controllers``: fresh Transformer layers inserted into the encoder and the decoder of a Marian- or
BART-style seq2seq model; only they are exchanged (``[exchange] shared = ["*controller*"]``).

The paper's *8E8D (0-6)*: "four additional layers (two for the encoder and two for the decoder) are
defined which are placed after layers 0 and 6. This means, in an 8-layer encoder/decoder the first
and seventh layers are Controllers". We read the layer numbers in the 8-layer stack: a controller
after its layer 0 and after its layer 6, i.e. on a 6+6 base ``after = [0, 5]`` (after the base's
first and last layers), giving b0 C b1 b2 b3 b4 b5 C. (The other reading, controllers *at*
positions 0 and 6, puts one before every base layer; the two differ only in where the first sits.)
*6E6D (0-3)* needs no surgery: base layers 0 and 3 are exchanged (`experiments/nmt/controllers.toml`).

A controller is a new layer of the model's own layer class, initialised by the model's own
``_init_weights`` under ``seed`` (torch's global generator is left as it was). It sits in the layer
stack under its own name, ``...layers.controller0``, ``...layers.controller1`` (so a base model's
checkpoint — ``model.init_from``, the generic engine — still loads into the base layers by name,
and the controllers start fresh). The model's config then counts the new layers, and decoder
layers are renumbered for the generation cache.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from fedsilo.errors import SurgeryError


class ControllerSettings(BaseModel):
    """``[model.surgery] name = "controllers"`` options."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    after: list[int] = Field(description="base layers (0-based) after which a controller is inserted, in the "
                                         "encoder and in the decoder; 8E8D (0-6) of a 6+6 base: [0, 5]")

    @field_validator("after")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("controllers: `after` names no layer")
        if any(i < 0 for i in v) or len(set(v)) != len(v):
            raise ValueError(f"controllers: `after` = {v} must be distinct layer indices ≥ 0")
        return sorted(v)


class NamedStack(nn.ModuleList):
    """A layer list whose entries keep their own names (``3``, ``controller0``); indexing is positional."""

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for key, module in named:
            self.add_module(key, module)

    def __getitem__(self, idx):
        layers = list(self._modules.values())
        return nn.ModuleList(layers[idx]) if isinstance(idx, slice) else layers[idx]


def _stacks(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    try:
        encoder, decoder = model.get_encoder(), model.get_decoder()
        if isinstance(encoder.layers, nn.ModuleList) and isinstance(decoder.layers, nn.ModuleList):
            return encoder, decoder
    except AttributeError:
        pass
    raise SurgeryError(f"controllers: {type(model).__name__} has no encoder.layers / decoder.layers (a Marian- or "
                     "BART-style seq2seq model is needed: model.name = \"transformer\" or such a checkpoint)")


def _fresh_like(layer: nn.Module, config) -> nn.Module:
    try:
        return type(layer)(config, layer_idx=0)  # renumbered below; decoder layers need one
    except TypeError:
        return type(layer)(config)


def apply_controllers(model: nn.Module, settings: ControllerSettings, seed: int) -> None:
    """The ``controllers`` surgery (see the module docstring), in place."""
    encoder, decoder = _stacks(model)
    taken = [n for n, _ in model.named_parameters() if "controller" in n]
    if taken:
        raise SurgeryError(f"controllers: the model already has tensors named like controllers ({taken[0]!r}); "
                         "was the surgery applied twice?")
    for name, stack in (("encoder", encoder), ("decoder", decoder)):
        too_far = [i for i in settings.after if i >= len(stack.layers)]
        if too_far:
            raise SurgeryError(f"controllers: after = {too_far[0]}, but the {name} has {len(stack.layers)} layers")
    ref = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for stack in (encoder, decoder):
            named, made = [], 0
            for i, layer in enumerate(stack.layers):
                named.append((str(i), layer))
                if i in settings.after:
                    fresh = _fresh_like(layer, model.config).to(device=ref.device, dtype=ref.dtype)
                    fresh.apply(model._init_weights)
                    named.append((f"controller{made}", fresh))
                    made += 1
            stack.layers = NamedStack(named)
    for position, layer in enumerate(decoder.layers):  # the generation cache is indexed by position
        for attention in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)):
            if attention is not None and hasattr(attention, "layer_idx"):
                attention.layer_idx = position
    for key, stack in (("encoder_layers", encoder), ("decoder_layers", decoder)):
        if hasattr(model.config, key):
            setattr(model.config, key, len(stack.layers))
