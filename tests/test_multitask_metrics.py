"""The multitask metrics as additive statistics, against scikit-learn, rouge-score and hand values."""
import random

import pytest
from sklearn.metrics import f1_score, matthews_corrcoef

from fedsilo.tasks.base import pool
from fedsilo.tasks.multitask.metrics import SPEC, compute_metrics, example_stats, normalize_answer, qa_f1, rouge_l


def _score(metric, preds, refs):
    return compute_metrics({**example_stats(metric, preds, refs), "loss_sum": 0.0, "loss_n": 0.0})["score"]


def test_macro_f1_equals_sklearn_on_random_labels_including_strays():
    rng = random.Random(0)
    for _ in range(50):
        labels = ["pos", "neg", "neutral"][: rng.randint(2, 3)]
        gold = [rng.choice(labels) for _ in range(rng.randint(1, 40))]
        pred = [rng.choice(labels + ["garbage", "Pos"]) for _ in gold]  # stray strings are labels too
        want = 100 * f1_score(gold, pred, average="macro", zero_division=0)
        assert _score("macro_f1", pred, [(g,) for g in gold]) == pytest.approx(want, abs=1e-9)


def test_macro_f1_pools_exactly_over_batches():
    gold = ["a", "b", "a", "c", "b", "a"]
    pred = ["a", "a", "c", "c", "b", "x"]
    whole = example_stats("macro_f1", pred, [(g,) for g in gold])
    parts = pool([example_stats("macro_f1", pred[:2], [(g,) for g in gold[:2]]),
                  example_stats("macro_f1", pred[2:], [(g,) for g in gold[2:]])])
    assert compute_metrics(parts)["score"] == pytest.approx(compute_metrics(whole)["score"])


def test_mcc_equals_sklearn():
    rng = random.Random(1)
    for _ in range(30):
        gold = [rng.choice(["acceptable", "unacceptable"]) for _ in range(30)]
        pred = [rng.choice(["acceptable", "unacceptable", "acceptable "]) for _ in gold]
        want = matthews_corrcoef([g == "acceptable" for g in gold], [p.strip() == "acceptable" for p in pred])
        assert _score("mcc", pred, [(g,) for g in gold]) == pytest.approx(100 * want, abs=1e-9)
    assert _score("mcc", ["acceptable"] * 3, [("acceptable",), ("unacceptable",), ("acceptable",)]) == 0.0


def test_accuracy_is_case_insensitive_and_takes_the_best_reference():
    assert _score("acc", ["Positive", "no", "b"], [("positive",), ("yes",), ("a", "B")]) == pytest.approx(200 / 3)


def test_exact_match_normalises_like_squad():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert _score("em", ["the answer.", "an apple"], [("Answer",), ("apple pie", "Apple")]) == 100.0


def test_qa_f1_by_hand():
    # pred tokens {new, york, city}, gold {new, york}: P 2/3, R 1, F1 0.8
    assert qa_f1("New York City", "new york") == pytest.approx(0.8)
    assert qa_f1("paris", "london") == 0.0
    assert _score("qa_f1", ["New York City"], [("boston", "new york")]) == pytest.approx(80.0)


def test_rouge_l_matches_rouge_score_and_zero_for_punctuation_only():
    from rouge_score import rouge_scorer
    ref, hyp = "the cat sat on the mat", "the cat lay on a mat"
    want = rouge_scorer.RougeScorer(["rougeL"]).score(ref, hyp)["rougeL"].fmeasure
    assert rouge_l(hyp, ref) == pytest.approx(want)
    # LCS "the cat on mat" = 4 of 6 tokens each way: F = 2/3
    assert want == pytest.approx(2 / 3)
    assert rouge_l("...", ref) == 0.0 and rouge_l("", ref) == 0.0
    assert _score("rouge_l", [hyp, "x"], [("unrelated words", ref), ("y",)]) == pytest.approx(100 * want / 2)


def test_pooled_rows_of_different_metrics_have_no_score_but_macro_does():
    rows = [{"client": "c", "task": "t1", "stats": {**example_stats("acc", ["a"], [("a",)]), "loss_sum": 2.0,
                                                     "loss_n": 1.0}},
            {"client": "c", "task": "t2", "stats": {**example_stats("em", ["b"], [("c",)]), "loss_sum": 0.0,
                                                     "loss_n": 1.0}}]
    summary = SPEC.summarize(rows)
    assert summary["pooled"]["score"] is None and summary["pooled"]["loss"] == pytest.approx(1.0)
    assert summary["macro"]["score"] == pytest.approx(50.0) and summary["score"] == pytest.approx(50.0)


def test_unknown_metric_is_an_error():
    with pytest.raises(ValueError, match="unknown multitask metric"):
        example_stats("bleu", ["a"], [("a",)])
