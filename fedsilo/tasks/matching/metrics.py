"""Answer-selection metrics: MAP, MRR and P@1 over each question's candidate list (FedMatch §4.3).

A row's stats are additive sums over its questions, so pooling silos or machines is exact:
`ap` / `rr` / `p1` the summed average precision, reciprocal rank and precision at 1, `questions`
the questions they cover, `dropped` the questions left out because their list has no relevant or no
irrelevant candidate (every ranking of such a list scores the same, so it says nothing about the
model; the counts are reported), `hinge_sum` / `pairs` the pairwise hinge loss over every
(relevant, irrelevant) candidate pair of the scored questions, and `nonfinite` the questions left
unscored because a candidate's score is NaN or Inf. A NaN cannot be ranked (sorting with NaN keys is
arbitrary: an all-NaN scorer kept the data's order, AP 1.0 where relevant answers come first), so
such a question makes the row's MAP/MRR/P@1/loss None and the evaluation invalid
(`fedsilo.tasks.base.NONFINITE`): it is never selected as the best round, and the count is a column.

Ties are ranked pessimistically: a relevant candidate tied with irrelevant ones is placed after
them. So a scorer that gives every candidate the same score gets the worst ranking, never a lucky
one from the data's candidate order (TrecQA lists its relevant answers first).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fedsilo.tasks.base import NONFINITE, Column, MetricSpec

__all__ = ["SPEC", "question_stats", "rank_order"]


def rank_order(scores: Sequence[float], labels: Sequence[int]) -> list[int]:
    """Candidate indices from best to worst; ties put irrelevant candidates first, then list order."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], labels[i], i))


def question_stats(scores: Sequence[float], labels: Sequence[int], margin: float = 1.0) -> dict[str, float]:
    """One question's additive stats (see the module docstring)."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores for {len(labels)} candidates")
    positives = sum(1 for y in labels if y)
    if positives == 0 or positives == len(labels):
        return {"dropped": 1.0}
    if not all(math.isfinite(s) for s in scores):
        return {NONFINITE: 1.0}
    hits, precision_sum, first = 0, 0.0, None
    for rank, i in enumerate(rank_order(scores, labels), start=1):
        if labels[i]:
            hits += 1
            precision_sum += hits / rank
            first = first or rank
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    hinge = sum(max(0.0, margin - p + n) for p in pos for n in neg)
    return {"ap": precision_sum / positives, "rr": 1.0 / first, "p1": float(first == 1), "questions": 1.0,
            "hinge_sum": hinge, "pairs": float(len(pos) * len(neg))}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if den else None


def compute(stats: Mapping[str, float]) -> dict[str, float | None]:
    n, bad = stats.get("questions", 0.0), stats.get(NONFINITE, 0.0)
    if bad:  # an invalid row: no ranking metric at all, rather than one over the finite questions
        scores = dict.fromkeys(("map", "mrr", "p1", "loss"))
    else:
        scores = {"map": _ratio(stats.get("ap", 0.0), n), "mrr": _ratio(stats.get("rr", 0.0), n),
                  "p1": _ratio(stats.get("p1", 0.0), n),
                  "loss": _ratio(stats.get("hinge_sum", 0.0), stats.get("pairs"))}
    return {**scores, "questions": n, "dropped": stats.get("dropped", 0.0), NONFINITE: bad}


SPEC = MetricSpec(
    columns=(Column("map", "MAP", ".4f"), Column("mrr", "MRR", ".4f"), Column("p1", "P@1", ".4f"),
             Column("loss", "hinge loss", ".4f", higher_is_better=False),
             Column("questions", "questions", ".0f", in_macro=False),
             Column("dropped", "dropped (no pos./neg.)", ".0f", in_macro=False),
             Column(NONFINITE, "non-finite scores (questions)", ".0f", in_macro=False)),
    compute=compute, primary="map", tie_break="mrr", tie_break_higher_is_better=True, selection="macro",
    description="MAP / MRR / P@1 over each question's candidate list (ties ranked pessimistically); "
                "Macro = the mean over silos, the paper's \"overall\"; questions whose list has no relevant "
                "or no irrelevant candidate are dropped and counted; a question with a NaN/Inf score makes "
                "the evaluation invalid (counted, no MAP)",
)
