"""The FedMatch study (Chen et al. 2021, Tables 2 and 3) at a scale that fits 2 CPU cores.

Runs the variants of experiments/qa/table3.toml (baselines, client sampling) and table2.toml (the 8
patch variants), plus FedAvg and FedMatch again with another seed as the noise yardstick, each in
its own process (so each variant's peak RSS is its own), into --out. Then writes --doc: both tables
with BM25 beside them, the parameters each method sends and peak RSS, how far the patches moved, and the
paper's claims checked against the seed noise. Finished variants are skipped on a re-run.

    python bench/qa_study.py --out runs/qa-study --doc docs/qa-study.md [--only fedavg,fedmatch]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

from fedsilo.runs.report import markdown_table
from fedsilo.runs.study import run_study

ROOT = Path(__file__).resolve().parents[1]
TABLE3, TABLE2 = ROOT / "experiments" / "qa" / "table3.toml", ROOT / "experiments" / "qa" / "table2.toml"
NOISE = {"fedavg": "fedavg_seed1", "fedmatch": "fedmatch_seed1"}  # the same variant with seed = 1
MEASURE = """
import resource, sys
from fedsilo.cli import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def run_variant(study: Path, variant: str, out: Path, seed: int | None = None) -> float | None:
    """Run one variant in a fresh process; its peak RSS in GiB (None when it had already finished)."""
    name = NOISE.get(variant) if seed is not None else variant
    target = out / name
    if (target / "results.json").is_file():
        return None
    args = ["study", str(study), "--only", variant, "--out", str(out / "_seed1" if seed is not None else out),
            "--no-progress"]
    if seed is not None:
        args += ["--set", f"seed={seed}"]
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if seed is not None:  # keep the noise runs beside the others under their own names
        (out / "_seed1" / variant).rename(target)
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    return rss / 2**20


def patch_size(run: Path) -> float:
    """The mean |V_D| (up-projection weight) over the silos' kept patches after the last round: how far
    the zero-initialised patches moved."""
    from safetensors.torch import load_file
    latest = [max(silo.glob("round-*.safetensors")) for silo in sorted((run / "clients").glob("*"))]
    values = [t.abs().mean().item() for f in latest for k, t in load_file(f).items()
              if k.endswith("patch.up.weight")]
    return sum(values) / max(1, len(values))


def overall(study: dict, method: str) -> tuple[float, float]:
    """(MAP, MRR) overall: the last cell of the method's line, "MAP / MRR"."""
    row = next(r for r in study["table"][1:] if r[0] == method)
    map_, mrr = row[-1].split(" / ")
    return float(map_), float(mrr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/qa-study")
    ap.add_argument("--doc", default="docs/qa-study.md")
    ap.add_argument("--only", help="comma-separated variants")
    args = ap.parse_args()
    out = Path(args.out)
    only = set(args.only.split(",")) if args.only else None
    rss_file = out / "peak_rss.json"
    rss = json.loads(rss_file.read_text()) if rss_file.is_file() else {}
    from fedsilo.runs.study import load_study
    for study in (TABLE3, TABLE2):
        for variant in load_study(study)[1]:
            if only is None or variant in only:
                print(f"{study.stem}: {variant}", flush=True)
                got = run_variant(study, variant, out / study.stem)
                if got is not None:
                    rss[variant] = got
                    out.mkdir(parents=True, exist_ok=True)
                    rss_file.write_text(json.dumps(rss, indent=1))
    for variant in NOISE:
        if only is None or NOISE[variant] in only:
            print(f"noise: {variant} with seed 1", flush=True)
            run_variant(TABLE3, variant, out / TABLE3.stem, seed=1)
    if only is None:
        write_doc(out, Path(args.doc), rss)


def write_doc(out: Path, doc: Path, rss: dict) -> None:
    t3 = run_study(TABLE3, out / TABLE3.stem, show_progress=False)
    t2 = run_study(TABLE2, out / TABLE2.stem, show_progress=False)
    seeds = {}
    for variant, name in NOISE.items():
        results = json.loads((out / TABLE3.stem / name / "results.json").read_text())
        seeds[variant] = results["test"]["macro"]["map"], results["test"]["macro"]["mrr"]
    noise_map = max(abs(overall(t3, v)[0] - seeds[v][0]) for v in NOISE)
    costs = [["method", "parameters up (all rounds, all silos)", "MB up", "peak RSS GiB"]]
    for study in (t3, t2):
        for name, c in study["costs"].items():
            costs.append([name, f"{c['params_up']:,.0f}", f"{c['bytes_up'] / 1e6:.1f}",
                          f"{rss[name]:.2f}" if name in rss else "-"])
    lines = [
        "# FedMatch study at CPU scale (paper Tables 2 and 3)\n",
        f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; "
        f"`python bench/qa_study.py --out {out} --doc {doc}`. Scale: see experiments/qa/table3.toml "
        "(MiniLM-L6 cross-encoder, 64 tokens, 32 training questions per silo x 2 pairs, 3 rounds of 1 epoch, "
        "40 dev/test questions per silo). Overall = the mean over the 5 silos, as the paper. `fedmatch` "
        "trains its patches at the backbone's lr (5e-5, the paper's single rate); `fedmatch_plr` and every "
        "Table 2 variant at `client.private_lr = 1e-3`.\n",
        "## Table 3 analogue: FedMatch vs baselines\n", markdown_table(t3["table"]), "",
        "## Table 2 analogue: patch variants (g x insertion)\n", markdown_table(t2["table"]), "",
        "## Cost\n", markdown_table(costs), "",
        "Wall time is not compared here: the variants run one after another, over hours of varying load "
        "on a shared machine. `python bench/fedmatch_cost.py` measures FedAvg against FedMatch "
        "interleaved in one run (docs/benchmarks.md).\n",
        "## How far the patches moved\n",
        "Mean |V_D| (the zero-initialised up-projection) over the silos after the last round: "
        + ", ".join(f"{v} {patch_size(Path(t3['variants'][v])):.2e}" for v in ("fedmatch", "fedmatch_plr"))
        + ".\n",
        "## Seed noise\n",
        "FedAvg and FedMatch again with seed 1: overall MAP "
        + ", ".join(f"{v} {seeds[v][0]:.4f} (seed 0: {overall(t3, v)[0]:.4f})" for v in NOISE)
        + f". A difference in overall MAP smaller than {noise_map:.4f} is within seed noise.\n",
        "## The paper's claims, on what came out\n", *claims(t3, t2, noise_map), "",
    ]
    doc.write_text("\n".join(lines))
    print(f"wrote {doc}")


def claims(t3: dict, t2: dict, noise: float) -> list[str]:
    def verdict(a: float, b: float) -> str:
        if abs(a - b) < noise:
            return "within seed noise"
        return "holds" if a > b else "does not hold"

    m = {r[0]: overall(t3, r[0])[0] for r in t3["table"][1:]}
    v = {r[0]: overall(t2, r[0])[0] for r in t2["table"][1:]}
    lowrank = sum(v[k] for k in v if k.endswith("_lr")) / 4
    pal = sum(v[k] for k in v if k.endswith("_pal")) / 4
    hv = sum(v[k] for k in v if k[0] in "hv") / 4
    io = sum(v[k] for k in v if k[0] in "io") / 4
    out = [f"- FedAvg beats each silo alone overall: {m['fedavg']:.4f} vs {m['local']:.4f} — "
           f"{verdict(m['fedavg'], m['local'])}."]
    for fedmatch in ("fedmatch", "fedmatch_plr"):
        for base in ("fedavg", "fedavg_equal", "fedper", "lg_fedavg"):
            out.append(f"- {fedmatch} beats {base}: {m[fedmatch]:.4f} vs {m[base]:.4f} — "
                       f"{verdict(m[fedmatch], m[base])}.")
    out.append(f"- low-rank >= PAL (mean over insertions): {lowrank:.4f} vs {pal:.4f} — {verdict(lowrank, pal)}.")
    out.append(f"- horizontal/vertical >= inner/outer (mean over g): {hv:.4f} vs {io:.4f} — {verdict(hv, io)}.")
    out.append(f"- client sampling: FedAvg_CS {m['fedavg_cs']:.4f} vs FedAvg {m['fedavg']:.4f}; "
               f"FedMatch_CS {m['fedmatch_cs']:.4f} vs FedMatch {m['fedmatch']:.4f}.")
    return out


if __name__ == "__main__":
    main()
