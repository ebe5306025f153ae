"""MAP / MRR / P@1 of answer selection: hand-computed rankings (ties, single candidates, lists with no
relevant or no irrelevant answer), trec_eval (pytrec_eval) on random tie-free lists, exact pooling."""
import random

import pytest

from fedsilo.tasks.base import pool
from fedsilo.tasks.matching.metrics import SPEC, question_stats, rank_order


def test_hand_computed_ranking():
    # order by score: c (rel), a (irr), d (rel), b (irr) -> AP = (1/1 + 2/3) / 2, RR = 1, P@1 = 1
    s = question_stats([0.5, 0.1, 0.9, 0.3], [0, 0, 1, 1])
    assert s["ap"] == pytest.approx((1 + 2 / 3) / 2)
    assert s["rr"] == 1.0 and s["p1"] == 1.0 and s["questions"] == 1.0
    # relevant at ranks 2 and 4 -> AP = (1/2 + 2/4) / 2 = 0.5, RR = 1/2, P@1 = 0
    s = question_stats([0.9, 0.8, 0.7, 0.6], [0, 1, 0, 1])
    assert (s["ap"], s["rr"], s["p1"]) == (pytest.approx(0.5), 0.5, 0.0)


def test_ties_rank_relevant_candidates_after_irrelevant_ones():
    assert rank_order([1.0, 1.0, 1.0], [1, 0, 0]) == [1, 2, 0]
    # a constant scorer gets the worst ranking: relevant last -> AP = 1/3, RR = 1/3
    s = question_stats([0.0, 0.0, 0.0], [1, 0, 0])
    assert s["ap"] == pytest.approx(1 / 3) and s["rr"] == pytest.approx(1 / 3) and s["p1"] == 0.0
    # a tie between the two relevant ones does not matter; a tie with an irrelevant one does
    s = question_stats([2.0, 2.0, 1.0, 2.0], [1, 1, 0, 0])
    assert s["ap"] == pytest.approx((1 / 2 + 2 / 3) / 2) and s["rr"] == 0.5


def test_questions_without_a_relevant_or_irrelevant_candidate_are_dropped_and_counted():
    assert question_stats([0.3], [1]) == {"dropped": 1.0}          # single candidate
    assert question_stats([0.3, 0.1], [0, 0]) == {"dropped": 1.0}  # no relevant answer
    assert question_stats([0.3, 0.1], [1, 1]) == {"dropped": 1.0}  # no irrelevant answer
    rows = [question_stats([0.3], [1]), question_stats([0.9, 0.1], [0, 1]), question_stats([0.9, 0.1], [1, 0])]
    m = SPEC.compute(pool(rows))
    assert m["questions"] == 2 and m["dropped"] == 1
    assert m["map"] == pytest.approx((0.5 + 1.0) / 2) and m["mrr"] == pytest.approx(0.75) and m["p1"] == 0.5


def test_hinge_loss_over_every_relevant_irrelevant_pair():
    s = question_stats([2.0, 0.5, 1.8], [1, 0, 0], margin=1.0)
    assert s["hinge_sum"] == pytest.approx(max(0, 1 - 2 + 0.5) + max(0, 1 - 2 + 1.8)) and s["pairs"] == 2
    assert SPEC.compute(s)["loss"] == pytest.approx(0.8 / 2)


def test_map_mrr_p1_equal_trec_eval_on_random_lists():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rng = random.Random(7)
    qrels, run, ours = {}, {}, []
    for q in range(200):
        n = rng.randint(2, 30)
        labels = [int(rng.random() < 0.25) for _ in range(n)]
        labels[rng.randrange(n)] = 1
        if all(labels):
            labels[0] = 0
        scores = rng.sample(range(10_000), n)  # distinct: trec_eval breaks ties its own way
        qrels[f"q{q}"] = {f"d{i}": y for i, y in enumerate(labels)}
        run[f"q{q}"] = {f"d{i}": float(s) for i, s in enumerate(scores)}
        ours.append(question_stats([float(s) for s in scores], labels))
    trec = pytrec_eval.RelevanceEvaluator(qrels, {"map", "recip_rank", "P_1"}).evaluate(run)
    for q, stats in zip(trec.values(), ours):
        assert stats["ap"] == pytest.approx(q["map"], abs=1e-12)
        assert stats["rr"] == pytest.approx(q["recip_rank"], abs=1e-12)
        assert stats["p1"] == pytest.approx(q["P_1"], abs=1e-12)


def test_macro_is_the_mean_over_silos_and_pooled_is_over_questions():
    a = pool([question_stats([1.0, 0.0], [1, 0])] * 3)           # MAP 1.0 over 3 questions
    b = pool([question_stats([0.0, 1.0], [1, 0])])               # MAP 0.5 over 1 question
    summary = SPEC.summarize([{"client": "x", "task": "matching", "stats": a},
                              {"client": "y", "task": "matching", "stats": b}])
    assert summary["macro"]["map"] == pytest.approx(0.75)         # the paper's "overall"
    assert summary["pooled"]["map"] == pytest.approx(3.5 / 4)
    assert summary["score"] == pytest.approx(0.75)                # selection on the macro MAP


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_score_leaves_the_question_unscored_and_counted(bad):
    # Sorting NaN keys kept the data's order: relevant-first lists got AP 1.0 from an all-NaN scorer.
    assert question_stats([bad] * 4, [1, 0, 0, 0]) == {"nonfinite": 1.0}
    assert question_stats([0.9, bad, 0.1], [1, 0, 0]) == {"nonfinite": 1.0}
    assert question_stats([bad], [1]) == {"dropped": 1.0}  # never scored anyway: only dropped
    m = SPEC.compute(pool([question_stats([0.9, 0.1], [1, 0]), question_stats([bad, 0.1], [1, 0])]))
    assert m["nonfinite"] == 1 and m["questions"] == 1
    assert (m["map"], m["mrr"], m["p1"], m["loss"]) == (None, None, None, None)


def test_one_silo_with_nan_scores_invalidates_the_whole_evaluation():
    good = pool([question_stats([1.0, 0.0], [1, 0])] * 3)
    nan = pool([question_stats([float("nan")] * 3, [1, 0, 0])] * 2)
    summary = SPEC.summarize([{"client": "x", "task": "matching", "stats": good},
                              {"client": "y", "task": "matching", "stats": nan}])
    assert summary["rows"][0]["metrics"]["map"] == 1.0 and summary["rows"][1]["metrics"]["map"] is None
    assert summary["nonfinite"] == 2 and summary["rows"][1]["metrics"]["nonfinite"] == 2
    # not the mean over the finite silo alone: the macro of an incomplete evaluation is no "overall"
    assert summary["macro"]["map"] is None and summary["pooled"]["map"] is None
    assert summary["score"] is None and summary["key"] is None


def _trec(labels, scores, docnos):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    qrels = {"q": {d: y for d, y in zip(docnos, labels)}}
    run = {"q": {d: float(s) for d, s in zip(docnos, scores)}}
    return pytrec_eval.RelevanceEvaluator(qrels, {"map", "recip_rank", "P_1"}).evaluate(run).get("q")


def test_ties_differ_from_trec_eval_which_orders_them_by_docno_descending():
    # docs/matching.md: trec_eval ranks tied documents by docno in reverse lexical order; we put the
    # irrelevant ones first. Same list, same scores: trec_eval's value depends on the names.
    labels, scores = [1, 0, 0], [1.0, 1.0, 0.5]
    ours = question_stats(scores, labels)
    assert ours["ap"] == 0.5 and ours["rr"] == 0.5 and ours["p1"] == 0.0
    assert _trec(labels, scores, ["d1", "d0", "d2"])["map"] == 1.0     # relevant "d1" > "d0": first
    assert _trec(labels, scores, ["d0", "d1", "d2"])["map"] == 0.5     # relevant "d0" < "d1": after
    assert _trec(labels, scores, ["d9", "d10", "d2"])["map"] == 1.0    # lexical, not numeric


def test_with_tie_breaking_names_trec_eval_equals_ours_and_otherwise_is_never_lower():
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(2, 12)
        labels = [int(rng.random() < 0.4) for _ in range(n)]
        labels[0], labels[-1] = 1, 0
        scores = [float(rng.randint(0, 3)) for _ in range(n)]  # many ties
        ours = question_stats(scores, labels)
        # irrelevant documents named to sort after relevant ones lexically: trec_eval ranks them first
        pessimistic = _trec(labels, scores, [f"{1 - y}-{i:03d}" for i, y in enumerate(labels)])
        assert (ours["ap"], ours["rr"], ours["p1"]) == pytest.approx(
            (pessimistic["map"], pessimistic["recip_rank"], pessimistic["P_1"]), abs=1e-12)
        plain = _trec(labels, scores, [f"d{i:03d}" for i in range(n)])
        assert plain["map"] >= ours["ap"] - 1e-12 and plain["recip_rank"] >= ours["rr"] - 1e-12


def test_lists_we_drop_trec_eval_scores_zero_or_one():
    # no relevant candidate: trec_eval gives 0 (and averages it in); no irrelevant one: 1. We drop both
    # and count them, so on a silo with such questions our MAP is over fewer questions.
    assert question_stats([0.9, 0.1], [0, 0]) == {"dropped": 1.0}
    assert _trec([0, 0], [0.9, 0.1], ["a", "b"]) == {"map": 0.0, "recip_rank": 0.0, "P_1": 0.0}
    assert question_stats([0.9, 0.1], [1, 1]) == {"dropped": 1.0}
    assert _trec([1, 1], [0.1, 0.9], ["a", "b"]) == {"map": 1.0, "recip_rank": 1.0, "P_1": 1.0}
    assert _trec([1], [0.3], ["a"]) == {"map": 1.0, "recip_rank": 1.0, "P_1": 1.0}
