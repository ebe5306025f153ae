"""The causal model kind (fedsilo.models.causal): tiny-llama over the instruct task's byte-level BPE
(fedsilo.tasks.instruct.tokenizer), a local checkpoint folder, the refusals of 4-bit QLoRA and of the
memory options, gradient checkpointing, and LoRA on a decoder."""
import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

from fedsilo.config import validate
from fedsilo.errors import ConfigError
from fedsilo.models import MODEL_KINDS
from fedsilo.models.causal import build_causal
from fedsilo.models.lora import LoraSettings, apply_lora
from fedsilo.models.settings import SIZE_KEYS, ModelConfig, default_name, reads_task_tokenizer, unread_sizes
from fedsilo.tasks.instruct import tokenizer as bbpe

SIZES = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "dropout": 0.0}
LORA = {"name": "lora"}
CODE = "def square(x):\n\treturn x ** 2  # </s> is text here\n"
MATHS = "∫₀¹ x² dx = ⅓, and 17 × 23 = 391; ∑ᵢ αᵢ ≥ 0 → β ≠ γ. 日本語 😀"


def corpus() -> list[str]:
    words = ["the", "model", "answer", "number", "silo", "federated", "tuning", "print", "return", "value"]
    lines = [f"{a} {b} {i} {a}{b}" for i, (a, b) in enumerate(zip(words * 7, words[3:] + words[:3]))]
    return lines + [CODE, "for i in range(10):\n    print(i)\n", "x = 3 + 4 * (2 - 1)"] * 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bbpe.load_or_fit(corpus, {"silo": "public"}, tmp_path_factory.mktemp("tok"), 400)


def causal(**model) -> ModelConfig:
    return ModelConfig(kind="causal", device="cpu", **{**SIZES, **model})


def tiny_llama(tokenizer, seed=0, **model):
    return build_causal(causal(**model), seed, lambda: tokenizer)


def batch(tokenizer):
    enc = tokenizer(["def square(x): return x", "the answer is 42"], padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return enc, labels


# ---- tiny-llama

def test_tiny_llama_is_sized_by_the_config_over_the_task_tokenizer(tokenizer):
    model, tok = tiny_llama(tokenizer, d_model=48, d_ff=80, num_layers=3, num_heads=6, dropout=0.25)
    c = model.config
    assert tok is tokenizer and isinstance(model, LlamaForCausalLM)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (48, 80, 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.attention_dropout) == (6, 6, 0.25)
    assert c.vocab_size == len(tokenizer) and c.max_position_embeddings == 2048
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)
    assert model.generation_config.pad_token_id == 0
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.training


def test_the_seed_fixes_the_weights_and_leaves_torchs_generator_alone(tokenizer):
    state = torch.random.get_rng_state()
    a, _ = tiny_llama(tokenizer, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b, _ = tiny_llama(tokenizer, seed=3)
    c, _ = tiny_llama(tokenizer, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


@pytest.mark.parametrize("task_tokenizer", [None, lambda: None])
def test_tiny_llama_without_a_task_tokenizer_is_refused(task_tokenizer):
    with pytest.raises(ConfigError, match=r"model.name: 'tiny-llama' needs a task tokenizer"):
        build_causal(causal(), 0, task_tokenizer)


def test_an_odd_head_size_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="num_heads 4 must give a whole, even head size"):
        tiny_llama(tokenizer, d_model=36)  # head size 9: rotary positions turn pairs


def test_the_registered_kind_and_its_defaults():
    assert "causal" in MODEL_KINDS and default_name("causal") == "tiny-llama"
    assert unread_sizes("causal", None)[0] == ("num_decoder_layers",)
    assert unread_sizes("causal", "/some/checkpoint")[0] == SIZE_KEYS
    assert reads_task_tokenizer("causal", None) and reads_task_tokenizer("causal", "tiny-llama")
    assert not reads_task_tokenizer("causal", "/some/checkpoint")


# ---- a local checkpoint

def save_tiny_llama(folder, tokenizer, dtype=torch.float32) -> LlamaForCausalLM:
    """A random Llama and a tokenizer without a pad token (as many decoders' are), saved as a checkpoint."""
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(folder)
    return model


def test_a_local_checkpoint_loads_unchanged_with_eos_as_pad(tokenizer, tmp_path):
    saved = save_tiny_llama(tmp_path, tokenizer)
    model, tok = build_causal(causal(name=str(tmp_path)), 0)
    assert tok.pad_token == "</s>" and model.config.pad_token_id == tok.eos_token_id == 2
    enc, _ = batch(tokenizer)
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, saved(**enc).logits)


def test_a_bf16_checkpoint_loads_as_fp32(tokenizer, tmp_path):
    saved = save_tiny_llama(tmp_path, tokenizer, dtype=torch.bfloat16)
    model, _ = build_causal(causal(name=str(tmp_path)), 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    weights = dict(saved.named_parameters())
    assert all(torch.equal(p, weights[n].float()) for n, p in model.named_parameters())


def test_a_folder_that_is_not_a_causal_lm_is_one_line_naming_model_name(tokenizer, tmp_path):
    T5ForConditionalGeneration(T5Config(vocab_size=len(tokenizer), d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                        d_kv=8)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^model.name: cannot load a causal LM checkpoint from .*T5Config") as err:
        build_causal(causal(name=str(tmp_path)), 0)
    assert "\n" not in str(err.value)


def test_a_missing_folder_is_one_line_naming_model_name(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.name: '.*nowhere' is neither one of \('tiny-llama', 'smollm2-135m-instruct'\) nor a local"):
        build_causal(causal(name=str(tmp_path / "nowhere")), 0)


# ---- 4-bit QLoRA and the memory options: refused by name

@pytest.mark.parametrize("model, message", [
    ({"kind": "causal", "name": "/ckpt", "quantization": "4bit"}, r"4-bit weights cannot be trained .*name = \"lora\""),
    ({"kind": "causal", "name": "/ckpt", "quantization": "4bit",
      "surgery": {"name": "lora", "options": {"aggregation": "exact"}}}, "merges the adapters into the base weights"),
    ({"kind": "causal", "quantization": "4bit", "surgery": LORA}, "'tiny-llama' is trained here from scratch"),
    ({"name": "tiny-llama", "quantization": "4bit", "surgery": LORA}, "'tiny-llama' is trained here from scratch"),
    ({"kind": "seq2seq", "quantization": "4bit", "surgery": LORA}, "only for model.kind = \"causal\", not 'seq2seq'"),
    ({"kind": "encoder", "quantization": "4bit", "surgery": LORA}, "only for model.kind = \"causal\", not 'encoder'"),
    ({"kind": "encoder", "gradient_checkpointing": True}, "not supported for model.kind = \"encoder\""),
])
def test_what_cannot_hold_is_refused_at_validation(model, message):
    with pytest.raises(ConfigError, match=r"^config: model\.(quantization|gradient_checkpointing).*" + message):
        validate({"name": "x", "task": {"name": "translation"}, "model": model})


@pytest.mark.parametrize("kind, model", [("seq2seq", {"quantization": "4bit", "surgery": LORA}),
                                         ("encoder", {"gradient_checkpointing": True})])
def test_a_task_default_kind_that_cannot_hold_is_refused_at_build(kind, model):
    cfg = ModelConfig(**model)  # kind None passes validation: the task's default kind is known at build
    with pytest.raises(ConfigError, match=r"^model\.(quantization|gradient_checkpointing)"):
        MODEL_KINDS.get(kind)(cfg.model_copy(update={"kind": kind}), 0, None)


def test_4bit_needs_cuda(tokenizer, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    save_tiny_llama(tmp_path, tokenizer)
    cfg = ModelConfig(kind="causal", name=str(tmp_path), quantization="4bit", surgery=LORA)
    with pytest.raises(ConfigError, match=r'^model.quantization = "4bit" needs a CUDA GPU .*this machine has none'):
        build_causal(cfg, 0)


def test_4bit_without_bitsandbytes_names_the_extra(tmp_path, monkeypatch):
    if importlib.util.find_spec("bitsandbytes"):
        pytest.skip("bitsandbytes is installed")
    import fedsilo.models.causal as causal_module
    monkeypatch.setattr(causal_module, "resolve_device", lambda name: torch.device("cuda", 0))  # as on a GPU box
    cfg = ModelConfig(kind="causal", name=str(tmp_path), quantization="4bit", surgery=LORA)
    with pytest.raises(ConfigError, match=r"needs bitsandbytes: pip install fedsilo\[gpu\]"):
        build_causal(cfg, 0)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tokenizer):
    enc, labels = batch(tokenizer)
    results = []
    for on in (False, True):
        model, _ = tiny_llama(tokenizer, seed=2, gradient_checkpointing=on)
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == on
        model.train()
        loss = model(**enc, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_off, grads_off), (loss_on, grads_on) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=1e-5)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=0, atol=1e-5, msg=name)


def test_gradient_checkpointing_on_a_seq2seq_model():
    model, _ = MODEL_KINDS.get("seq2seq")(ModelConfig(kind="seq2seq", name="tiny-t5", device="cpu",
                                                      gradient_checkpointing=True, **SIZES), 0, None)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


# ---- LoRA on a decoder

def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_lora_adapts_query_and_value_and_freezes_the_tied_head(tokenizer):
    model, _ = tiny_llama(tokenizer)
    enc, _ = batch(tokenizer)
    with torch.no_grad():
        before = model(**enc).logits
    apply_lora(model, LoraSettings(), seed=0)
    names = trainable(model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == {"q_proj", "v_proj"}
    assert len(names) == 2 * 2 * SIZES["num_layers"]  # A and B of q and v in each layer
    with torch.no_grad():  # B = 0: the model computes what the base computes
        assert torch.equal(model(**enc).logits, before)


def test_a_private_head_trains_a_copy_of_lm_head(tokenizer):
    model, _ = tiny_llama(tokenizer)
    apply_lora(model, LoraSettings(head="private"), seed=0)
    names = trainable(model)
    heads = {n for n in names if ".lora_" not in n}
    assert heads == {"lm_head.modules_to_save.default.weight"}
    assert not model.model.embed_tokens.weight.requires_grad  # the embeddings it was tied to stay frozen
    assert model.lm_head.modules_to_save["default"].weight is not model.model.embed_tokens.weight


# ---- the byte-level tokenizer

@pytest.mark.parametrize("text", [CODE, MATHS, "  two leading spaces,\ttabs\r\nand CRLF  ", "<s>literal<pad></s>"])
def test_byte_level_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 1 and ids[-1] != tokenizer.eos_token_id
    assert not {0, 1, 2} & set(ids[1:])  # special tokens in the text are text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_and_no_template(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<s>", "</s>"]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.chat_template is None
    assert len(tokenizer) <= 400
    digits = tokenizer.convert_ids_to_tokens(tokenizer("12345", add_special_tokens=False)["input_ids"])
    assert digits == list("12345")  # one piece per digit, whatever was frequent


def test_fitting_is_deterministic_and_cached(tmp_path, monkeypatch):
    first = bbpe.load_or_fit(corpus, {"silo": "public"}, tmp_path / "a", 400)
    second = bbpe.load_or_fit(corpus, {"silo": "public"}, tmp_path / "b", 400)
    (file_a,), (file_b,) = (tmp_path / "a").glob("*/tokenizer.json"), (tmp_path / "b").glob("*/tokenizer.json")
    assert file_a.read_bytes() == file_b.read_bytes()
    assert json.loads(file_a.read_text())["model"]["type"] == "BPE"
    assert first(MATHS)["input_ids"] == second(MATHS)["input_ids"]
    monkeypatch.setattr(bbpe, "fit_tokenizer", lambda *a: pytest.fail("refitted a cached tokenizer"))
    cached = bbpe.load_or_fit(corpus, {"silo": "public"}, tmp_path / "a", 400)
    assert cached(CODE)["input_ids"] == first(CODE)["input_ids"] and cached.bos_token_id == 1
    monkeypatch.undo()
    other = bbpe.load_or_fit(lambda: corpus()[:-1], {"silo": "public"}, tmp_path / "a", 400)  # other texts: refit
    assert len(list((tmp_path / "a").glob("*/tokenizer.json"))) == 2 and len(other) > 259


def test_an_unusable_cached_tokenizer_is_refitted(tmp_path):
    bbpe.load_or_fit(corpus, {}, tmp_path, 300)
    (path,) = tmp_path.glob("*/tokenizer.json")
    good = path.read_bytes()
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unusable cached tokenizer"):
        bbpe.load_or_fit(corpus, {}, tmp_path, 300)
    assert path.read_bytes() == good


def test_a_vocabulary_smaller_than_the_bytes_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be an integer above 259"):
        bbpe.fit_tokenizer(corpus(), 259)
