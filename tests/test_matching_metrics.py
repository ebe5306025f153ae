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
