"""The matching task end to end on the real silos with a tiny BERT: FedMatch's private patches in a
federation (never uploaded, kept per silo), the hinge loss, evaluation against per-pair scoring, the
BM25 reference, FedPer / LG-FedAvg splits, client sampling, resume, and Flower simulation parity."""
import json
from pathlib import Path

import pytest
import torch

from fedsilo.config import validate
from fedsilo.recipe import build_model, build_task, exchange_plan
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.matching.metrics import question_stats

QA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qa"
pytestmark = pytest.mark.skipif(not QA.is_dir(), reason=f"real QA data not found at {QA}")

SILOS3 = ["medquad", "wikiqa", "trecqa"]
PATCHES = {"name": "patches", "options": {"kind": "lowrank", "insertion": "horizontal", "size": 8}}


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Prepared splits go to this module's cache, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("fedsilo-data")))
        yield


def qa_config(**sections) -> dict:
    cfg = {
        "name": "qa", "seed": 3,
        "task": {"name": "matching", "data_dir": str(QA), "silos": SILOS3, "max_train": 6, "max_eval": 5,
                 "pairs_per_question": 2, "max_length": 48, "eval_batch_size": 16},
        "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 2,
                  "num_heads": 4, "dropout": 0.0, "surgery": PATCHES},
        "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 4, "logging_steps": 1},
        "federation": {"rounds": 2, "weighting": "equal"},
        "exchange": {"private": ["*patch*"]},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def rounds_of(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fedmatch(tmp_path_factory):
    """A 3-silo x 2-round FedMatch run, every upload recorded."""
    from fedsilo.server import Server
    uploads = []
    original = Server.receive

    def spy(self, name, update):
        uploads.append((name, sorted(update.tensors)))
        return original(self, name, update)

    out = tmp_path_factory.mktemp("fedmatch") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "receive", spy)
        results = run_experiment(validate(qa_config()), out, show_progress=False)
    return out, results, uploads


def test_patches_never_leave_their_silo_and_stay_its_own(fedmatch):
    out, results, uploads = fedmatch
    cfg = validate(qa_config())
    model, _ = build_model(cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    patch = [n for n in names if "patch" in n]
    assert patch and len(uploads) == 6
    for _, sent in uploads:  # every upload: all shared tensors, no patch tensor
        assert sent == sorted(n for n in names if "patch" not in n)
    r1, r2 = rounds_of(out)
    shared = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "patch" not in n)
    assert all(r["clients"][c]["params_up"] == shared for r in (r1, r2) for c in SILOS3)
    assert all(r["clients"][c]["weight"] == pytest.approx(1 / 3) for r in (r1, r2) for c in SILOS3)  # 1/T
    # each silo keeps its own trained patches (and only them); the server never holds one
    from fedsilo.client.store import DiskStore
    store = DiskStore(out / "clients")
    store.set_round(2)
    own = {c: store.get(c).slot("own") for c in SILOS3}
    start = {n: p.detach() for n, p in model.named_parameters() if n in patch}
    for c in SILOS3:
        assert sorted(own[c]) == sorted(patch)
        assert any(not torch.equal(own[c][n], start[n]) for n in patch)  # trained
    down = [n for n in patch if n.endswith("up.weight") or ".up." in n] or patch
    assert not torch.equal(own["medquad"][down[0]], own["wikiqa"][down[0]])  # each its own
    server = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert server and not any("patch" in k for k in server)


def test_results_rows_and_the_bm25_reference(fedmatch):
    _, results, _ = fedmatch
    rows = results["test"]["rows"]
    assert [r["client"] for r in rows] == SILOS3
    for r in rows:
        assert r["stats"]["questions"] + r["stats"].get("dropped", 0) == 5
        assert 0 < r["metrics"]["map"] <= 1 and 0 < r["metrics"]["mrr"] <= 1
    macro = sum(r["metrics"]["map"] for r in rows) / 3
    assert results["test"]["macro"]["map"] == pytest.approx(macro)
    bm25 = results["reference"]["bm25"]
    assert [r["client"] for r in bm25["rows"]] == SILOS3 and bm25["macro"]["loss"] is None


class FixedScores(torch.nn.Module):
    """A 'model' whose score for row i is a learnable value: for checking the loss's gradient."""
    def __init__(self, values):
        super().__init__()
        self.values = torch.nn.Parameter(torch.tensor(values))

    def forward(self, **batch):
        return type("Out", (), {"logits": self.values[:, None]})()


def test_hinge_loss_and_its_gradient():
    from fedsilo.tasks.matching.task import MatchingTask
    task = MatchingTask.__new__(MatchingTask)
    task.settings = validate(qa_config()).task
    # pairs: (pos 2.0, neg 0.5): inactive; (pos 0.2, neg 0.9): 1 - 0.2 + 0.9 = 1.7; (pos 1.0, neg 0.4): 0.4
    model = FixedScores([2.0, 0.2, 1.0, 0.5, 0.9, 0.4])
    loss = task.loss(model, {})["hinge"]
    assert loss.item() == pytest.approx((0 + 1.7 + 0.4) / 3)
    loss.backward()
    expected = torch.tensor([0, -1, -1, 0, 1, 1]) / 3  # d/d pos = -1/B, d/d neg = +1/B where active
    torch.testing.assert_close(model.values.grad, expected.float())


@pytest.fixture(scope="module")
def task_and_model():
    cfg = validate(qa_config())
    model, tok = build_model(cfg)
    with torch.no_grad():  # make the patches matter (their output projection starts at zero)
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "patch" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return build_task(cfg, tok), model


def test_training_triples_and_their_batch(task_and_model):
    task, _ = task_and_model
    for silo in SILOS3:
        questions = task.questions[silo]["train"]
        assert len(questions) == 6 and all(0 < sum(q.labels) < len(q.labels) for q in questions)
        triples = task.examples(silo, "train")
        assert 6 <= len(triples) <= 12
        for t in triples:
            q = next(q for q in questions if q.text == t.question)
            assert dict(zip(q.candidates, q.labels))[t.positive] == 1
            assert dict(zip(q.candidates, q.labels))[t.negative] == 0
    again = build_task(validate(qa_config()), task.tokenizer)
    assert again.examples("trecqa", "train") == task.examples("trecqa", "train")  # fixed, not run-seeded
    batch = task.collate(task.examples("wikiqa", "train")[:3])
    assert batch["input_ids"].shape[0] == 6 and batch["input_ids"].shape[1] <= 48
    assert (batch["token_type_ids"].sum(1) > 0).all()  # '[CLS] q [SEP] a [SEP]': the answer segment


def test_evaluation_equals_scoring_each_pair_alone(task_and_model):
    task, model = task_and_model
    questions = [q for q in task.questions["trecqa"]["test"] if 0 < sum(q.labels) < len(q.labels)]
    expected = {"ap": 0.0, "rr": 0.0, "p1": 0.0, "questions": 0.0}
    with torch.no_grad():
        for q in questions:
            scores = [model(**task.encode([q.text], [c])).logits.item() for c in q.candidates]
            for k, v in question_stats(scores, q.labels).items():
                if k in expected:
                    expected[k] += v
    row = task.evaluate(model, "trecqa", "test")[0]
    for k, v in expected.items():
        assert row["stats"][k] == pytest.approx(v, abs=1e-9)


def test_bm25_reference_ranks_by_bm25_over_the_silo_pool(task_and_model):
    from fedsilo.tasks.matching.bm25 import Bm25Index
    from fedsilo.tasks.matching.benchmark import load_silo
    task, _ = task_and_model
    raw = load_silo(QA, "wikiqa", 5)
    texts = list(dict.fromkeys(c for s in ("train", "dev", "test") for q in raw[s] for c in q.candidates))
    index, at = Bm25Index(texts), {t: i for i, t in enumerate(texts)}
    ap = 0.0
    for q in task.questions["wikiqa"]["dev"]:
        if 0 < sum(q.labels) < len(q.labels):
            ap += question_stats([float(index.scores(q.text)[at[c]]) for c in q.candidates], q.labels)["ap"]
    row = task.reference("bm25", "wikiqa", "dev")[0]
    assert row["stats"]["ap"] == pytest.approx(ap)


def split_of(study: str, variant: str, names: list[str]) -> list[str]:
    from fedsilo.runs.studyfile import load_study
    _, configs = load_study(Path(__file__).resolve().parents[1] / "experiments" / "qa" / study, only=[variant])
    return exchange_plan(configs[variant]).split(names)[1]


MINILM_NAMES = ([f"bert.embeddings.{n}" for n in ("word_embeddings.weight", "LayerNorm.weight")] +
                [f"bert.encoder.layer.{i}.{n}" for i in range(6) for n in
                 ("attention.self.query.weight", "attention.output.LayerNorm.bias", "output.dense.weight")] +
                ["bert.pooler.dense.weight", "classifier.weight", "classifier.bias"])


def test_fedper_keeps_the_top_layer_and_head_local_lg_fedavg_the_bottom_layers():
    fedper = split_of("table3.toml", "fedper", MINILM_NAMES)
    assert fedper == [n for n in MINILM_NAMES if n.startswith(("bert.encoder.layer.5.", "bert.pooler", "classifier"))]
    lg = split_of("table3.toml", "lg_fedavg", MINILM_NAMES)
    assert lg == [n for n in MINILM_NAMES if n.startswith(("bert.embeddings", "bert.encoder.layer.0.",
                                                            "bert.encoder.layer.1."))]
    assert not any(n.startswith("classifier") for n in lg)  # LG-FedAvg: the head is global
    ln = split_of("table3.toml", "fedmatch_ln", MINILM_NAMES + ["bert.encoder.layer.0.patch.down.weight"])
    assert ln == [n for n in MINILM_NAMES + ["bert.encoder.layer.0.patch.down.weight"]
                  if "LayerNorm" in n or "patch" in n]


def test_client_sampling_trains_two_silos_per_round(tmp_path):
    out = tmp_path / "cs"
    run_experiment(validate(qa_config(federation={"sample_count": 2}, task={"max_eval": 2})), out, show_progress=False)
    for r in rounds_of(out):
        assert len(r["sampled"]) == 2 and sorted(r["clients"]) == sorted(r["sampled"])


def test_resume_equals_uninterrupted(fedmatch, tmp_path):
    uninterrupted, _, _ = fedmatch
    out = tmp_path / "resumed"
    run_experiment(validate(qa_config(federation={"rounds": 1})), out, show_progress=False)
    run_experiment(validate(qa_config()), out, resume=True, show_progress=False)
    for x, y in zip(rounds_of(uninterrupted), rounds_of(out)):
        for c in SILOS3:
            assert y["clients"][c]["losses"] == x["clients"][c]["losses"]
    pa = torch.load(uninterrupted / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=0)
    ra = json.loads((uninterrupted / "results.json").read_text())["test"]
    rb = json.loads((out / "results.json").read_text())["test"]
    assert rb["macro"] == ra["macro"]


def test_fedmatch_on_flower_simulation_matches_in_process(tmp_path):
    """The patches live on each silo (its own store) and never reach Flower's server."""
    from tests.parity import local_and_simulation
    cfg = validate(qa_config(task={"reference": []}))
    local_and_simulation(cfg, tmp_path)
    a, b = rounds_of(tmp_path / "local"), rounds_of(tmp_path / "sim")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        for c in SILOS3:
            assert y["clients"][c]["params_up"] == x["clients"][c]["params_up"]
            assert [v for _, v in y["clients"][c]["losses"]] == pytest.approx(
                [v for _, v in x["clients"][c]["losses"]], abs=2e-4)
    pa = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(tmp_path / "sim" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert sorted(pa) == sorted(pb) and not any("patch" in k for k in pb)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-5, atol=1e-6)
    ra = json.loads((tmp_path / "local" / "results.json").read_text())["test"]["rows"]
    rb = json.loads((tmp_path / "sim" / "results.json").read_text())["test"]["rows"]
    for x, y in zip(ra, rb):  # each silo evaluated with its own patches, on its own machine
        assert y["stats"]["ap"] == pytest.approx(x["stats"]["ap"], abs=1e-6)
