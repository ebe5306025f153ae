"""Every claim of an instruct study judged per silo and metric, by the study's own paired tests.

A study judges each variant against its baseline on its first metric's Overall (the macro loss).
Here every pair of variants that a reading of the table rests on is judged on each silo's own
metrics, from the runs' per-item records (`items/test.jsonl`, every seed): each silo's response loss
(paired bootstrap, sacreBLEU's), GSM8K exact match and PubMedQA accuracy (paired randomisation, item
means), with fedsilo's rule (fedsilo.runs.significance.judge_items: p < alpha and a difference above
the metric's resolution, one item's worth for an item mean).

    python bench/instruct_claims.py bench/results/instruct-smollm2 --pairs fedavg:alone,fedprox:fedavg,alone:zero_shot,fedavg:zero_shot
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedsilo.runs import significance  # noqa: E402
from fedsilo.tasks.instruct.metrics import compute  # noqa: E402

METRICS = {"loss": (".4f", False), "em": (".2f", True), "acc": (".2f", True)}  # fmt, higher is better


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="the study's --out folder (its study.json names every run)")
    ap.add_argument("--pairs", required=True, help="A:B,... each judged as 'A better than B'")
    ap.add_argument("--json")
    args = ap.parse_args()
    study = json.loads((Path(args.study) / "study.json").read_text())
    runs = {name: [significance.read_items(ROOT / path) for path in seeds.values()]
            for name, seeds in study["runs"].items()}
    out = []
    for pair in args.pairs.split(","):
        a, b = pair.split(":")
        units = sorted(set(runs[a][0]) & set(runs[b][0]))
        for unit in units:
            sample = runs[a][0][unit][1][0]
            for metric, (fmt, higher) in METRICS.items():
                if compute(sample)[metric] is None:
                    continue
                score = (lambda stats, m=metric, up=higher: (compute(stats)[m] if up else -compute(stats)[m])
                         if compute(stats)[m] is not None else None)
                verdict = significance.judge_items(runs[a], runs[b], [unit], score, fmt)
                line = f"{a} {'>' if higher else '<'} {b} ({unit[0]} {metric}): {verdict}"
                print(line)
                out.append({"a": a, "b": b, "silo": unit[0], "metric": metric, "verdict": str(verdict),
                            "outcome": verdict.outcome, "p": verdict.p, "difference": verdict.difference})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
