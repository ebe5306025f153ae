"""The Lorar study (paper Tables 2 and 3) at a scale that fits this machine.

Runs every variant of experiments/lorar/bench.toml (or --config) into --out, then writes a markdown
report with the comparison tables, each variant's wall time, and the paper's two claims checked on
what came out: (1) Lorar beats its base algorithm on MacroAvg; (2) it helps the small silos
(Academic, IMDB, Yelp) most. Finished variants are skipped on a re-run (results.json present).

    python bench/study.py --out runs/study --doc docs/lorar-study.md [--only fedopt,fedopt_lorar]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

from fedsilo.config import load_config
from fedsilo.runs.report import combine_tables, markdown_table
from fedsilo.runs.runner import run_experiment

FEDOPT = ["server.optimizer=sgdm", "server.lr=1.0", "server.momentum=0.9"]
FEDPROX = ["server.optimizer=fedavg", "client.regularizers={prox=1e-4}"]
FEDAVG = ["server.optimizer=fedavg"]
VARIANTS = {
    "finetune": ["paradigm=finetune"],
    "centralized": ["paradigm=centralized"],
    "fedopt": FEDOPT + ["federation.weighting=size"],
    "fedopt_lorar": FEDOPT + ["federation.weighting=lorar"],
    "fedavg": FEDAVG + ["federation.weighting=size"],
    "fedavg_lorar": FEDAVG + ["federation.weighting=lorar"],
    "fedprox": FEDPROX + ["federation.weighting=size"],
    "fedprox_lorar": FEDPROX + ["federation.weighting=lorar"],
    "fedopt_lr": FEDOPT + ["federation.weighting=loss_reduction"],
    "fedopt_equal": FEDOPT + ["federation.weighting=equal"],
}
TABLE2 = ["finetune", "centralized", "fedopt", "fedopt_lorar", "fedavg", "fedavg_lorar", "fedprox", "fedprox_lorar"]
TABLE3 = ["fedopt", "fedopt_lr", "fedopt_equal", "fedopt_lorar"]
SMALL = ["academic", "imdb", "yelp"]


def per_silo(results: dict) -> dict[str, dict]:
    """Test metrics by silo (the rows of results.json)."""
    return {row["client"]: row["metrics"] for row in results["test"]["rows"]}


def loss_table(results: dict[str, dict]) -> list[list[str]]:
    """Per-silo teacher-forced test loss of the selected model (lower is better)."""
    silos = list(per_silo(next(iter(results.values()))))
    rows = [["", *silos, "mean"]]
    for name, r in results.items():
        losses = [per_silo(r)[s].get("loss") for s in silos]
        rows.append([name, *(f"{v:.3f}" for v in losses), f"{sum(losses) / len(losses):.3f}"])
    return rows


def claims(results: dict[str, dict]) -> list[str]:
    lines = []
    for base in ("fedopt", "fedavg", "fedprox"):
        lo = f"{base}_lorar"
        if base not in results or lo not in results:
            continue
        b, l = per_silo(results[base]), per_silo(results[lo])
        mb, ml = results[base]["test"]["macro"]["em"], results[lo]["test"]["macro"]["em"]
        d_small = sum(l[s]["em"] - b[s]["em"] for s in SMALL) / len(SMALL)
        others = [s for s in b if s not in SMALL]
        d_other = sum(l[s]["em"] - b[s]["em"] for s in others) / len(others)
        loss_small = sum(l[s]["loss"] - b[s]["loss"] for s in SMALL) / len(SMALL)
        loss_other = sum(l[s]["loss"] - b[s]["loss"] for s in others) / len(others)
        lines.append(
            f"- {base} → {lo}: MacroAvg EM {mb:.2f} → {ml:.2f} "
            f"({'better' if ml > mb else 'tie' if ml == mb else 'worse'}); "
            f"mean EM change on small silos "
            f"{d_small:+.2f} vs other silos {d_other:+.2f}; mean test-loss change small {loss_small:+.3f} "
            f"vs other {loss_other:+.3f} (negative = better)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/lorar/bench.toml")
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--doc", default="docs/lorar-study.md")
    ap.add_argument("--only", help="comma-separated variant names")
    ap.add_argument("--set", action="append", default=[], help="extra overrides for every variant")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    results, seconds = {}, {}
    for name in names:
        out = Path(args.out) / name
        if (out / "results.json").exists():
            results[name] = json.loads((out / "results.json").read_text())
            seconds[name] = json.loads((out / "wall.json").read_text())["seconds"] if (out / "wall.json").exists() else None
            continue
        cfg = load_config(args.config, VARIANTS[name] + args.set + [f"name={name}"])
        t = time.perf_counter()
        results[name] = run_experiment(cfg, out, show_progress=False)
        seconds[name] = time.perf_counter() - t
        (out / "wall.json").write_text(json.dumps({"seconds": seconds[name]}))
        test = results[name]["test"]
        print(f"{name}: EM macro {test['macro']['em']:.2f} pooled {test['pooled']['em']:.2f}, "
              f"test loss pooled {test['pooled']['loss']:.3f} ({seconds[name]:.0f}s)", flush=True)
    doc = ["# Lorar study at bench scale\n",
           f"Command: `python bench/study.py --config {args.config} --out {args.out} --doc {args.doc}`"
           + (f" `--set {' --set '.join(args.set)}`" if args.set else ""),
           f"Date: {date.today()}; machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
           f"{__import__('os').cpu_count()} cores, no GPU; Python {platform.python_version()}.\n",
           "## Table 2 (exact match %, test sets)\n",
           markdown_table(combine_tables({n: results[n] for n in TABLE2 if n in results})), "",
           "## Table 3 (weighting mechanisms for FedOPT)\n",
           markdown_table(combine_tables({n: results[n] for n in TABLE3 if n in results})), "",
           "## Test loss per silo (teacher-forced token cross-entropy; graded where EM is flat)\n",
           markdown_table(loss_table(results)), "",
           "## Claims\n", *claims(results), "",
           "## Wall time per variant\n",
           markdown_table([["variant", "seconds"]] + [[n, f"{s:.0f}" if s else "-"] for n, s in seconds.items()]), ""]
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text("\n".join(doc))
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
