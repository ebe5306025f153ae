"""End to end on the in-process engine: a 3-silo federation with a tiny T5 on synthetic silos."""
import json

import pytest
import torch

from fedsilo.config import validate
from fedsilo.core.weighting import WEIGHTINGS, client_weights
from fedsilo.runs.runner import run_experiment
from tests.killed_run import interrupted_in_round_two
from tests.synth import tiny_config, write_silos


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_silos(tmp_path_factory.mktemp("t2s"))


def rounds_of(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def final_params(run):
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


def test_federated_run_three_silos_two_rounds(tmp_path, data_dir):
    cfg = validate(tiny_config(data_dir))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    assert [r["round"] for r in rounds] == [1, 2]
    model_bytes = None
    for r in rounds:
        clients = r["clients"]
        assert list(clients) == ["restaurants", "academic", "yelp"]
        # weights are Lorar's, recomputed from what the clients logged
        deltas = [max(v for _, v in c["losses"]) - min(v for _, v in c["losses"]) for c in clients.values()]
        expected = client_weights(WEIGHTINGS.get("lorar"), [c["n_examples"] for c in clients.values()], deltas)
        assert [c["weight"] for c in clients.values()] == pytest.approx(expected.values)
        assert sum(c["weight"] for c in clients.values()) == pytest.approx(1.0)
        model_bytes = model_bytes or clients["yelp"]["bytes_up"]
        assert all(c["bytes_up"] == c["bytes_down"] == model_bytes for c in clients.values())
        dev = r["dev"]  # the selection score is the pooled EM, recomputed from the rows' counts
        correct = sum(row["stats"]["correct"] for row in dev["rows"])
        assert dev["score"] == pytest.approx(100 * correct / sum(row["stats"]["n"] for row in dev["rows"]))
    # per-client hyper-parameters: yelp runs 2 local epochs of 12 examples at batch 4
    assert rounds[0]["clients"]["yelp"]["steps"] == 6 and rounds[0]["clients"]["academic"]["steps"] == 3
    # loss steps are cumulative per client across rounds
    assert rounds[1]["clients"]["academic"]["losses"][0][0] == 4
    assert [row["client"] for row in results["test"]["rows"]] == ["restaurants", "academic", "yelp"]
    assert all(row["stats"]["n"] == 4 for row in results["test"]["rows"])
    assert (tmp_path / "run" / "config.toml").exists() and (tmp_path / "run" / "best.pt").exists()
    best = max(rounds, key=lambda r: r["dev"]["key"])  # the earliest of equal keys
    assert results["best_round"] == best["round"]


def test_same_seed_is_bit_identical(tmp_path, data_dir):
    cfg = validate(tiny_config(data_dir, federation={"rounds": 1}))
    run_experiment(cfg, tmp_path / "a", show_progress=False)
    run_experiment(cfg, tmp_path / "b", show_progress=False)
    a, b = final_params(tmp_path / "a"), final_params(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_equals_uninterrupted(tmp_path, data_dir):
    full = validate(tiny_config(data_dir, federation={"rounds": 3}))
    run_experiment(full, tmp_path / "full", show_progress=False)
    short = validate(tiny_config(data_dir, federation={"rounds": 1}))
    run_experiment(short, tmp_path / "resumed", show_progress=False)
    run_experiment(full, tmp_path / "resumed", resume=True, show_progress=False)
    a, b = final_params(tmp_path / "full"), final_params(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["round"] for r in rounds_of(tmp_path / "resumed")] == [1, 2, 3]
    assert [r["clients"]["yelp"]["weight"] for r in rounds_of(tmp_path / "resumed")] == \
        [r["clients"]["yelp"]["weight"] for r in rounds_of(tmp_path / "full")]


def test_resume_of_a_finished_run_returns_its_results_without_work(tmp_path, data_dir, monkeypatch):
    cfg = validate(tiny_config(data_dir, federation={"rounds": 1}))
    first = run_experiment(cfg, tmp_path / "run", show_progress=False)
    import fedsilo.engines.local as local

    monkeypatch.setattr(local.LocalEngine, "evaluate", lambda *a, **k: pytest.fail("re-evaluated"))
    assert run_experiment(cfg, tmp_path / "run", resume=True, show_progress=False) == first


def test_interrupted_round_leaves_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
    cfg = validate(tiny_config(data_dir, federation={"rounds": 2}))
    run_experiment(cfg, tmp_path / "full", show_progress=False)
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "cut")
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert state["round"] == 1
    assert not list((tmp_path / "cut").glob("*.tmp"))
    run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    a, b = final_params(tmp_path / "full"), final_params(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("paradigm", ["centralized", "finetune"])
def test_other_paradigms(tmp_path, data_dir, paradigm):
    cfg = validate(tiny_config(data_dir, federation={"rounds": 1}) | {"paradigm": paradigm})
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert results["paradigm"] == paradigm
    assert [row["client"] for row in results["test"]["rows"]] == ["restaurants", "academic", "yelp"]
    if paradigm == "finetune":
        for silo in ("restaurants", "academic", "yelp"):
            (line,) = rounds_of(tmp_path / "run" / "silos" / silo)
            assert list(line["clients"]) == [silo]
    else:
        (line,) = rounds_of(tmp_path / "run")
        assert list(line["clients"]) == ["pooled"] and line["clients"]["pooled"]["n_examples"] == 36


def test_progress_shows_each_client_steps_and_round_log(tmp_path, data_dir):
    import io

    from rich.console import Console

    import fedsilo.runs.runner as runner
    from fedsilo.progress import Progress

    class Recording(Progress):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.bars = []

        def begin(self, description, total):
            super().begin(description, total)
            self.bars.append([description, total, 0])

        def advance(self, n=1):
            super().advance(n)
            self.bars[-1][2] += n

    buffer = io.StringIO()
    cfg = validate(tiny_config(data_dir, federation={"rounds": 1}))
    with Recording(console=Console(file=buffer, width=120)) as progress:
        runner.run_local(cfg, runner.RunDir(tmp_path / "run"), progress=progress)
    assert "round 1/1 done" in buffer.getvalue() and "dev EM %" in buffer.getvalue()
    training = {d: (total, done) for d, total, done in progress.bars if d.startswith("round")}
    assert training == {"round 1 · restaurants": (3, 3), "round 1 · academic": (3, 3), "round 1 · yelp": (6, 6)}
    evaluation = [b for b in progress.bars if b[0].startswith("evaluating")]
    assert [(t, d) for _, t, d in evaluation] == [(12, 12), (12, 12)]  # dev, then test


def test_local_checkpoint_folder_loads_unchanged(tmp_path, data_dir):
    """`model.name = <folder>`: any local Hugging Face seq2seq checkpoint, as a GPU user's t5-small."""
    from fedsilo.models.seq2seq import build_seq2seq

    from fedsilo.recipe import model_config

    built, tokenizer = build_seq2seq(model_config(validate(tiny_config(data_dir))), seed=7)
    folder = tmp_path / "my-t5"
    built.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded, _ = build_seq2seq(validate(tiny_config(data_dir, model={"name": str(folder)})).model)
    original = dict(built.named_parameters())
    assert all(torch.equal(p, original[n]) for n, p in loaded.named_parameters())
    cfg = validate(tiny_config(data_dir, model={"name": str(folder)}, federation={"rounds": 1}))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert [row["client"] for row in results["test"]["rows"]] == ["restaurants", "academic", "yelp"]


def test_missing_checkpoint_folder_is_named(tmp_path, data_dir):
    from fedsilo.config import ConfigError
    from fedsilo.models.seq2seq import build_seq2seq

    with pytest.raises(ConfigError, match="no-such-model"):
        build_seq2seq(validate(tiny_config(data_dir, model={"name": str(tmp_path / "no-such-model")})).model)
