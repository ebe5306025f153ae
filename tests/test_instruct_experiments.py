"""The instruct experiments (experiments/instruct/): the generic base, the CPU study and FlowerTune's
GPU recipe load, fit together and say what their comments say."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedsilo.config import load_config
from fedsilo.errors import ConfigError
from fedsilo.runs.studyfile import load_study

HERE = Path(__file__).resolve().parents[1] / "experiments" / "instruct"
SIZES = ("kind", "name", "d_model", "d_ff", "num_layers", "num_heads")


def test_the_study_starts_from_the_generic_base_it_can_load():
    generic = load_config(HERE / "generic.toml")
    assert generic.paradigm == "centralized" and generic.task.silos == ["news"]
    study = tomllib.loads((HERE / "small.toml").read_text())
    base_model = study["base"]["model"]
    # init_from loads the base's tensors by name and shape: the sizes must be the generic run's
    assert {k: base_model[k] for k in SIZES} == {k: getattr(generic.model, k) for k in SIZES}
    assert base_model["init_from"].endswith("instruct-study/generic")


def test_the_study_has_six_variants_over_three_seeds():
    settings, variants = load_study(HERE / "small.toml")
    assert len(settings.seeds) >= 3
    assert set(variants) == {f"{way}_{tuning}" for way in ("alone", "fedavg", "fedprox")
                             for tuning in ("full", "lora")}
    for name, cfg in variants.items():
        assert cfg.task.silos == ["gsm8k", "pubmedqa", "codealpaca"]
        assert cfg.task.truncation == "prompt_start"  # PubMedQA's abstracts must not cut the answer off
        assert cfg.paradigm == ("finetune" if name.startswith("alone") else "federated")
        assert ("prox" in cfg.client.regularizers) == name.startswith("fedprox")
        assert (cfg.model.surgery is not None) == name.endswith("lora")


def test_flowertune_recipe_values():
    cfg = load_config(HERE / "flowertune.toml")
    lora = cfg.model.surgery.settings()
    assert (lora.rank, lora.alpha, lora.dropout) == (32, 64, 0.075)
    assert cfg.model.precision == "bf16" and cfg.model.gradient_checkpointing
    assert (cfg.client.lr, cfg.client.lr_schedule, cfg.client.schedule_span, cfg.client.batch_size, cfg.client.steps) \
        == (5e-5, "cosine", "server_rounds", 16, 10)
    assert (cfg.federation.rounds, cfg.federation.sample_count, cfg.task.max_length) == (200, 2, 512)
    assert '# quantization = "4bit"' in (HERE / "flowertune.toml").read_text()
    qlora = load_config(HERE / "flowertune.toml", ["model.quantization=4bit"])  # the commented alternative
    assert qlora.model.quantization == "4bit"


def test_flowertune_without_a_checkpoint_says_so_in_one_line():
    from fedsilo.recipe import build_model

    cfg = load_config(HERE / "flowertune.toml", ["model.name=/no/such/checkpoint"])
    with pytest.raises(ConfigError, match=r"model\.name: '/no/such/checkpoint' is neither"):
        build_model(cfg)


def test_lora_over_a_whole_model_checkpoint_adapts_that_checkpoints_weights(tmp_path):
    """The study's LoRA variants start from the generic base: its whole-model tensors must become the
    frozen base under the adapters (loaded before LoRA renames q_proj.weight to q_proj.base_layer.weight)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from fedsilo.config import validate
    from fedsilo.recipe import build_model

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", "yes", "no"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder = tmp_path / "ckpt"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(folder)
    tok.save_pretrained(folder)
    generic = {name: torch.randn_like(p) for name, p in LlamaForCausalLM.from_pretrained(folder).named_parameters()}
    torch.save(generic, tmp_path / "generic.pt")
    cfg = validate({"task": {"name": "instruct"}, "model": {
        "kind": "causal", "name": str(folder), "init_from": str(tmp_path / "generic.pt"),
        "surgery": {"name": "lora", "options": {"rank": 2}}}})
    model, _ = build_model(cfg)
    state = model.state_dict()
    assert torch.equal(state["model.layers.0.self_attn.q_proj.base_layer.weight"],
                       generic["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], generic["model.embed_tokens.weight"])
    assert not state["model.layers.0.self_attn.q_proj.lora_B.default.weight"].any()  # LoRA starts at B = 0
