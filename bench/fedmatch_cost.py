"""What FedMatch's patches cost against FedAvg: wall time per round, peak RSS, parameters sent.

Runs the fedavg and fedmatch variants of experiments/qa/small.toml (and FedMatch with PAL patches
at the inner insertion, the heaviest variant) each in a fresh process, interleaved and repeated
(A B C A B C ...) so that a busy machine slows all of them alike, and prints the medians and the
ratios to FedAvg measured in this one run.

    python bench/fedmatch_cost.py [--repeats 2] [--rounds 2] [--out runs/fedmatch-cost]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

from fedsilo.config import to_toml
from fedsilo.models.settings import SurgeryConfig
from fedsilo.rundir.records import read_rounds
from fedsilo.runs.studyfile import load_study
from fedsilo.runs.tables import markdown_table

SMALL = Path(__file__).resolve().parents[1] / "experiments" / "qa" / "small.toml"
PAL_INNER = {"kind": "pal", "insertion": "inner", "size": 64}
MEASURE = """
import resource, sys
from fedsilo.cli import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def configs(rounds: int) -> dict[str, str]:
    """{variant: TOML} with `rounds` rounds and no dev evaluation before the last round."""
    sets = [f"federation.rounds={rounds}", f"federation.eval_every={rounds}"]
    _, cfg = load_study(SMALL, sets, ["fedavg", "fedmatch"])
    fedmatch = cfg["fedmatch"]
    pal = fedmatch.model_copy(update={"model": fedmatch.model.model_copy(
        update={"surgery": SurgeryConfig(name="patches", options=PAL_INNER)})})
    return {"fedavg": to_toml(cfg["fedavg"]), "fedmatch (H+LR)": to_toml(fedmatch), "fedmatch (I+PAL)": to_toml(pal)}


def run_once(name: str, toml: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = out.with_suffix(".toml")
    cfg.write_text(toml)
    done = subprocess.run([sys.executable, "-c", MEASURE, "run", str(cfg), "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    rounds = read_rounds(out)
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    return {"seconds": [r["seconds"] for r in rounds], "params_up": rounds[0]["params_up"], "rss_gib": rss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/fedmatch-cost")
    args = ap.parse_args()
    variants = configs(args.rounds)
    got: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(args.repeats):
        for i, (name, toml) in enumerate(variants.items()):
            print(f"repeat {rep + 1}/{args.repeats}: {name}", flush=True)
            got[name].append(run_once(name, toml, Path(args.out) / f"r{rep}-v{i}"))
    per_round = {n: statistics.median(s for r in runs for s in r["seconds"]) for n, runs in got.items()}
    rss = {n: max(r["rss_gib"] for r in runs) for n, runs in got.items()}
    base = "fedavg"
    rows = [["method", "s per round (median)", "vs FedAvg", "peak RSS GiB", "vs FedAvg", "parameters up per round"]]
    for n in variants:
        rows.append([n, f"{per_round[n]:.1f}", f"{per_round[n] / per_round[base]:.2f}x", f"{rss[n]:.2f}",
                     f"{rss[n] / rss[base]:.2f}x", f"{got[n][0]['params_up']:,}"])
    print(f"\n{date.today()}, {platform.machine()}, {os.cpu_count()} CPU cores; {args.repeats} repeats x "
          f"{args.rounds} rounds of experiments/qa/small.toml's federation (5 silos)\n")
    print(markdown_table(rows))
    (Path(args.out) / "summary.json").write_text(json.dumps({"per_round": per_round, "rss_gib": rss,
                                                              "runs": got}, indent=1))


if __name__ == "__main__":
    main()
