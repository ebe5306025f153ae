import math

import pytest
import sacrebleu

from fedsilo.tasks.base import add_stats
from fedsilo.tasks.translation.metrics import (
    SPEC,
    bleu_from_stats,
    bleu_stats,
    chrf_from_stats,
    compute_metrics,
    signatures,
)

HYPS = [
    "The cat sat on the mat.",                      # perfect match
    "",                                             # empty hypothesis
    "A dog was running in the park yesterday.",
    "He said that he would come tomorrow, maybe.",
    "Die Größe des Hauses überraschte uns.",
    "short",
]
REFS = [
    "The cat sat on the mat.",
    "Nobody answered the phone.",
    "Yesterday a dog ran through the park.",
    "He said he would come tomorrow.",
    "Die Größe des Hauses hat uns überrascht.",
    "This reference is much longer than its hypothesis.",
]


def test_scores_from_stats_equal_sacrebleu():
    stats = bleu_stats(HYPS, REFS)
    assert stats["n"] == len(HYPS)
    assert len(stats["bleu_stats"]) == 10 and len(stats["chrf_stats"]) == 18
    assert all(isinstance(v, float) for v in stats["bleu_stats"] + stats["chrf_stats"])
    bleu = sacrebleu.corpus_bleu(HYPS, [REFS]).score
    chrf = sacrebleu.corpus_chrf(HYPS, [REFS]).score
    assert 0 < bleu < 100 and 0 < chrf < 100
    assert bleu_from_stats(stats) == pytest.approx(bleu, abs=1e-9)
    assert chrf_from_stats(stats) == pytest.approx(chrf, abs=1e-9)
    # the vector itself works as well as the stats dict
    assert bleu_from_stats(stats["bleu_stats"]) == pytest.approx(bleu, abs=1e-9)


def test_perfect_and_empty_corpora():
    assert bleu_from_stats(bleu_stats(HYPS[:1], REFS[:1])) == pytest.approx(100.0)
    assert chrf_from_stats(bleu_stats(HYPS[:1], REFS[:1])) == pytest.approx(100.0)
    empty = bleu_stats([""], ["Nobody answered the phone."])
    assert empty["bleu_stats"][0] == 0 and empty["bleu_stats"][1] == 5  # sys_len 0, ref_len 5 (13a)
    assert bleu_from_stats(empty) == 0.0 and chrf_from_stats(empty) == 0.0


def test_pooled_stats_give_corpus_bleu_not_mean_of_halves():
    a = bleu_stats(HYPS[:2], REFS[:2])  # a perfect and an empty hypothesis
    b = bleu_stats(HYPS[2:], REFS[2:])
    pooled = add_stats(a, b)
    assert pooled["n"] == len(HYPS)
    corpus = sacrebleu.corpus_bleu(HYPS, [REFS]).score
    assert bleu_from_stats(pooled) == pytest.approx(corpus, abs=1e-9)
    assert chrf_from_stats(pooled) == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score, abs=1e-9)
    mean = (bleu_from_stats(a) + bleu_from_stats(b)) / 2
    assert abs(mean - corpus) > 3.0  # averaging per-silo BLEU is a different number (35.6 vs 32.2)


def test_compute_metrics():
    stats = {**bleu_stats(HYPS, REFS), "loss_sum": 30.0, "loss_n": 12}
    m = compute_metrics(stats)
    assert m["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score, abs=1e-9)
    assert m["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score, abs=1e-9)
    assert m["loss"] == pytest.approx(2.5)
    none = compute_metrics(bleu_stats([], []))
    assert none == {"bleu": None, "chrf": None, "loss": None}
    assert compute_metrics({**bleu_stats(HYPS, REFS), "loss_sum": 0.0, "loss_n": 0})["loss"] is None


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu_stats(["a", "b"], ["a"])
    with pytest.raises(TypeError, match="reference 0 is NoneType"):
        bleu_stats(["a"], [None])
    with pytest.raises(ValueError, match="bleu_stats: expected 10"):
        bleu_from_stats({"bleu_stats": [1.0, 2.0]})


def test_signatures():
    sig = signatures()
    assert "tok:13a" in sig["bleu"] and "smooth:exp" in sig["bleu"] and "nrefs:1" in sig["bleu"]
    assert f"version:{sacrebleu.__version__}" in sig["bleu"]
    assert "nc:6" in sig["chrf"] and "nw:0" in sig["chrf"] and f"version:{sacrebleu.__version__}" in sig["chrf"]


def test_spec_summarize_macro_and_pooled():
    news = {**bleu_stats(HYPS[:3], REFS[:3]), "loss_sum": 10.0, "loss_n": 5}
    ted = {**bleu_stats(HYPS[3:], REFS[3:]), "loss_sum": 9.0, "loss_n": 3}
    summary = SPEC.summarize([{"client": "news", "task": "translation", "stats": news},
                              {"client": "ted", "task": "translation", "stats": ted}])
    bleus = [bleu_from_stats(news), bleu_from_stats(ted)]
    assert summary["macro"]["bleu"] == pytest.approx(sum(bleus) / 2)
    assert summary["macro"]["loss"] == pytest.approx((2.0 + 3.0) / 2)
    assert summary["pooled"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score, abs=1e-9)
    assert summary["pooled"]["loss"] == pytest.approx(19.0 / 8)
    assert summary["score"] == summary["macro"]["bleu"]  # selection is on the macro mean
    assert not math.isclose(summary["macro"]["bleu"], summary["pooled"]["bleu"])
    assert summary["key"] == [pytest.approx(summary["macro"]["bleu"]), pytest.approx(-2.5)]
