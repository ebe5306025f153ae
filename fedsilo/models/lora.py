"""LoRA as the model surgery ``lora``: peft's adapter layers injected in place into any model fedsilo
builds (the MiniLM cross-encoder, tiny-bert, minilm2bert, tiny-t5, the Marian-shaped transformer,
tiny-llama, a local Hugging Face checkpoint; QLoRA: a causal checkpoint's 4-bit weights, see
fedsilo.models.causal). The base model is frozen, so only the adapters — and the task head
when it trains — are federated parameters (fedsilo.client.silo.federated_parameters): the rest never
leaves a silo and is never stored per silo.

- Layers: ``target_modules`` (peft's names, e.g. ``["query", "value"]``); by default peft's own choice
  for the architecture (BERT: query, value; T5: q, v; Marian and Llama: q_proj, v_proj; an
  encoder-decoder of BERTs: query, value).
- Start: A ~ U(−1/√in, 1/√in) (peft's Kaiming-uniform bound) drawn from a generator seeded with the
  run's seed, B = 0, so the model computes what the base computes and every engine and silo starts
  from the same adapters (torch's global generator is not touched).
- Head (``head``): ``shared`` (trained and averaged), ``private`` (trained, kept by each silo: the
  exchange plan makes it private) or ``frozen``. Default: shared on an encoder (its classifier is
  new and must train), frozen on a seq2seq or causal language model (its LM head is tied to the
  embeddings). A trained head is peft's ``modules_to_save`` copy (``classifier.modules_to_save.default.*``;
  a language model's: ``lm_head.modules_to_save.default.*``, untied from the frozen embeddings).
- ``aggregation``: a fedsilo.core.lora policy (fedit, ffa, exact). ``ffa`` freezes A; ``exact`` makes
  the adapted base weights travel down (``RECEIVED_ONLY``) so the server can merge into them.
- ``ranks``: a rank per silo at most ``rank`` (heterogeneous ranks; see fedsilo.core.lora.limit_rank).

Other surgeries go after ``lora`` in ``model.surgery`` (FedMatch patches: private patches over shared
adapters): LoRA freezes every parameter that exists when it runs.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedsilo.core.lora import LORA_AGGREGATIONS, pairs
from fedsilo.errors import SurgeryError
from fedsilo.settings import choice

MAX_RANK = 2**14  # = the bound of model.d_model
RECEIVED_ONLY = "fedsilo_received_only"  # model attribute: frozen tensors the server still sends (exact merge)
_HEADS = ("classifier", "score")  # a sequence-classification model's head (peft's own list)


class LoraSettings(BaseModel):
    """``[model.surgery] name = "lora"`` options."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, gt=0, le=MAX_RANK, description="r, the adapters' rank (the largest any silo trains)")
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False, description="the scaling is alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | None = Field(None, min_length=1, description="layers to adapt (peft's names); "
                                                                            "default: peft's for the architecture, else the attention's query and value")
    head: Literal["shared", "private", "frozen"] | None = Field(
        None, description="the task head: shared, private or frozen (default: shared on an encoder, frozen on "
                          "a seq2seq or causal language model)")
    aggregation: choice(LORA_AGGREGATIONS) = Field("fedit", description="fedit (A, B averaged apart), ffa (A frozen), "
                                                                        "exact (Σ pᵢ·BᵢAᵢ merged into the base)")
    ranks: dict[str, int] = Field(default_factory=dict, description="a silo's own rank (≤ rank)")

    @model_validator(mode="after")
    def _ranks_fit(self) -> LoraSettings:
        for silo, r in self.ranks.items():
            if not 0 < r <= self.rank:
                raise ValueError(f"lora: ranks.{silo} = {r} is not between 1 and rank = {self.rank}")
        return self

    @property
    def head_private(self) -> bool:
        """Each silo keeps its own head (the exchange plan makes it private)."""
        return self.head == "private"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _default_targets(model: torch.nn.Module) -> list[str]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind == "encoder-decoder":  # minilm2bert: BERT encoder and decoder
        kind = config.encoder.model_type
    if kind in TARGETS:
        return list(TARGETS[kind])
    leaves = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for pair in (("q_proj", "v_proj"), ("query", "value"), ("q", "v")):  # attention's query and value (Marian: q_proj)
        if set(pair) <= leaves:
            return list(pair)
    raise SurgeryError(f"lora: no default layers for a {kind or type(model).__name__} model; set "
                       "model.surgery.options.target_modules (e.g. [\"q_proj\", \"v_proj\"])")


def _head(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    is_seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    classifier = [n for n in _HEADS if isinstance(getattr(model, n, None), torch.nn.Module)]
    lm_head = ["lm_head"] if isinstance(getattr(model, "lm_head", None), torch.nn.Module) else []
    language_model = is_seq2seq or bool(lm_head and not classifier)  # a causal LM: lm_head, no classifier
    head = settings.head or ("frozen" if language_model else "shared")
    if head == "frozen":
        return []
    names = classifier or lm_head
    if not names:
        raise SurgeryError(f"lora: head = {head!r}, but the model has no classifier, score or lm_head module; "
                           "set head = \"frozen\"")
    return names


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> None:
    """Inject peft LoRA layers in place, freeze the rest, draw A from `seed` (see the module doc)."""
    from peft import LoraConfig, inject_adapter_in_model

    if any(".lora_" in n for n, _ in model.named_parameters()):
        raise SurgeryError("lora: the model already has LoRA layers")
    targets = settings.target_modules or _default_targets(model)
    modules = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in modules)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise SurgeryError(f"lora: target_modules {missing} name no layer of this model; its linear layers are "
                           f"called {', '.join(linear[:12])}")
    head = _head(model, settings)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, modules_to_save=head or None, bias="none")
    try:
        with torch.random.fork_rng(devices=[]):  # peft draws its own start from torch's generator; ours replaces it
            inject_adapter_in_model(config, model)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise SurgeryError(f"lora: {err}") from None
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    aggregation = LORA_AGGREGATIONS.get(settings.aggregation)
    with torch.no_grad():
        for p in pairs(params):
            a = params[p.a]
            bound = 1 / math.sqrt(a.shape[1])
            a.copy_(torch.rand(a.shape, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound))
            params[p.b].zero_()
            if aggregation.freeze_a:
                a.requires_grad_(False)
    if aggregation.merge:
        setattr(model, RECEIVED_ONLY, tuple(p.base for p in pairs(params)))


def lora_settings(model_cfg) -> LoraSettings | None:
    """The run's LoRA settings, when its model has the surgery."""
    for surgery in model_cfg.surgeries:
        settings = surgery.settings()
        if isinstance(settings, LoraSettings):
            return settings
    return None
