"""Our MAP/MRR/P@1 (fedsilo.tasks.matching.metrics) vs trec_eval (pytrec_eval) on the real QA test
sets, BM25 as the ranker (the task's untrained reference): over the questions we score (differences
come from ties only) and over every question (trec_eval also scores lists we drop)."""
from pathlib import Path

import pytrec_eval

from fedsilo.tasks.base import pool
from fedsilo.tasks.matching.benchmark import load_silo
from fedsilo.tasks.matching.bm25 import Bm25Index
from fedsilo.tasks.matching.metrics import SPEC, question_stats
from fedsilo.tasks.matching.plugin import SILOS
from fedsilo.tasks.matching.questions import SPLITS

ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "qa"  # ../shared/data
M = {"map", "recip_rank", "P_1"}


def trec(questions, scores):
    qrels = {f"q{k}": {f"c{i:03d}": y for i, y in enumerate(q.labels)} for k, q in enumerate(questions)}
    run = {f"q{k}": {f"c{i:03d}": float(s) for i, s in enumerate(sc)} for k, sc in enumerate(scores)}
    res = pytrec_eval.RelevanceEvaluator(qrels, M).evaluate(run)
    n = len(res)
    return {m: sum(r[m] for r in res.values()) / n for m in M}, n


print("| silo | test questions | scored (ours) | dropped: no relevant / no irrelevant | scored with a relevant/irrelevant tie | ours MAP / MRR / P@1 | trec_eval, same questions | trec_eval, all questions |")
print("| --- | ---: | ---: | ---: | ---: | --- | --- | --- |")
for silo in SILOS:
    splits = load_silo(ROOT, silo)
    texts = list(dict.fromkeys(c for s in SPLITS for q in splits[s] for c in q.candidates))
    index, position = Bm25Index(texts), {t: i for i, t in enumerate(texts)}
    questions = splits["test"]
    scores = []
    for q in questions:
        all_scores = index.scores(q.text)
        scores.append([float(all_scores[position[c]]) for c in q.candidates])
    ours = SPEC.compute(pool([question_stats(s, q.labels) for s, q in zip(scores, questions)]))
    keep = [k for k, q in enumerate(questions) if 0 < sum(q.labels) < len(q.labels)]
    ties = sum(1 for k in keep if set(s for s, y in zip(scores[k], questions[k].labels) if y)
               & set(s for s, y in zip(scores[k], questions[k].labels) if not y))
    no_rel = sum(1 for q in questions if sum(q.labels) == 0)
    no_irr = sum(1 for q in questions if 0 < sum(q.labels) == len(q.labels))
    same, n_same = trec([questions[k] for k in keep], [scores[k] for k in keep])
    every, n_all = trec(questions, scores)
    fmt = lambda d: f"{d['map']:.4f} / {d['recip_rank']:.4f} / {d['P_1']:.4f}"
    print(f"| {silo} | {len(questions)} | {ours['questions']:.0f} | {no_rel} / {no_irr} | {ties} | "
          f"{ours['map']:.4f} / {ours['mrr']:.4f} / {ours['p1']:.4f} | {fmt(same)} | {fmt(every)} |", flush=True)
