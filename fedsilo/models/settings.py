"""`[model]`: which model a run builds, and how (the model layer's own settings; fedsilo.config
composes them into the run's config)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedsilo.core.lora import LORA_AGGREGATIONS
from fedsilo.errors import ConfigError
from fedsilo.settings import SectionError, Strict, choice, where_what

from . import MODEL_KINDS, SURGERIES


class SurgeryConfig(Strict):
    """`[model.surgery]`: a registered model surgery and its options (validated by the surgery)."""
    name: choice(SURGERIES)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _options(self) -> "SurgeryConfig":
        self.settings()
        return self

    def settings(self):
        """The surgery's validated options (None: it takes none)."""
        return SURGERIES.resolve(self.name, self.options, "model.surgery.options").options


class ModelConfig(Strict):
    kind: choice(MODEL_KINDS) | None = Field(None, description="seq2seq | encoder | causal; default: the task's")
    name: str | None = Field(None, description="a built-in model name or a local HF checkpoint folder; "
                                               "default: the task's")
    # Upper bounds above any published model's (GPT-3: 12288, T5-11B d_ff 65536): beyond them a value is
    # a typo, and torch overflows or the machine runs out of memory.
    d_model: int = Field(128, gt=0, le=2**14)
    d_ff: int = Field(256, gt=0, le=2**18)
    num_layers: int = Field(2, gt=0, le=1024)
    num_decoder_layers: int = Field(2, gt=0, le=1024)
    num_heads: int = Field(4, gt=0, le=1024)
    dropout: float = Field(0.1, ge=0, lt=1)
    device: str = Field("auto", description="auto: cuda when available, else cpu; or any torch device")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="client training and evaluation under autocast (bf16, or fp16 with a grad scaler); "
                            "weights, server aggregation and the server optimiser stay fp32")
    tf32: bool = Field(True, description="TF32 matmuls on CUDA (Ampere or newer): fp32 weights, faster matmuls")
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass instead of keeping them "
                           "(causal and seq2seq models): less memory for about a third more compute")
    quantization: Literal["none", "4bit"] = Field(
        "none", description="4bit: QLoRA, a local causal checkpoint's base weights in 4-bit NF4 (bitsandbytes, "
                            "CUDA only; pip install fedsilo[gpu]) under the lora surgery's adapters")
    surgery: SurgeryConfig | list[SurgeryConfig] | None = Field(
        None, description="a model surgery, or a list applied in order (lora first: it freezes what exists)")
    init_from: str | None = Field(None, description="start from this run directory's best.pt (the global "
                                                    "model) or a checkpoint file, e.g. a generic engine")

    @field_validator("surgery", mode="before")
    @classmethod
    def _each_surgery(cls, value: Any) -> Any:
        # each table validated on its own, so an error names model.surgery[.i].key (not the union's branches)
        if value is None or isinstance(value, SurgeryConfig):
            return value
        items = value if isinstance(value, list) else [value]
        out = []
        for i, item in enumerate(items):
            try:
                out.append(item if isinstance(item, SurgeryConfig) else SurgeryConfig.model_validate(item))
            except ValidationError as err:
                raise SectionError(where_what(err, "model.surgery" + (f"[{i}]" if isinstance(value, list) else "")))
        return out if isinstance(value, list) else out[0]

    @property
    def surgeries(self) -> tuple[SurgeryConfig, ...]:
        """The surgeries in the order they are applied."""
        if self.surgery is None:
            return ()
        return tuple(self.surgery) if isinstance(self.surgery, list) else (self.surgery,)

    @model_validator(mode="after")
    def _surgery_fits_model(self) -> "ModelConfig":
        names = [s.name for s in self.surgeries]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise SectionError(f"model.surgery: {repeated[0]!r} is listed twice")
        if "lora" in names[1:]:
            raise SectionError(f"model.surgery: list lora first (it freezes every parameter that exists when it "
                               f"runs, so it would freeze {names[0]!r}'s)")
        for surgery in self.surgeries:
            # A surgery may refuse a model by kind and name before it is built (patches: no seq2seq model).
            check = getattr(SURGERIES.entry(surgery.name).settings, "check_model", None)
            if check is not None:
                try:
                    check(self.kind, self.name)
                except ValueError as err:
                    raise SectionError(f"model.surgery: {err}") from None
        return self

    @model_validator(mode="after")
    def _memory_options_fit_model(self) -> "ModelConfig":
        if self.quantization == "4bit":
            from .lora import lora_settings  # the surgery that trains adapters over a frozen base
            lora = lora_settings(self)
            if lora is None:
                raise SectionError('model.quantization = "4bit": 4-bit weights cannot be trained (QLoRA trains LoRA '
                                   'adapters over them); add [model.surgery] name = "lora"')
            if LORA_AGGREGATIONS.get(lora.aggregation).merge:
                raise SectionError(f'model.quantization = "4bit": lora aggregation = "{lora.aggregation}" merges the '
                                   'adapters into the base weights, which are 4-bit here; use fedit or ffa')
        refusal = unsupported(self, self.kind, self.name)  # kind None: the task's, checked again by its builder
        if refusal:
            raise SectionError(refusal)
        return self


# What the built-in model kinds read of [model] (fedsilo/models/seq2seq.py, encoder.py, causal.py; names kept here
# as strings so that validating a config imports no model code). A user's own model kind reads what it
# reads: nothing is said about it.
SIZE_KEYS = ("d_model", "d_ff", "num_layers", "num_decoder_layers", "num_heads", "dropout")
_SEQ2SEQ_BUILTIN = ("tiny-t5", "minilm2bert", "transformer")
_ENCODER_BUILTIN = ("minilm", "tiny-bert")
_CAUSAL_BUILTIN = ("tiny-llama",)  # trained here from scratch
_CAUSAL_PRETRAINED = ("smollm2-135m-instruct",)  # = fedsilo.models.pretrained.PRETRAINED: a local checkpoint's rules


def default_name(kind: str | None) -> str | None:
    """The model a built-in kind builds when `model.name` is None (seq2seq: tiny-t5, encoder: minilm,
    causal: tiny-llama)."""
    return {"seq2seq": "tiny-t5", "encoder": "minilm", "causal": "tiny-llama"}.get(kind or "")


def unsupported(cfg: ModelConfig, kind: str | None, name: str | None) -> str | None:
    """One line naming the first of `cfg`'s memory options (gradient checkpointing, 4-bit weights) that
    the built-in model kind/name cannot honour; None when it can (a user's own kind reads what it reads)."""
    name = name if name is not None else default_name(kind)
    if cfg.gradient_checkpointing and kind == "encoder":
        return "model.gradient_checkpointing: not supported for model.kind = \"encoder\" (only causal and seq2seq models have it)"
    if cfg.quantization == "4bit":
        if kind in ("seq2seq", "encoder"):
            return f'model.quantization = "4bit": only for model.kind = "causal", not {kind!r}'
        if kind in ("causal", None) and name in _CAUSAL_BUILTIN:
            return (f'model.quantization = "4bit": model {name!r} is trained here from scratch, there are no '
                    'pretrained weights to quantise; 4-bit is for a local checkpoint folder (model.name)')
    return None


def refuse_unsupported(cfg: ModelConfig, kind: str) -> None:
    """`unsupported` as a ConfigError, for a builder that learns its kind only after validation (the
    task's default)."""
    refusal = unsupported(cfg, kind, cfg.name)
    if refusal:
        raise ConfigError(refusal)


def unread_sizes(kind: str | None, name: str | None) -> tuple[tuple[str, ...], str]:
    """(the `SIZE_KEYS` the built-in model `kind`/`name` never reads, why); ((), "") when it reads them
    all or the kind is not a built-in one."""
    name = name if name is not None else default_name(kind)
    if kind == "seq2seq":
        if name == "minilm2bert":  # the pretrained MiniLM encoder sets its own width, depth and heads
            return ("d_model", "num_layers", "num_heads"), "its encoder is the pretrained MiniLM-L6 (its own sizes)"
        if name not in _SEQ2SEQ_BUILTIN:
            return SIZE_KEYS, "a local checkpoint folder is loaded unchanged (its own sizes)"
    elif kind == "encoder":
        if name == "tiny-bert":
            return ("num_decoder_layers",), "an encoder has no decoder"
        if name == "minilm":
            return SIZE_KEYS, "the pretrained MiniLM-L6 is loaded with its own sizes"
        return SIZE_KEYS, "a local checkpoint folder is loaded unchanged (its own sizes)"
    elif kind == "causal":
        if name in _CAUSAL_BUILTIN:
            return ("num_decoder_layers",), "a decoder-only model's depth is num_layers"
        if name in _CAUSAL_PRETRAINED:
            return SIZE_KEYS, f"the pretrained {name} is loaded with its own sizes"
        return SIZE_KEYS, "a local checkpoint folder is loaded unchanged (its own sizes)"
    return (), ""


def reads_task_tokenizer(kind: str | None, name: str | None) -> bool:
    """Whether the model kind/name builds over the task's own tokenizer: of the built-in models only
    seq2seq `transformer` and causal `tiny-llama` do (tiny-t5 and minilm2bert use MiniLM's, a local
    checkpoint its own, an encoder never asks); a user's own kind is given it, so it may."""
    name = name if name is not None else default_name(kind)
    if kind == "seq2seq":
        return name == "transformer"
    if kind == "causal":
        return name in _CAUSAL_BUILTIN
    return kind != "encoder"
