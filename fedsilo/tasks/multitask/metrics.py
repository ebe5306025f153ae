"""Each task's metric as CrossFit defines it (dataloader/metrics.py), as additive statistics.

One evaluation row is one (client, task) pair. Its statistics are sums, so a row split over
batches (or machines) pools exactly:

- acc: ``acc_sum`` — predictions equal to a reference, case-insensitively (CrossFit's ``accuracy``).
- em: ``em_sum`` — equal to a reference after SQuAD normalisation (lower case, no punctuation or
  articles, single spaces).
- qa_f1: ``f1_sum`` — the best SQuAD token F1 over the references.
- rouge_l: ``rouge_sum`` — the best ROUGE-L F-measure over the references, by one of two scorers
  (the task setting ``rouge``; see :func:`rouge_l`). A prediction without any non-punctuation
  character scores 0, as in CrossFit.
- macro_f1: ``tp|<label>``, ``fp|<label>``, ``fn|<label>`` — per-label counts over the first
  reference (the gold label) and the prediction; macro F1 is the mean F1 over every label that
  occurs as gold or prediction, an F1 with no support being 0: scikit-learn's
  ``f1_score(average="macro")``, which CrossFit calls.
- mcc: ``mcc_tp``, ``mcc_tn``, ``mcc_fp``, ``mcc_fn`` — "acceptable" vs everything else, as
  CrossFit's ``get_matthews_corr`` binarises.

Every row has ``n`` (examples) and ``loss_sum`` / ``loss_n`` (teacher-forced token cross-entropy of
the first reference). Metric values are in [0, 100] (MCC in [-100, 100]); a pooled row mixing
tasks with different metrics has no score.
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache, partial
from typing import Any

from fedsilo.tasks.base import Column, MetricSpec, Metrics, Stats, pool

SUM_KEYS = {"acc": "acc_sum", "em": "em_sum", "qa_f1": "f1_sum", "rouge_l": "rouge_sum"}
METRICS = (*SUM_KEYS, "macro_f1", "mcc")
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD's normalisation, as CrossFit's."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def qa_f1(prediction: str, reference: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


ROUGE_SCORERS = ("crossfit", "google")


@cache
def _scorer(name: str):
    if name == "crossfit":
        from rouge import Rouge
        return Rouge(metrics=["rouge-l"], stats=["f"])  # its ROUGE-L does not depend on the others
    if name == "google":
        from rouge_score import rouge_scorer
        return rouge_scorer.RougeScorer(["rougeL"])
    raise ValueError(f"unknown ROUGE-L scorer {name!r}; known: {', '.join(ROUGE_SCORERS)}")


def rouge_l(prediction: str, reference: str, scorer: str = "crossfit") -> float:
    """ROUGE-L F-measure of `prediction` against one `reference`, in [0, 1].

    ``crossfit`` (the default) is what CrossFit's ``get_rouge_over_list`` calls, the `rouge` package
    (pltrdy): ``Rouge().get_scores(prediction, reference, avg=True)["rouge-l"]["f"]``. FewFedWeight
    evaluates on CrossFit's tasks with "the widely-used metric" of each, so this is the scorer its
    numbers are comparable with. It is case-sensitive, splits on spaces only (``"cat,"`` is not
    ``"cat"``), splits sentences at periods (union LCS), counts distinct words, and adds 1e-8 to the
    F denominator; a reference without any word (``""``, ``"..."``) is a ValueError there, as in
    CrossFit. ``google`` is Google's `rouge-score` (``RougeScorer(["rougeL"])``): lower-cased,
    alphanumeric tokens, one LCS over every token. docs/multitask.md measures the difference."""
    rouge = _scorer(scorer)
    if not any(ch not in _PUNCT and not ch.isspace() for ch in prediction):
        return 0.0
    if scorer == "google":
        return rouge.score(reference, prediction)["rougeL"].fmeasure
    try:
        return float(rouge.get_scores(prediction, reference, avg=True)["rouge-l"]["f"])
    except ValueError as err:
        raise ValueError(f"ROUGE-L ({scorer}): cannot score the prediction {prediction!r} against the "
                         f"reference {reference!r}: {err}") from None


def _best(score, prediction: str, references: Sequence[str]) -> float:
    return max((float(score(prediction, r)) for r in references), default=0.0)


def example_stats(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]],
                  rouge: str = "crossfit") -> Stats:
    """The additive statistics of `metric` over aligned predictions and reference lists; `rouge`
    names the ROUGE-L scorer (:func:`rouge_l`). The sum of each example's (:func:`item_stats`)."""
    if metric not in METRICS:
        raise ValueError(f"unknown multitask metric {metric!r}")
    if not predictions:
        zeros = {"mcc": dict.fromkeys(("mcc_tp", "mcc_tn", "mcc_fp", "mcc_fn"), 0.0)}.get(metric, {})
        return {**({SUM_KEYS[metric]: 0.0} if metric in SUM_KEYS else zeros), "n": 0}
    return pool([item_stats(metric, p, refs, rouge) for p, refs in zip(predictions, references)])


def item_stats(metric: str, prediction: str, references: Sequence[str], rouge: str = "crossfit") -> Stats:
    """One example's statistics of `metric` (with ``n`` = 1): a test set's item, what a paired
    randomisation test permutes."""
    if metric == "acc":
        return {"acc_sum": _best(lambda p, r: p.lower() == r.lower(), prediction, references), "n": 1.0}
    if metric == "em":
        return {"em_sum": _best(lambda p, r: normalize_answer(p) == normalize_answer(r), prediction, references),
                "n": 1.0}
    if metric == "qa_f1":
        return {"f1_sum": _best(qa_f1, prediction, references), "n": 1.0}
    if metric == "rouge_l":
        return {"rouge_sum": _best(partial(rouge_l, scorer=rouge), prediction, references), "n": 1.0}
    if metric == "macro_f1":
        gold = references[0]
        if prediction == gold:
            return {f"tp|{gold}": 1.0, "n": 1.0}
        return {f"fp|{prediction}": 1.0, f"fn|{gold}": 1.0, "n": 1.0}
    if metric == "mcc":
        out = dict.fromkeys(("mcc_tp", "mcc_tn", "mcc_fp", "mcc_fn"), 0.0)
        pred, gold = prediction.strip() == "acceptable", references[0] == "acceptable"
        out[f"mcc_{'t' if pred == gold else 'f'}{'p' if pred else 'n'}"] = 1.0
        return {**out, "n": 1.0}
    raise ValueError(f"unknown multitask metric {metric!r}")


def metric_of(stats: Mapping[str, Any]) -> str | None:
    """Which metric a row's statistics hold; None when they mix several (a pooled row)."""
    found = {m for m, key in SUM_KEYS.items() if key in stats}
    if any(k[:3] in ("tp|", "fp|", "fn|") for k in stats):
        found.add("macro_f1")
    if "mcc_tp" in stats:
        found.add("mcc")
    return found.pop() if len(found) == 1 else None


def macro_f1(stats: Mapping[str, Any]) -> float:
    """Mean per-label F1. `fsum` (exactly rounded) over sorted labels: a plain sum in set order
    changed the last bits with PYTHONHASHSEED, and `fedsilo compare` then saw wins between
    identical predictions."""
    labels = sorted({k[3:] for k in stats if k[:3] in ("tp|", "fp|", "fn|")})
    f1s = []
    for label in labels:
        tp, fp, fn = (float(stats.get(f"{kind}|{label}", 0.0)) for kind in ("tp", "fp", "fn"))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return math.fsum(f1s) / len(labels) if labels else 0.0


def mcc(stats: Mapping[str, Any]) -> float:
    tp, tn, fp, fn = (float(stats[f"mcc_{k}"]) for k in ("tp", "tn", "fp", "fn"))
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0  # scikit-learn's value for a constant column


def compute_metrics(stats: Mapping[str, Any]) -> Metrics:
    """score (the task's metric, %) and loss (mean token cross-entropy) from a row's stats."""
    n = stats.get("n")
    metric = metric_of(stats)
    score = None
    if n and metric in SUM_KEYS:
        score = 100.0 * float(stats[SUM_KEYS[metric]]) / float(n)
    elif n and metric == "macro_f1":
        score = 100.0 * macro_f1(stats)
    elif n and metric == "mcc":
        score = 100.0 * mcc(stats)
    loss_n = stats.get("loss_n")
    return {"score": score, "loss": float(stats["loss_sum"]) / float(loss_n) if loss_n else None}


SPEC = MetricSpec(
    columns=(Column("score", "score %"), Column("loss", "test loss", fmt=".3f", higher_is_better=False)),
    compute=compute_metrics,
    primary="score",
    higher_is_better=True,
    tie_break="loss",
    tie_break_higher_is_better=False,
    selection="macro",
    description=("One row per (client, task): score is the task's own CrossFit metric in % (accuracy, "
                 "exact match, QA F1, ROUGE-L or macro F1; MCC for glue-cola) of the greedy prediction "
                 "on its few-shot examples, test loss the mean teacher-forced cross-entropy per target "
                 "token. ROUGE-L is CrossFit's scorer (the `rouge` package) unless the task sets "
                 "rouge = \"google\" (`rouge-score`). The model is selected on the mean score over rows (dev)."),
)
