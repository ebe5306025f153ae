"""The instruct task over the real benchmark silos: its loss is the completion-only loss, its
evaluation rows pool their items exactly, multiple choice and GSM8K scoring read the model as the
scorers say, and truncation is said once per silo and split."""
import math
import warnings
from pathlib import Path

import pytest
import torch

from fedsilo.config import validate
from fedsilo.errors import ConfigWarning
from fedsilo.recipe import build_model, build_task
from fedsilo.tasks.base import pool
from fedsilo.tasks.instruct.scoring import option_loglikelihoods, options_ids
from fedsilo.tasks.instruct.template import prompt_ids

pytestmark = pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / "shared" / "data" / "instruct").is_dir(),
                                reason="needs ../shared/data/instruct")


def config(**task):
    return validate({"name": "t", "task": {"name": "instruct", "silos": ["gsm8k", "pubmedqa", "codealpaca"],
                                           "max_train": 8, "max_eval": 6, "max_length": 256, "max_new_tokens": 8,
                                           "vocab_size": 600, "truncation": "prompt_start", **task},
                     "model": {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4}})


@pytest.fixture(scope="module")
def built():
    cfg = config()
    model, tokenizer = build_model(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        task = build_task(cfg, tokenizer)
    return cfg, model, tokenizer, task


def test_loss_is_the_mean_over_response_tokens(built):
    """Equal to transformers' own causal-LM loss with the prompt labelled -100 (the shift inside)."""
    _, model, _, task = built
    batch = task.collate(task.examples("codealpaca", "train")[:4])
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    ours = task.loss(model, batch)["task"]
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert torch.allclose(ours, theirs, atol=1e-6)
    per_record = task.example_losses(model, batch)
    assert per_record.shape == (4,) and torch.isfinite(per_record).all()


def test_evaluation_items_pool_to_the_row_and_score_choices_by_loglikelihood(built):
    cfg, model, tokenizer, task = built
    row, = task.evaluate_items(model, "pubmedqa", "test")
    items = row["items"]["stats"]
    assert len(items) == len(task.examples("pubmedqa", "test")) == 6
    pooled = pool(items)
    for key in ("loss_sum", "loss_n", "mc_hit", "mc_n"):
        assert math.isclose(pooled[key], row["stats"][key], rel_tol=1e-9)
    assert row["stats"]["mc_n"] == 6 and "em_n" not in row["stats"]
    for record, stats in zip(task.examples("pubmedqa", "test"), items):
        options = options_ids(tokenizer, record.options)
        prompt = prompt_ids(record, tokenizer, task.chat)[-(cfg.task.max_length - max(map(len, options))):]
        scores = option_loglikelihoods(model, prompt, options)
        assert stats["mc_hit"] == float(max(range(3), key=scores.__getitem__) == record.label)


def test_gsm8k_is_generated_only_for_the_final_test(built):
    _, model, _, task = built
    dev, = task.evaluate(model, "gsm8k", "dev")
    test, = task.evaluate(model, "gsm8k", "test", final=True)
    assert "em_n" not in dev["stats"] and test["stats"]["em_n"] == 6
    assert 0 <= test["stats"]["em_hit"] <= 6


def test_truncation_is_said_per_silo_and_split():
    cfg = config(max_length=64, truncation="end")
    model, tokenizer = build_model(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = build_task(cfg, tokenizer)
        task.tokenize(task.examples("pubmedqa", "train"))
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any(s.startswith("instruct: pubmedqa train: 8 of 8 records are longer than task.max_length = 64 tokens and were cut at the end")
               and "lost their whole response" in s for s in said), said
