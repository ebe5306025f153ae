"""The one shape every matching silo takes, a benchmark silo (benchmark.py) or an own source
(data.py): a question with its judged candidates; and the negatives BM25 mines for questions that
have none, which both need (MedQuAD and FiQA; an own source without labels).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .bm25 import Bm25Index, top_k

__all__ = ["SPLITS", "Question", "Asked", "judged_question", "mine_negatives"]

SPLITS = ("train", "dev", "test")

Asked = tuple[str, str, list[str]]  # qid, question, gold answers: a question still without negatives


@dataclass(frozen=True)
class Question:
    """One question and its judged candidates (no candidate text twice); ``qid`` is unique within
    the silo and split and points back to the source (an id, or the line or file it starts at)."""

    qid: str
    text: str
    candidates: tuple[str, ...]
    labels: tuple[int, ...]  # 1 relevant, 0 not, aligned with candidates


def judged_question(qid: str, text: str, judged: Iterable[tuple[str, int]]) -> Question:
    """Candidates in first-seen order, a repeated text once (relevant if any copy is)."""
    labels: dict[str, int] = {}
    for candidate, label in judged:
        labels[candidate] = max(label, labels.get(candidate, 0))
    return Question(qid, text, tuple(labels), tuple(labels.values()))


def mine_negatives(asked: list[Asked], pool: list[str], negatives: int) -> list[Question]:
    """Golds, then the ``negatives`` texts of ``pool`` (distinct texts) that BM25 ranks highest for
    the question, never one of its gold texts (pool texts are distinct, so no copy of one either)."""
    index = Bm25Index(pool)
    position = {text: i for i, text in enumerate(pool)}
    out = []
    for qid, question, golds in asked:
        mined = top_k(index.scores(question), negatives, exclude={position[g] for g in golds})
        out.append(Question(qid, question, tuple(golds) + tuple(pool[i] for i in mined),
                            (1,) * len(golds) + (0,) * len(mined)))
    return out
