"""Model plug-ins: model kinds (how a config becomes a model + tokenizer) and model surgeries
(modules inserted after building, e.g. FedMatch patches), each a registry. Builders import
transformers lazily, so validating a config stays cheap."""
from __future__ import annotations

from collections.abc import Callable

from fedsilo.registry import Registry

from .controllers import ControllerSettings, apply_controllers
from .lora import LoraSettings, apply_lora  # peft is imported when the surgery runs
from .patches import PatchSettings, apply_patches  # torch and pydantic only: transformers stays lazy

# kind(model config, seed, task_tokenizer) -> (model, tokenizer); task_tokenizer() gives the task's own
# tokenizer (or None when it has none), for built-in models trained from scratch on that task
MODEL_KINDS: Registry[Callable] = Registry("model kind")
# surgery(model, settings, seed) -> None (in place); applied identically by every engine
SURGERIES: Registry[Callable] = Registry("model surgery")


def _seq2seq(cfg, seed, task_tokenizer=None):
    from .seq2seq import build_seq2seq
    from .settings import refuse_unsupported
    refuse_unsupported(cfg, "seq2seq")  # a task's default kind is known only now
    return build_seq2seq(cfg, seed, task_tokenizer)


def _encoder(cfg, seed, task_tokenizer=None):
    from .encoder import build_encoder
    from .settings import refuse_unsupported
    refuse_unsupported(cfg, "encoder")
    return build_encoder(cfg, seed)


def _causal(cfg, seed, task_tokenizer=None):
    from .causal import build_causal
    return build_causal(cfg, seed, task_tokenizer)


MODEL_KINDS.add("seq2seq", _seq2seq)
MODEL_KINDS.add("encoder", _encoder)
MODEL_KINDS.add("causal", _causal)  # decoder language models (the instruct task)
SURGERIES.add("patches", apply_patches, PatchSettings)  # FedMatch private patches
SURGERIES.add("controllers", apply_controllers, ControllerSettings)  # Roosta et al.'s exchanged layers
SURGERIES.add("lora", apply_lora, LoraSettings)  # low-rank adapters over a frozen base (peft)
