"""The encoder model kind (cross-encoders) and the toy answer-selection task built on it."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedsilo.config import ConfigError, ModelConfig
from fedsilo.models.encoder import build_encoder
from fedsilo.models.seq2seq import minilm_path
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import Task
from tests.toytask import (RULE_POSITION, SPEC, Pair, Question, ToyRankSettings, ToyRankTask, make_questions,
                           pairwise_hinge, rank_stats)


def cfg(name="tiny-bert", **kw) -> ModelConfig:
    base = dict(kind="encoder", name=name, d_model=32, d_ff=64, num_layers=2, num_heads=4, dropout=0.0,
                device="cpu")
    return ModelConfig(**{**base, **kw})


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny():
    return build_encoder(cfg(), seed=0)


# ---- the encoder kind ----------------------------------------------------------------------

def test_tiny_bert_has_requested_sizes(tiny):
    model, tokenizer = build_encoder(cfg(d_model=48, d_ff=96, num_layers=3, num_heads=6, dropout=0.2), seed=0)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads) == (48, 96, 3, 6)
    assert c.hidden_dropout_prob == c.attention_probs_dropout_prob == 0.2
    assert c.num_labels == 1 and len(model.bert.encoder.layer) == 3
    assert model.config.vocab_size == len(tokenizer) == 30522  # MiniLM's WordPiece vocabulary
    assert not model.training and next(model.parameters()).device.type == "cpu"
    enc = tokenizer(["red cat", "blue dog"], ["red bird", "green fish"], padding=True, return_tensors="pt")
    assert model(**enc).logits.shape == (2, 1)


def test_same_seed_same_weights_different_seed_different(tiny):
    a = params(tiny[0])
    state = torch.random.get_rng_state()
    b = params(build_encoder(cfg(), seed=0)[0])
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left alone
    c = params(build_encoder(cfg(), seed=1)[0])
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["classifier.weight"], c["classifier.weight"])
    assert not torch.equal(a["bert.embeddings.word_embeddings.weight"], c["bert.embeddings.word_embeddings.weight"])


def test_d_model_not_divisible_by_heads_is_a_config_error():
    with pytest.raises(ConfigError, match="num_heads"):
        build_encoder(cfg(d_model=30, num_heads=4))


def test_minilm_loads_pretrained_encoder_under_a_seeded_head():
    from transformers import BertModel
    ref = BertModel.from_pretrained(str(minilm_path()))
    model, tokenizer = build_encoder(cfg("minilm"), seed=0)
    default, _ = build_encoder(cfg(None), seed=0)  # None: the default name, minilm
    other, _ = build_encoder(cfg("minilm"), seed=1)
    assert model.config.num_labels == 1 and model.config.hidden_size == 384
    for name in ("embeddings.word_embeddings.weight", "encoder.layer.5.output.dense.weight", "pooler.dense.weight"):
        assert torch.equal(model.bert.state_dict()[name], ref.state_dict()[name])
    assert all(torch.equal(v, default.state_dict()[k]) for k, v in model.state_dict().items())
    assert not torch.equal(model.classifier.weight, other.classifier.weight)
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, other.bert.embeddings.word_embeddings.weight)
    assert tokenizer("red cat", "blue dog")["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]


def test_saved_folder_loads_unchanged(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded, tok = build_encoder(cfg(str(tmp_path / "ckpt")), seed=7)  # the seed cannot change saved weights
    want, got = params(model), params(loaded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert type(loaded) is type(model) and not loaded.training
    assert tok("red cat", "blue")["input_ids"] == tokenizer("red cat", "blue")["input_ids"]


def test_folder_without_a_head_gets_a_seeded_one_score_head(tiny, tmp_path):
    model, tokenizer = tiny
    model.bert.save_pretrained(tmp_path / "bare")  # a BertModel checkpoint, as bert-base ships
    tokenizer.save_pretrained(tmp_path / "bare")
    a, _ = build_encoder(cfg(str(tmp_path / "bare")), seed=3)
    b, _ = build_encoder(cfg(str(tmp_path / "bare")), seed=3)
    assert a.config.num_labels == 1 and a.classifier.out_features == 1
    assert torch.equal(a.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)
    assert torch.equal(a.classifier.weight, b.classifier.weight)


def test_missing_or_unloadable_folder_raises_config_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="no-such-model"):
        build_encoder(cfg(str(missing)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty"):
        build_encoder(cfg(str(tmp_path / "empty")))


# ---- the toy task: registration and data --------------------------------------------------

def test_toyrank_is_registered_with_its_settings(tiny):
    entry = TASKS.entry("toyrank")
    assert entry.settings is ToyRankSettings
    assert entry.value.data is None and entry.value.spec() is SPEC
    assert entry.value.default_model == {"kind": "encoder", "name": "tiny-bert"}
    s = ToyRankSettings.model_validate({"name": "toyrank", "silos": ["beta", "alpha"]})
    assert s.client_names() == ["beta", "alpha"] and s.known_clients() == ["alpha", "beta", "gamma"]
    assert ToyRankSettings(name="toyrank").client_names() == ["alpha", "beta", "gamma"]
    for bad in ({"silos": ["delta"]}, {"silos": []}, {"silos": ["alpha", "alpha"]}, {"n_train": 0}, {"x": 1}):
        with pytest.raises(ValueError):
            ToyRankSettings.model_validate({"name": "toyrank", **bad})
    task = entry.value.build(s, tiny[1], None)
    assert isinstance(task, ToyRankTask) and isinstance(task, Task)
    assert task.clients == ["beta", "alpha"] and task.display["gamma"] == "gamma"
    assert SPEC.tie_break is None and SPEC.selection == "macro" and SPEC.primary == "map"


def test_toyrank_data_is_deterministic_and_follows_the_silo_rule():
    assert make_questions("alpha", "train", 5, 0) == make_questions("alpha", "train", 5, 0)
    assert make_questions("alpha", "train", 5, 0) != make_questions("alpha", "train", 5, 1)
    assert make_questions("alpha", "train", 5, 0) != make_questions("alpha", "dev", 5, 0)
    for silo, at in RULE_POSITION.items():
        for q in make_questions(silo, "train", 24, 0):
            key = q.text.split()[at]
            labels = [p.label for p in q.candidates]
            assert sorted(labels) == [0, 0, 0, 1]
            assert all(p.qid == q.qid and p.question == q.text for p in q.candidates)
            for p in q.candidates:
                assert (key in p.answer.split()) == bool(p.label)
            # one distractor negative shares another question word: overlap alone is not the rule
            assert sum(bool(set(p.answer.split()) & set(q.text.split())) for p in q.candidates) == 2


def test_collate_flattens_questions_and_keeps_candidates_together(tiny):
    task = ToyRankTask(ToyRankSettings(name="toyrank", n_train=4), tiny[1])
    qs = task.examples("alpha", "train")[:3]
    batch = task.collate(qs)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels", "qid"}
    assert batch["qid"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert batch["labels"].tolist() == [p.label for q in qs for p in q.candidates]
    first = tiny[1].decode(batch["input_ids"][0], skip_special_tokens=False).replace(" [PAD]", "")
    assert first == f"[CLS] {qs[0].text} [SEP] {qs[0].candidates[0].answer} [SEP]"
    assert batch["token_type_ids"][0].max() == 1


# ---- the toy task: metrics --------------------------------------------------------------------

def test_rank_stats_by_hand():
    assert rank_stats([0.2, 0.9, 0.5, 0.1], [1, 0, 0, 0]) == (1 / 3, 1 / 3, 0.0)
    # tie rule (pessimistic): a negative tied with a positive ranks above it, whatever the order
    assert rank_stats([0.5, 0.5, 0.1], [1, 0, 0]) == (0.5, 0.5, 0.0)
    assert rank_stats([0.5, 0.5, 0.1], [0, 1, 0]) == (0.5, 0.5, 0.0)
    assert rank_stats([0.5, 0.5], [1, 1]) == (1.0, 1.0, 1.0)  # positives tied with each other: no effect
    assert rank_stats([-3.0], [1]) == (1.0, 1.0, 1.0)        # a single candidate
    assert rank_stats([0.8, 0.3, 0.6, 0.0], [1, 1, 0, 0]) == pytest.approx((5 / 6, 1.0, 1.0))
    assert rank_stats([1.0], [0]) is None                      # no positive: not a question


class StubScorer(nn.Module):
    """Scores a pair by its answer's first word, from a fixed table."""

    def __init__(self, tokenizer, table: dict[str, float]) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))
        self.scores = {tokenizer.convert_tokens_to_ids(w): s for w, s in table.items()}

    def forward(self, input_ids, attention_mask, token_type_ids):
        first = token_type_ids.argmax(dim=1)  # the first answer token of each row
        ids = input_ids[torch.arange(len(input_ids)), first].tolist()
        return SimpleNamespace(logits=torch.tensor([[self.scores[i]] for i in ids]) + self.anchor)


def question(qid: str, cands: list[tuple[str, int]]) -> Question:
    return Question(qid, "what is it", tuple(Pair("what is it", a, label, qid) for a, label in cands))


def test_evaluate_stats_from_fixed_scores(tiny):
    tokenizer = tiny[1]
    table = {"red": 0.2, "blue": 0.9, "green": 0.5, "black": 0.1,   # positive third: 1/3, 1/3, 0
             "cat": 0.5, "dog": 0.5, "bird": 0.1,                   # positive tied with a negative: 1/2, 1/2, 0
             "fish": -3.0,                                          # a single candidate: 1, 1, 1
             "apple": 0.8, "bread": 0.3, "milk": 0.6, "rice": 0.0,  # two positives: 5/6, 1, 1
             "cake": 1.0}                                           # no positive: left out
    task = ToyRankTask(ToyRankSettings(name="toyrank", eval_batch_size=2), tokenizer)
    task.splits["alpha"]["dev"] = [
        question("q1", [("red", 1), ("blue", 0), ("green", 0), ("black", 0)]),
        question("q2", [("cat", 1), ("dog", 0), ("bird", 0)]),
        question("q3", [("fish", 1)]),
        question("q4", [("milk", 0), ("apple", 1), ("rice", 0), ("bread", 1)]),
        question("q5", [("cake", 0)]),
    ]
    seen = []
    progress = SimpleNamespace(advance=seen.append)
    model = StubScorer(tokenizer, table).train()
    rows = task.evaluate(model, "alpha", "dev", progress=progress)
    assert model.training and seen == [2, 2, 1]
    assert [(r["client"], r["task"]) for r in rows] == [("alpha", "toyrank")]
    stats = rows[0]["stats"]
    assert stats["questions"] == 4
    assert stats["ap_sum"] == pytest.approx(1 / 3 + 1 / 2 + 1 + 5 / 6, abs=1e-12)
    assert stats["rr_sum"] == pytest.approx(1 / 3 + 1 / 2 + 1 + 1, abs=1e-12)
    assert stats["p1_sum"] == 2
    summary = SPEC.summarize(rows + [{"client": "beta", "task": "toyrank",
                                      "stats": {"ap_sum": 1.0, "rr_sum": 1.0, "p1_sum": 1.0, "questions": 1.0}}])
    assert summary["rows"][0]["metrics"]["map"] == pytest.approx(100 * (8 / 3) / 4)
    assert summary["macro"]["map"] == pytest.approx((100 * (8 / 3) / 4 + 100) / 2)
    assert summary["pooled"]["mrr"] == pytest.approx(100 * (17 / 6 + 1) / 5)
    assert summary["score"] == summary["macro"]["map"] and summary["key"] == [summary["macro"]["map"]]


# ---- the toy task: loss and learning ----------------------------------------------------------

class FixedScores(nn.Module):
    """Returns its own parameter as the scores, whatever the input."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(scores).unsqueeze(1))

    def forward(self, input_ids, attention_mask, token_type_ids):
        assert len(input_ids) == len(self.s)
        return SimpleNamespace(logits=self.s)


def test_hinge_loss_value_and_gradient(tiny):
    task = ToyRankTask(ToyRankSettings(name="toyrank"), tiny[1])
    batch = task.collate([question("a", [("red", 1), ("blue", 0), ("green", 0), ("black", 0)]),
                          question("b", [("cat", 1), ("dog", 0)])])
    # q a: pairs (2, .5) → 0 (inactive), (2, 1.5) → .5, (2, -1) → 0; q b: (0, .2) → 1.2.
    # A cross-question pair (q b's positive 0 vs q a's negative 1.5) would be active: it must not count.
    model = FixedScores([2.0, 0.5, 1.5, -1.0, 0.0, 0.2])
    loss = task.loss(model, batch)
    assert set(loss) == {"task"}
    assert loss["task"].item() == pytest.approx((0.5 + 1.2) / 4)
    loss["task"].backward()
    # −1 for the positive, +1 for the negative of each active pair, over the 4 pairs; 0 when inactive
    assert model.s.grad.squeeze(1).tolist() == pytest.approx([-0.25, 0.0, 0.25, 0.0, -0.25, 0.25])


def test_hinge_without_pairs_is_a_differentiable_zero():
    s = torch.tensor([0.3, 0.7], requires_grad=True)
    loss = pairwise_hinge(s, torch.tensor([1, 1]), torch.tensor([0, 1]))
    loss.backward()
    assert loss.item() == 0.0 and s.grad.tolist() == [0.0, 0.0]
    assert pairwise_hinge(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]), torch.tensor([0, 0]), margin=3.0) == 2.0


def test_tiny_bert_learns_the_toy_rule():
    model, tokenizer = build_encoder(cfg(d_model=64, d_ff=128), seed=0)
    task = ToyRankTask(ToyRankSettings(name="toyrank", silos=["alpha"]), tokenizer)

    def train_map() -> float:
        return SPEC.compute(task.evaluate(model, "alpha", "train")[0]["stats"])["map"]

    before = train_map()
    questions = task.examples("alpha", "train")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(12):  # 4 epochs of 3 batches of 8 questions (32 pairs)
        start = (step % 3) * 8
        loss = task.loss(model, task.collate(questions[start:start + 8]))["task"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    after = train_map()
    assert after >= before + 20, (before, after)
