"""The multitask metrics as additive statistics, against scikit-learn, rouge, rouge-score and hand values;
no score depends on the string hash seed."""
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


def _pltrdy_f(p, r):
    """The `rouge` package's F: 2PR / (P + R + 1e-8)."""
    return 2 * p * r / (p + r + 1e-8)


def test_rouge_l_google_is_rouge_score_by_hand():
    from rouge_score import rouge_scorer
    ref, hyp = "the cat sat on the mat", "the cat lay on a mat"
    want = rouge_scorer.RougeScorer(["rougeL"]).score(ref, hyp)["rougeL"].fmeasure
    # LCS "the cat on mat" = 4 of 6 tokens each way: F = 2/3
    assert rouge_l(hyp, ref, "google") == pytest.approx(want) == pytest.approx(2 / 3)
    assert rouge_l("The Cat", "the cat", "google") == 1.0        # lower-cased
    assert rouge_l("cat, dog", "cat dog", "google") == 1.0       # punctuation is no token
    assert rouge_l("the the the", "the cat", "google") == pytest.approx(0.4)  # LCS 1: P 1/3, R 1/2
    assert rouge_l("x", "", "google") == 0.0


def test_rouge_l_crossfit_is_the_rouge_package_by_hand():
    ref, hyp = "the cat sat on the mat", "the cat lay on a mat"
    # distinct words: reference {the cat sat on mat} 5, prediction {the cat lay on a mat} 6, LCS words
    # {the cat on mat} 4: R 4/5, P 4/6 -> 8/11 (rouge-score: 2/3)
    assert rouge_l(hyp, ref) == pytest.approx(_pltrdy_f(4 / 6, 4 / 5), rel=1e-12)
    assert rouge_l(hyp, ref) == pytest.approx(8 / 11, abs=1e-7)
    assert rouge_l("The Cat", "the cat") == 0.0                   # case-sensitive
    assert rouge_l("cat, dog", "cat dog") == pytest.approx(_pltrdy_f(1 / 2, 1 / 2))  # "cat," is not "cat"
    assert rouge_l("the the the", "the cat") == pytest.approx(_pltrdy_f(1, 1 / 2))   # {the} of {the cat}
    # a period splits sentences; the union LCS over them finds all three words
    assert rouge_l("new york. city", "new york city") == pytest.approx(_pltrdy_f(1, 1))
    # exactly CrossFit's call (dataloader/metrics.py, get_rouge_over_list)
    from rouge import Rouge
    for p, r in ((hyp, ref), ("The Cat", "the cat"), ("a b. c a", "c a b")):
        assert rouge_l(p, r) == Rouge().get_scores(p, r, avg=True)["rouge-l"]["f"]
    with pytest.raises(ValueError, match="reference '...'"):   # CrossFit raises here too
        rouge_l("x", "...")


def test_rouge_l_zero_for_punctuation_only_and_the_best_reference_counts():
    ref, hyp = "the cat sat on the mat", "the cat lay on a mat"
    for scorer in ("crossfit", "google"):
        assert rouge_l("...", ref, scorer) == 0.0 and rouge_l("", ref, scorer) == 0.0
        want = rouge_l(hyp, ref, scorer)
        stats = example_stats("rouge_l", [hyp, "x"], [("unrelated words", ref), ("y",)], rouge=scorer)
        assert stats["rouge_sum"] == pytest.approx(want)
    assert _score("rouge_l", [hyp, "x"], [("unrelated words", ref), ("y",)]) == pytest.approx(100 * 8 / 11 / 2)
    with pytest.raises(ValueError, match="unknown ROUGE-L scorer 'bleu'"):
        rouge_l(hyp, ref, "bleu")


def test_the_rouge_setting_defaults_to_crossfit_and_names_the_bad_value():
    from pydantic import ValidationError

    from fedsilo.tasks.multitask.plugin import MultitaskSettings
    assert MultitaskSettings().rouge == "crossfit"
    assert MultitaskSettings(rouge="google").rouge == "google"
    with pytest.raises(ValidationError, match="rouge"):
        MultitaskSettings(rouge="pltrdy")


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


_HASH_PROBE = """
import random
from fedsilo.tasks.multitask.metrics import compute_metrics, example_stats
rng = random.Random(3)
labels = [f"label {i}" for i in range(60)]
gold = [rng.choice(labels) for _ in range(3000)]
pred = [g if rng.random() < 0.4 else rng.choice(labels) for g in gold]
stats = {**example_stats("macro_f1", pred, [(g,) for g in gold]), "loss_sum": 0.0, "loss_n": 0.0}
print(compute_metrics(stats)["score"].hex())
"""


def test_every_score_is_independent_of_the_string_hash_seed():
    # Summing per-label F1 in set order changed the last bits with PYTHONHASHSEED, so `fedsilo
    # compare` saw a "win" between identical predictions.
    import os
    import subprocess
    import sys

    outputs = set()
    for seed in ("0", "1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _HASH_PROBE], env=env, capture_output=True, text=True,
                              check=True)
        outputs.add(done.stdout.strip())
    assert len(outputs) == 1, outputs
