"""The multitask task on the real sources: FewFedWeight end to end over 2 clients x 2 real tasks with a
tiny T5 (one task of each kind of metric and sampling), every (client, task) row scored by its own metric."""
import json

import pytest

from fedsilo.config import validate
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.multitask.catalog import CATALOG
from tests.mtoy import FEWFEDWEIGHT
from tests.mtreal import MT, needs_mt

TASKS = ["superglue-cb", "numer_sense", "glue-cola", "aeslc"]


@needs_mt
def test_fewfedweight_on_real_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    cfg = validate({
        "name": "mt-real", "seed": 0,
        "task": {"name": "multitask", "data_dir": str(MT), "tasks": TASKS, "clients": 2, "k_per_class": 4,
                 "k_total": 8, "max_source_length": 48, "max_target_length": 12, "eval_batch_size": 16},
        "model": {"kind": "seq2seq", "name": "tiny-t5", "d_model": 32, "d_ff": 64, "num_layers": 1,
                  "num_decoder_layers": 1, "num_heads": 2, "dropout": 0.0},
        "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "logging_steps": 1, **FEWFEDWEIGHT["client"]},
        "exchange": FEWFEDWEIGHT["exchange"],
        "federation": {"rounds": 2, **FEWFEDWEIGHT["federation"]},
    })
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rows = results["test"]["rows"]
    assert sorted(r["task"] for r in rows) == sorted(TASKS)
    assert sorted({r["client"] for r in rows}) == ["client_1", "client_2"]
    for r in rows:
        metric = CATALOG.get(r["task"]).metric
        score = r["metrics"]["score"]
        assert (-100 <= score <= 100) if metric == "mcc" else (0 <= score <= 100), (r["task"], score)
        assert r["stats"]["n"] > 0 and r["metrics"]["loss"] > 0
    cb = next(r for r in rows if r["task"] == "superglue-cb")
    assert cb["stats"]["n"] == 12  # CB's few-shot test: 4 per class x 3 classes
    records = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    for record in records:
        clients = record["clients"]
        total = sum(c["mean_loss"] for c in clients.values())
        for c in clients.values():
            assert c["terms"]["pseudo"] > 0 and c["weight"] == pytest.approx(c["mean_loss"] / total, rel=1e-9)
            assert c["phase_seconds"]["before_training"] > 0 and c["phase_seconds"]["training"] > 0
