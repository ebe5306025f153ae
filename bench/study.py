"""The Lorar study (paper Tables 2 and 3) at a scale that fits this machine.

Runs every variant of experiments/lorar/bench.toml (or --config) once per seed (--seeds, default
0,1,2; applied as `fedsilo study` does, fedsilo.runs.studyfile.seeded) into --out (OUT/VARIANT/seed-S;
one seed: OUT/VARIANT), then writes a markdown report with the comparison tables as mean ± sd over
the seeds, each variant's wall time, and the paper's two claims judged by the shared significance rule
(fedsilo.runs.spread.claim_marked: Welch's t-test over the seeds on these records, never below the
shown precision, EM 0.01 and loss 0.001; a verdict the old spread rule judged otherwise is marked):
(1) Lorar beats its base algorithm on MacroAvg; (2) it helps the small silos (Academic, IMDB, Yelp)
most. Finished runs are skipped on a re-run (results.json present); an interrupted one continues
from its last complete round.

    python bench/study.py --out runs/study --doc docs/lorar-study.md [--seeds 0,1,2] [--only fedopt,fedopt_lorar]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

from fedsilo.config import load_config
from fedsilo.runs.overall import comparison_table
from fedsilo.runs.runner import run_experiment
from fedsilo.runs.spread import CHANGED, RULE, SPREAD, claim_marked as claim, spread_cell
from fedsilo.runs.study import run_dir
from fedsilo.runs.studyfile import parse_seeds, seeded
from fedsilo.runs.tables import markdown_table

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


def em_table(results: dict[str, list[dict]]) -> list[list[str]]:
    """EM per silo, Macro and Pooled, as mean ± sd over each variant's seeds."""
    if not results:
        return [["no variant of this table ran"]]
    table = comparison_table(results, ["em"], next(iter(results.values()))[0].get("display") or None)
    table[0] = [table[0][0], *table[0][1:-1], "Macro", "Pooled"]
    for row, runs in zip(table[1:], results.values()):
        row.append(spread_cell([r["test"]["pooled"].get("em") for r in runs]))
    return table


def loss_table(results: dict[str, list[dict]]) -> list[list[str]]:
    """Per-silo teacher-forced test loss of the selected model (lower is better), mean ± sd over seeds."""
    silos = list(per_silo(next(iter(results.values()))[0]))
    rows = [["", *silos, "mean"]]
    for name, runs in results.items():
        losses = [[per_silo(r)[s].get("loss") for s in silos] for r in runs]  # per seed, per silo
        rows.append([name, *(spread_cell([seed[i] for seed in losses], ".3f") for i in range(len(silos))),
                     spread_cell([sum(seed) / len(seed) for seed in losses], ".3f")])
    return rows


def claims(results: dict[str, list[dict]]) -> list[str]:
    """Each "a > b" on per-seed numbers, judged by the shared rule (fedsilo.runs.spread.claim_marked), after a
    note naming the verdicts the significance rule changed."""
    def mean(xs):
        return sum(xs) / len(xs)

    lines = []
    for base in ("fedopt", "fedavg", "fedprox"):
        lo = f"{base}_lorar"
        if base not in results or lo not in results:
            continue
        mb = [r["test"]["macro"]["em"] for r in results[base]]
        ml = [r["test"]["macro"]["em"] for r in results[lo]]
        d_small, d_other, loss_small, loss_other = [], [], [], []
        for rb, rl in zip(results[base], results[lo]):  # the same seed on both sides
            b, l = per_silo(rb), per_silo(rl)
            others = [s for s in b if s not in SMALL]
            d_small.append(mean([l[s]["em"] - b[s]["em"] for s in SMALL]))
            d_other.append(mean([l[s]["em"] - b[s]["em"] for s in others]))
            loss_small.append(mean([l[s]["loss"] - b[s]["loss"] for s in SMALL]))
            loss_other.append(mean([l[s]["loss"] - b[s]["loss"] for s in others]))
        lines.append(
            f"- {base} → {lo}: MacroAvg EM {spread_cell(mb)} → {spread_cell(ml)}: {lo} > {base} {claim(ml, mb)}; "
            f"mean EM change on small silos {spread_cell(d_small)} vs other silos {spread_cell(d_other)}: "
            f"small > other {claim(d_small, d_other)}; mean test-loss change small {spread_cell(loss_small, '.3f')} "
            f"vs other {spread_cell(loss_other, '.3f')} (negative = better): small falls more "
            f"{claim(loss_other, loss_small, '.3f')}")
    changed = sum(line.count(CHANGED) for line in lines)
    note = (f"**Verdicts under the significance rule:** {changed} verdict(s) differ from the spread rule's (marked "
            f"`[{CHANGED}: …]`: old → the verdict before it)." if changed else
            "**Verdicts under the significance rule:** none differs from the spread rule's.")
    return [note, "", *lines] if lines else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/lorar/bench.toml")
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--doc", default="docs/lorar-study.md")
    ap.add_argument("--only", help="comma-separated variant names")
    ap.add_argument("--set", action="append", default=[], help="extra overrides for every variant")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each variant runs once per seed")
    args = ap.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        ap.error(str(err))
    multi = len(seeds) > 1
    names = args.only.split(",") if args.only else list(VARIANTS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for seed in seeds:  # every variant of one seed before the next: a whole comparison early
        for name in names:
            out = run_dir(Path(args.out), name, seed, multi)
            if (out / "results.json").exists():
                results[name].append(json.loads((out / "results.json").read_text()))
                if (out / "wall.json").exists():
                    seconds[name].append(json.loads((out / "wall.json").read_text())["seconds"])
                continue
            label = f"{name}/seed-{seed}" if multi else name
            cfg = seeded(load_config(args.config, VARIANTS[name] + args.set + [f"name={label}"]), seed)
            t = time.perf_counter()
            resumed = (out / "config.toml").exists()  # an interrupted run continues from its last round
            results[name].append(run_experiment(cfg, out, resume=resumed, show_progress=False))
            # a resumed run's wall time: the runner's own sum over its rounds and evaluations
            seconds[name].append(results[name][-1]["wall_seconds"] if resumed else time.perf_counter() - t)
            (out / "wall.json").write_text(json.dumps({"seconds": seconds[name][-1]}))
            test = results[name][-1]["test"]
            print(f"{label}: EM macro {test['macro']['em']:.2f} pooled {test['pooled']['em']:.2f}, "
                  f"test loss pooled {test['pooled']['loss']:.3f} ({seconds[name][-1]:.0f}s)", flush=True)
    cells = f"mean ± sd over n = {len(seeds)} seeds ({', '.join(map(str, seeds))}), {SPREAD}" if multi else "one seed"
    doc = ["# Lorar study at bench scale\n",
           f"Command: `python bench/study.py --config {args.config} --out {args.out} --doc {args.doc} "
           f"--seeds {','.join(map(str, seeds))}`" + (f" `--set {' --set '.join(args.set)}`" if args.set else ""),
           f"Date: {date.today()}; machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
           f"{__import__('os').cpu_count()} cores, no GPU; Python {platform.python_version()}.\n",
           f"Every cell: {cells}.\n",
           "## Table 2 (exact match %, test sets)\n",
           markdown_table(em_table({n: results[n] for n in TABLE2 if n in results})), "",
           "## Table 3 (weighting mechanisms for FedOPT)\n",
           markdown_table(em_table({n: results[n] for n in TABLE3 if n in results})), "",
           "## Test loss per silo (teacher-forced token cross-entropy; graded where EM is flat)\n",
           markdown_table(loss_table(results)), "",
           "## Claims\n", f"Each claim \"a > b\" is judged on the seeds: {RULE}.\n",
           *claims(results), "",
           "## Wall time per variant (seconds, mean ± sd over seeds)\n",
           markdown_table([["variant", "seconds"]] + [[n, spread_cell(s, ".0f")] for n, s in seconds.items()]), ""]
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text("\n".join(doc))
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
