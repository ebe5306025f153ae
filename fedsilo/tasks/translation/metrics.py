"""Translation metrics as additive sufficient statistics, so pooled corpus BLEU is exact.

Corpus BLEU is not the mean of per-silo BLEU: it is computed once from n-gram counts summed over all
sentences. A row therefore carries sacreBLEU's own corpus statistics (summed over its sentences),
and pooling rows (silos, or machines under Flower) is an element-wise sum:

- ``bleu_stats``: ``[sys_len, ref_len, correct_1..4, total_1..4]`` (sacreBLEU BLEU, 13a tokenizer,
  exp smoothing, mixed case, one reference);
- ``chrf_stats``: sacreBLEU chrF's ``[hyp, ref, match]`` counts per character order 1..6 (18 numbers);
- ``n``: sentences; ``loss_sum`` / ``loss_n``: summed teacher-forced token cross-entropy and the
  number of label tokens (target + EOS), so the test loss is a token-level mean.

The counting is sacreBLEU's (its ``_extract_corpus_statistics`` / ``_compute_score_from_stats``, the
same code ``corpus_bleu`` runs), never re-implemented here, so scores match ``sacrebleu`` exactly.
Hypotheses and references must be detokenised text, as sacreBLEU expects.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from fedsilo.tasks.base import Column, Metrics, MetricSpec, pool

__all__ = ["bleu_stats", "sentence_stats", "summed", "bleu_from_stats", "chrf_from_stats", "signatures", "compute_metrics", "SPEC"]

BLEU_LEN = 2 + 2 * BLEU().max_ngram_order   # sys_len, ref_len, correct_1..4, total_1..4
CHRF_LEN = 3 * CHRF().order                 # [hyp, ref, match] per character order 1..6


def _bleu() -> BLEU:
    # sacreBLEU's defaults, as `corpus_bleu` uses them; its "looks tokenised" warning (100 hypotheses
    # ending in " .") stays on: it is the one hint that someone forgot to detokenise.
    return BLEU()


def _chrf() -> CHRF:
    return CHRF()


def bleu_stats(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """{"bleu_stats", "chrf_stats", "n"} summed over sentence pairs (one reference each)."""
    return summed(sentence_stats(hypotheses, references))


def sentence_stats(hypotheses: Sequence[str], references: Sequence[str]) -> list[dict]:
    """Each sentence pair's {"bleu_stats", "chrf_stats", "n": 1}: sacreBLEU's per-sentence statistics,
    the very numbers its paired bootstrap resamples (a test set's items)."""
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    for what, texts in (("hypothesis", hypotheses), ("reference", references)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"{what} {bad} is {type(texts[bad]).__name__}, not str")
    if not hypotheses:  # sacreBLEU reads an empty reference list as "use the cache" and fails
        return []
    bleu = _bleu()._extract_corpus_statistics(hypotheses, [references])
    chrf = _chrf()._extract_corpus_statistics(hypotheses, [references])
    return [{"bleu_stats": [float(v) for v in b], "chrf_stats": [float(v) for v in c], "n": 1.0}
            for b, c in zip(bleu, chrf)]


def summed(sentences: Sequence[Mapping[str, Any]]) -> dict:
    """A row's stats from its sentences' (`sentence_stats`, perhaps with a loss each): their sum, zeros
    for no sentence."""
    return pool(sentences) if sentences else {"bleu_stats": [0.0] * BLEU_LEN, "chrf_stats": [0.0] * CHRF_LEN,
                                               "n": 0}


def _vector(stats: Mapping[str, Any] | Sequence[float], key: str, length: int) -> list[float]:
    vec = stats[key] if isinstance(stats, Mapping) else stats
    if len(vec) != length:
        raise ValueError(f"{key}: expected {length} numbers, got {len(vec)}")
    return [float(v) for v in vec]


@cache
def _scorers() -> tuple[BLEU, CHRF]:
    return _bleu(), _chrf()  # scoring from stats reads only their (fixed) settings


def bleu_from_stats(stats: Mapping[str, Any] | Sequence[float]) -> float:
    """Corpus BLEU from summed ``bleu_stats`` (a stats dict or the vector itself)."""
    return float(_scorers()[0]._compute_score_from_stats(_vector(stats, "bleu_stats", BLEU_LEN)).score)


def chrf_from_stats(stats: Mapping[str, Any] | Sequence[float]) -> float:
    """Corpus chrF from summed ``chrf_stats`` (a stats dict or the vector itself)."""
    return float(_scorers()[1]._compute_score_from_stats(_vector(stats, "chrf_stats", CHRF_LEN)).score)


@cache
def signatures() -> dict[str, str]:
    """sacreBLEU's reproducibility signatures of the two metrics, for results.json.

    sacreBLEU resolves ``nrefs`` only once it has seen references, so score one dummy pair first."""
    out = {}
    for name, metric in (("bleu", _bleu()), ("chrf", _chrf())):
        metric.corpus_score(["a"], [["a"]])
        out[name] = metric.get_signature().format()
    return out


def compute_metrics(stats: Mapping[str, Any]) -> Metrics:
    """bleu, chrf (sacreBLEU corpus scores, 0-100) and loss (mean token cross-entropy) from one
    row's (or pooled) stats; a score is None where there is nothing to score."""
    n = stats.get("n")
    loss_n = stats.get("loss_n")
    return {
        "bleu": bleu_from_stats(stats) if n else None,
        "chrf": chrf_from_stats(stats) if n else None,
        "loss": float(stats["loss_sum"]) / float(loss_n) if loss_n else None,
    }


SPEC = MetricSpec(
    columns=(
        Column("bleu", "BLEU"),
        Column("chrf", "chrF"),
        Column("loss", "test loss", fmt=".3f", higher_is_better=False),
    ),
    compute=compute_metrics,
    primary="bleu",
    higher_is_better=True,
    tie_break="loss",
    tie_break_higher_is_better=False,
    selection="macro",  # the paper averages BLEU over domains
    description=("One row per domain silo: BLEU and chrF are sacreBLEU corpus scores (BLEU: 13a tokenizer, "
                 "exp smoothing, mixed case; chrF: character 6-grams, beta 2) of the detokenised greedy "
                 "translations against one reference, and test loss is the mean teacher-forced "
                 "cross-entropy per target token (EOS included). The macro column is the mean over "
                 "domains, as the paper reports; pooled is the corpus score of all sentences together "
                 "(from summed n-gram counts, not a mean of the rows)."),
    signature="BLEU {bleu}; chrF {chrf}".format(**signatures()),
)
