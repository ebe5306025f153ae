"""BM25 as Lucene scores it, so as the Elasticsearch index the FedMatch paper mined negatives with.

Per query token: ``idf · tf / (tf + k1·(1 − b + b·dl/avgdl))`` with ``idf = ln(1 + (N − n + 0.5)/(n + 0.5))``
(``N`` texts, ``n`` of them holding the token; no ``(k1 + 1)`` factor, as in Lucene 8+), k1 = 1.2 and
b = 0.75 as Elasticsearch's defaults. Built on ``bm25s`` (``method="lucene"``) with our own
tokenisation; a token repeated in the query counts each time, as Lucene's duplicate clauses do.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from itertools import islice

import numpy as np

__all__ = ["K1", "B", "tokenize", "Bm25Index", "top_k"]

K1 = 1.2
B = 0.75

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens: the paper lower-cases and splits on whitespace; ``\\w+`` also drops
    the punctuation a whitespace split would glue to words (``insurance?``)."""
    return _WORD.findall(text.lower())


class Bm25Index:
    """Scores of one query against every text, in the order the texts were given."""

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s  # imports scipy: only paid when an index is built
        from bm25s.tokenization import Tokenized
        self._vocab: dict[str, int] = {}  # first-seen order, so ids do not depend on hash seeds
        ids = [[self._vocab.setdefault(t, len(self._vocab)) for t in tokenize(text)] for text in texts]
        self._n = len(ids)
        self._bm25 = bm25s.BM25(method="lucene", k1=K1, b=B, dtype="float64")
        self._bm25.index(Tokenized(ids=ids, vocab=self._vocab), create_empty_token=False, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """One float per text; all zeros when no query token occurs in any text."""
        tokens = [t for t in tokenize(query) if t in self._vocab]
        if not tokens:  # bm25s cannot take an empty query
            return np.zeros(self._n)
        return np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)


def top_k(scores: np.ndarray, k: int, exclude: Collection[int] = ()) -> list[int]:
    """Indices of the ``k`` highest scores, ties by lower index first, never one of ``exclude``."""
    skip = set(exclude)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return list(islice((i for i in order[:k + len(skip)].tolist() if i not in skip), k))
