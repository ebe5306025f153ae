"""Model selection never picks an invalid evaluation (non-finite model scores or a NaN primary
metric), and the report says which evaluations were invalid."""
import json

import pytest

from fedsilo.rundir import records
from fedsilo.runs import report
from fedsilo.tasks.base import Column, MetricSpec, pool, select_best
from fedsilo.tasks.matching.metrics import SPEC, question_stats

NAN = float("nan")


def _dev(scores_per_question):
    """A one-silo dev summary of TrecQA-like lists (relevant answer first) scored as given."""
    stats = pool([question_stats(scores, [1, 0, 0]) for scores in scores_per_question])
    return SPEC.summarize([{"client": "trecqa", "task": "matching", "stats": stats}])


def _runner_best(devs):
    """The runner's rule (fedsilo.runs.runner.run_federation): a round becomes best when select_best
    prefers it to the best so far."""
    best = None
    for r, dev in enumerate(devs, start=1):
        candidate = {"key": dev["key"], "round": r, "score": dev["score"]}
        if select_best([c for c in (best, candidate) if c]) is candidate:
            best = candidate
    return best


def test_a_round_with_nan_scores_is_never_best_even_after_worse_rounds():
    worse = _dev([[0.1, 0.5, 0.9], [0.2, 0.1, 0.3]])       # MAP (1/3 + 1/2) / 2
    nan = _dev([[NAN, NAN, NAN], [0.9, 0.1, NAN]])          # the data order alone would give MAP 1.0
    assert worse["score"] == pytest.approx(5 / 12)
    assert nan["key"] is None and nan["score"] is None and nan["nonfinite"] == 2
    assert _runner_best([worse, nan])["round"] == 1
    assert _runner_best([nan, worse, nan])["round"] == 2
    assert _runner_best([nan]) is None                       # the runner then fails with a clear error
    rounds = [{"round": i, "dev": d} for i, d in enumerate([worse, nan], start=1)]
    assert records.best_round(json.loads(json.dumps(rounds))) == (1, pytest.approx(5 / 12))


def test_a_nan_primary_metric_is_never_best_but_a_missing_one_still_ranks_last():
    spec = MetricSpec(columns=(Column("score", "score"), Column("loss", "loss")), compute=dict, primary="score")

    def summarize(score):
        return spec.summarize([{"client": "c", "task": "t", "stats": {"score": score, "loss": 1.0}}])

    nan, missing, low = summarize(NAN), summarize(None), summarize(-5.0)
    assert nan["key"] is None
    assert select_best([{"key": nan["key"]}, {"key": low["key"]}])["key"] == low["key"]
    # None means "nothing to score" (no dev data), not a broken model: last, but still selectable
    assert select_best([{"key": missing["key"]}])["key"] == missing["key"]
    assert select_best([{"key": missing["key"]}, {"key": low["key"]}])["key"] == low["key"]


def test_the_report_warns_of_each_invalid_evaluation(tmp_path):
    worse, nan = _dev([[0.1, 0.5, 0.9]]), _dev([[NAN, 0.5, 0.9]] * 3)
    run = tmp_path / "run"
    run.mkdir()
    rounds = [{"round": 1, "seconds": 1.0, "dev": worse}, {"round": 2, "seconds": 1.0, "dev": nan}]
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (run / "config.toml").write_text('paradigm = "federated"\n[task]\nname = "matching"\n')
    md = report.write_report(run).read_text()
    assert "- Warning: invalid evaluation, round 2 dev: 3 item(s) scored NaN/Inf by the model" in md
    assert "- Best round: 1 (dev MAP 0.3333)" in md
    assert "round 1 dev" not in md and "test:" not in md
    results = {"name": "run", "task": "matching", "paradigm": "federated", "rounds": 2, "best_round": 1,
               "best_dev": worse["score"], "metric_spec": SPEC.describe(), "test": nan}
    (run / "results.json").write_text(json.dumps(results))
    md = report.write_report(run).read_text()
    assert "- Warning: invalid evaluation, test: 3 item(s) scored NaN/Inf by the model" in md
    assert "| non-finite scores (questions) | 3 | - | 3 |" in md  # the silo, Macro (none), Pooled
