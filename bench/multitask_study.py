"""The FewFedWeight study (Tables 1, 2 and 4 of the paper) at a scale that fits 2 CPU cores.

Runs every variant of experiments/multitask/study.toml, each in its own process (so each variant's
peak RSS is its own) into --out, then compares each against Data Silo with `fedsilo compare`'s
arithmetic (PIR per task, APIR per client then over clients, Win/Lose/Tie) and writes --doc:
Table 1 (methods), Table 2 (ablations), Table 4 (seconds per local epoch of one client, split into
pseudo-label generation and training) and the paper's claims checked. Finished variants are skipped
on a re-run, so an interrupted study continues.

    python bench/multitask_study.py --out runs/multitask-study --doc docs/multitask-study.md [--only fedavg,fewfedweight]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tomllib
from datetime import date
from pathlib import Path

from fedsilo.runs.compare import compare, read_results
from fedsilo.tasks.multitask.catalog import CATALOG
from fedsilo.tasks.multitask.converters import load_all
from fedsilo.runs.report import markdown_table, read_rounds

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "multitask" / "study.toml"
BASE = "data_silo"
TABLE1 = ["data_silo_da", "fedavg", "ditto", "meta_weighting", "fewfedweight", "centralized"]
TABLE2 = ["fedavg_da", "ffw_no_pseudo", "ffw_uniform", "ffw_size", "fewfedweight"]
LABELS = {"data_silo": "Data Silo", "data_silo_da": "Data Silo DA", "fedavg": "FedAvg", "ditto": "Ditto",
          "meta_weighting": "Meta Weighting", "fewfedweight": "FewFedWeight", "centralized": "Centralized",
          "fedavg_da": "FedAvg + data augmentation (uniform weights, size aggregation)",
          "ffw_no_pseudo": "FewFedWeight without pseudo data", "ffw_uniform": "FewFedWeight without energy weights",
          "ffw_size": "FewFedWeight without dynamic aggregation"}
MEASURE = """
import resource, sys
from fedsilo.cli import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def run_variant(variant: str, out: Path, study: Path) -> None:
    """One variant in a fresh process; its peak RSS goes to OUT/VARIANT/peak_rss.json."""
    if (out / variant / "results.json").is_file():
        return
    print(f"running {variant} ...", flush=True)
    done = subprocess.run([sys.executable, "-c", MEASURE, "study", str(study), "--only", variant, "--out", str(out),
                           "--no-progress"], capture_output=True, text=True,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    (out / variant / "peak_rss.json").write_text(json.dumps({"peak_rss_gib": rss / 2**20}))


def epoch_seconds(run: Path, epochs: int) -> dict[str, float]:
    """Median seconds of one local epoch of one client, by phase (pseudo-label generation, training,
    a personal model's training), over every client and round of the run (and its sub-runs)."""
    runs = [run] + sorted(p for p in (run / "silos").glob("*") if p.is_dir())
    phases: dict[str, list[float]] = {}
    for sub in runs:
        if not (sub / "rounds.jsonl").is_file():
            continue
        for record in read_rounds(sub):
            for client in (record.get("clients") or {}).values():
                for phase, seconds in (client.get("phase_seconds") or {}).items():
                    phases.setdefault(phase, []).append(seconds / epochs)
    return {phase: statistics.median(v) for phase, v in phases.items()}


def summary_rows(out: Path, names: list[str]) -> list[list[str]]:
    base = read_results(out / BASE)
    rows = [["method", "APIR", "Win", "Lose", "Tie", "APIR per client"]]
    for name in names:
        s = compare(read_results(out / name), base)
        per_client = ", ".join(f"{c.replace('client_', 'c')} {100 * v:+.1f}%" for c, v in s["clients"].items()
                               if v is not None)
        rows.append([LABELS.get(name, name), f"{100 * s['apir']:+.1f}%" if s["apir"] is not None else "—",
                     str(s["win"]), str(s["lose"]), str(s["tie"]), per_client])
    return rows


def task_rows(out: Path, names: list[str]) -> list[list[str]]:
    """Every (client, task) row: Data Silo's metric and each method's."""
    base = read_results(out / BASE)
    results = {n: {(r["client"], r["task"]): r for r in read_results(out / n)["test"]["rows"]} for n in names}
    primary = base["metric_spec"]["primary"]
    head = ["client", "task", "metric", "Data Silo", *(LABELS.get(n, n).split(" (")[0] for n in names)]
    rows = [head]
    for r in base["test"]["rows"]:
        key = (r["client"], r["task"])
        rows.append([r["client"], r["task"], CATALOG.get(r["task"]).metric, f"{r['metrics'][primary]:.1f}",
                     *(f"{results[n][key]['metrics'][primary]:.1f}" for n in names)])
    return rows


def cost_rows(out: Path, names: list[str], epochs: int) -> list[list[str]]:
    rows = [["method", "generating s/epoch", "training s/epoch", "personal model s/epoch", "total s/epoch",
             "wall time", "peak RSS"]]
    for name in names:
        ph = epoch_seconds(out / name, epochs)
        res = read_results(out / name)
        rss = json.loads((out / name / "peak_rss.json").read_text())["peak_rss_gib"] \
            if (out / name / "peak_rss.json").is_file() else float("nan")
        gen, train, pers = ph.get("before_training", 0.0), ph.get("training", 0.0), ph.get("personal", 0.0)
        rows.append([LABELS.get(name, name).split(" (")[0], f"{gen:.1f}", f"{train:.1f}", f"{pers:.1f}",
                     f"{gen + train + pers:.1f}", f"{res.get('wall_seconds', 0) / 60:.1f} min", f"{rss:.2f} GiB"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/multitask-study")
    ap.add_argument("--doc", default=None, help="write the study's tables to this markdown file")
    ap.add_argument("--only", default=None, help="comma-separated variants to run (the tables need all)")
    ap.add_argument("--study", default=str(STUDY))
    args = ap.parse_args()
    load_all()
    out, study = Path(args.out), Path(args.study)
    variants = list(tomllib.loads(study.read_text())["variants"])
    for name in (args.only.split(",") if args.only else variants):
        run_variant(name, out, study)
    if not all((out / v / "results.json").is_file() for v in variants):
        print("not every variant has finished: no tables yet")
        return
    epochs = tomllib.loads(study.read_text())["base"]["client"]["epochs"]
    t1, t2 = summary_rows(out, TABLE1), summary_rows(out, TABLE2)
    tasks = task_rows(out, [v for v in variants if v != BASE])
    costs = cost_rows(out, variants, epochs)
    text = "\n\n".join(["## Table 1: methods against Data Silo", markdown_table(t1),
                        "## Table 2: ablations against Data Silo", markdown_table(t2),
                        "## Table 4: seconds per local epoch of one client (median over clients and rounds)",
                        markdown_table(costs), "## Every task", markdown_table(tasks)])
    print(text)
    if args.doc:
        stamp = f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}."
        Path(args.doc).write_text(f"<!-- generated by bench/multitask_study.py; {stamp} -->\n{text}\n")


if __name__ == "__main__":
    main()
