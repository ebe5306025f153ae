"""The FedMatch study (Chen et al. 2021, Tables 2 and 3) at a scale that fits 2 CPU cores.

Runs the variants of experiments/qa/table3.toml (baselines, client sampling) and table2.toml (the 8
patch variants) once per seed (--seeds, default 0,1,2: model init and data order), each run in its
own process (so each variant's peak RSS is its own), into --out (OUT/STEM/VARIANT/seed-S, as `fedsilo
study --seeds` lays them out). Then writes --doc: both tables as mean ± sd over the seeds with BM25
beside them, the parameters each method sends and peak RSS, how far the patches moved, and the
paper's claims judged by the shared significance rule (fedsilo.runs.spread.claim_marked: Welch's
t-test over the seeds on these records, never below MAP's shown precision, 0.0001; a verdict the old
spread rule judged otherwise is marked). Finished runs are skipped on a re-run.

    python bench/qa_study.py --out runs/qa-study --doc docs/qa-study.md [--seeds 0,1,2] [--only fedavg,fedmatch]
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

from fedsilo.runs.spread import CHANGED, RULE, SPREAD, claim_marked, mean_sd, spread_cell
from fedsilo.runs.study import run_dir, run_study
from fedsilo.runs.studyfile import load_study, parse_seeds
from fedsilo.runs.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
TABLE3, TABLE2 = ROOT / "experiments" / "qa" / "table3.toml", ROOT / "experiments" / "qa" / "table2.toml"
PAPER = ROOT / "experiments" / "qa" / "paper.toml"  # FedMatch as the paper trained it (Adam 2e-5, warm-up, decay)
# the paper recipe on table3.toml's data subsample, so the two recipes compare on the same questions
PAPER_CPU = ["task.max_train=32", "task.pairs_per_question=2", "task.max_eval=40", "task.max_length=64",
             "task.eval_batch_size=64", "federation.eval_every=3"]
STUDIES = {TABLE3: [], TABLE2: [], PAPER: PAPER_CPU}  # study file → its --set assignments
MEASURE = """
import resource, sys
from pathlib import Path
from fedsilo.runs.report import write_report
from fedsilo.runs.runner import run_experiment
from fedsilo.runs.study import run_dir
from fedsilo.runs.studyfile import load_study
study, variant, out, seed, multi = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
sets = sys.argv[6:]
cfg = load_study(study, sets, only=[variant], seed=seed, multi_seed=multi)[1][variant]  # exactly as run_study builds it
target = run_dir(out, variant, seed, multi)
run_experiment(cfg, target, resume=True, show_progress="lines")
write_report(target)
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def run_variant(study: Path, variant: str, out: Path, seed: int, multi: bool, sets: list[str] = ()) -> float | None:
    """Run one variant with one seed in a fresh process; its peak RSS in GiB (None when it had already finished)."""
    if (run_dir(out, variant, seed, multi) / "results.json").is_file():
        return None
    done = subprocess.run([sys.executable, "-c", MEASURE, str(study), variant, str(out), str(seed), str(int(multi)),
                           *sets],
                          capture_output=True, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode:
        sys.exit(f"{variant} seed {seed} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    return rss / 2**20


def patch_size(run: Path) -> float:
    """The mean |V_D| (up-projection weight) over the silos' kept patches after the last round: how far
    the zero-initialised patches moved. Kept in RUN/patch_size.json, which git keeps (bench/results):
    the client stores it is read from are not."""
    kept = run / "patch_size.json"
    if kept.is_file():
        return json.loads(kept.read_text())["mean_abs_up"]
    from safetensors.torch import load_file
    latest = [max(silo.glob("round-*.safetensors")) for silo in sorted((run / "clients").glob("*"))]
    if not latest:
        sys.exit(f"{run}: no client store to read the patches from (and no patch_size.json); rerun this variant")
    values = [t.abs().mean().item() for f in latest for k, t in load_file(f).items()
              if k.endswith("patch.up.weight")]
    size = sum(values) / max(1, len(values))
    kept.write_text(json.dumps({"mean_abs_up": size}))
    return size


def overall(study: dict, method: str, metric: str = "map") -> dict[str, float]:
    """A method's overall (macro over silos) `metric` by seed, from study.json's per_seed."""
    return {seed: entry["overall"][metric] for seed, entry in study["per_seed"][method].items()}


def mean_of(study: dict, methods: list[str], metric: str = "map") -> list[float]:
    """Per seed, the mean over `methods` of their overall `metric` (e.g. low-rank over its insertions)."""
    by_method = [overall(study, m, metric) for m in methods]
    return [sum(b[s] for b in by_method) / len(by_method) for s in by_method[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/qa-study")
    ap.add_argument("--doc", default="docs/qa-study.md")
    ap.add_argument("--only", help="comma-separated variants")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each variant runs once per seed")
    args = ap.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        ap.error(str(err))
    multi = len(seeds) > 1
    out = Path(args.out)
    only = set(args.only.split(",")) if args.only else None
    rss_file = out / "peak_rss.json"
    rss = json.loads(rss_file.read_text()) if rss_file.is_file() else {}
    for seed in seeds:  # every variant of one seed before the next: a whole comparison early
        for study, sets in STUDIES.items():
            for variant in load_study(study, sets)[1]:
                if only is None or variant in only:
                    print(f"{study.stem}: {variant} seed {seed}", flush=True)
                    got = run_variant(study, variant, out / study.stem, seed, multi, sets)
                    if got is not None:
                        key = variant if study != PAPER else f"paper/{variant}"
                        rss[key] = max(got, rss.get(key, 0.0))  # the largest over its seeds
                        out.mkdir(parents=True, exist_ok=True)
                        rss_file.write_text(json.dumps(rss, indent=1))
    if only is None:
        write_doc(out, Path(args.doc), rss, seeds)


def write_doc(out: Path, doc: Path, rss: dict, seeds: list[int]) -> None:
    t3 = run_study(TABLE3, out / TABLE3.stem, show_progress=False, seeds=seeds)
    t2 = run_study(TABLE2, out / TABLE2.stem, show_progress=False, seeds=seeds)
    paper = run_study(PAPER, out / PAPER.stem, PAPER_CPU, show_progress=False, seeds=seeds)
    costs = [["method", "parameters up (all rounds, all silos)", "MB up", "peak RSS GiB (largest over seeds)"]]
    for study, prefix in ((t3, ""), (t2, ""), (paper, "paper/")):
        for name, c in study["costs"].items():
            costs.append([prefix + name, f"{c['params_up']:,.0f}", f"{c['bytes_up'] / 1e6:.1f}",
                          f"{rss[prefix + name]:.2f}" if prefix + name in rss else "-"])
    spreads = {name: mean_sd(list(overall(study, name).values()))[1]
               for study in (t3, t2) for name in study["per_seed"]}
    widest = max(spreads, key=lambda n: spreads[n] or 0.0)
    lines = [
        "# FedMatch study at CPU scale (paper Tables 2 and 3)\n",
        f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; "
        f"`python bench/qa_study.py --out {out} --doc {doc} --seeds {','.join(map(str, seeds))}`. Scale: see "
        "experiments/qa/table3.toml (MiniLM-L6 cross-encoder, 64 tokens, 32 training questions per silo x 2 pairs, "
        "3 rounds of 1 epoch, 40 dev/test questions per silo). Overall = the mean over the 5 silos, as the paper. "
        "`fedmatch` trains its patches at the backbone's lr (5e-5, the paper's single rate); `fedmatch_plr` and "
        "every Table 2 variant at `client.private_lr = 1e-3`.\n",
        f"Every variant ran once per seed ({', '.join(map(str, seeds))}: model init and data order). Each cell is "
        f"mean ± sd over n = {len(seeds)} seeds, {SPREAD}; BM25 does not depend on the seed.\n",
        "## Table 3 analogue: FedMatch vs baselines\n", markdown_table(t3["table"]), "",
        "## Table 2 analogue: patch variants (g x insertion)\n", markdown_table(t2["table"]), "",
        "## The paper's recipe on the same data\n",
        "experiments/qa/paper.toml (Adam 2e-5, warm-up over the first 10% of steps then linear decay to 0 over "
        "the whole run, batch 32 (MedQuAD 12), FedMatch's patches of size 128 randomly initialised) with "
        f"`--set {' '.join(PAPER_CPU)}`: Table 3's questions. With batch 32, a silo takes 2 steps per round "
        "here: the recipe was made for thousands of steps.\n",
        markdown_table(paper["table"]), "",
        "## Cost\n", markdown_table(costs), "",
        "Wall time is not compared here: the variants run one after another, over hours of varying load "
        "on a shared machine. `python bench/fedmatch_cost.py` measures FedAvg against FedMatch "
        "interleaved in one run (docs/benchmarks.md).\n",
        "## How far the patches moved\n",
        "Mean |V_D| (the zero-initialised up-projection) over the silos after the last round, mean over the seeds: "
        + ", ".join(f"{v} {sum(map(patch_size, map(Path, t3['runs'][v].values()))) / len(t3['runs'][v]):.2e}"
                    for v in ("fedmatch", "fedmatch_plr"))
        + ".\n",
        "## Seed spread\n",
        f"The widest spread of overall MAP over the seeds: {widest} ± {spreads[widest] or 0:.4f}. "
        f"Each claim below: {RULE} (fedsilo.runs.spread.claim_marked).\n",
        "## The paper's claims, on what came out\n", changed_note([*claims(t3, t2), *recipe_claims(t3, paper)]),
        *claims(t3, t2), "",
        "## Recipe: today's against the paper's (overall MAP)\n", *recipe_claims(t3, paper), "",
    ]
    doc.write_text("\n".join(lines))
    print(f"wrote {doc}")


def changed_note(lines: list[str]) -> str:
    """The short note on which verdicts the significance rule changed (old → new), from the marks."""
    changed = sum(line.count(CHANGED) for line in lines)
    return (f"**Verdicts under the significance rule:** {changed} verdict(s) here and in the recipe comparison "
            f"differ from the spread rule's (marked `[{CHANGED}: …]`: old → the verdict before it).\n" if changed
            else "**Verdicts under the significance rule:** none differs from the spread rule's.\n")


def claim(a: list[float], b: list[float]) -> str:
    """The shared rule on overall MAP (shown at 4 decimals)."""
    return claim_marked(a, b, ".4f")


def claims(t3: dict, t2: dict) -> list[str]:
    """Each paper claim "a > b" on overall MAP, per seed, with the shared rule."""
    def line(text: str, a: list[float], b: list[float]) -> str:
        return f"- {text}: {spread_cell(a, '.4f')} vs {spread_cell(b, '.4f')} — {claim(a, b)}."

    m = {name: list(overall(t3, name).values()) for name in t3["per_seed"]}
    v = list(t2["per_seed"])
    out = [line("FedAvg beats each silo alone overall", m["fedavg"], m["local"])]
    for fedmatch in ("fedmatch", "fedmatch_plr"):
        for base in ("fedavg", "fedavg_equal", "fedper", "lg_fedavg"):
            out.append(line(f"{fedmatch} beats {base}", m[fedmatch], m[base]))
    out.append(line("low-rank >= PAL (mean over insertions)", mean_of(t2, [k for k in v if k.endswith("_lr")]),
                    mean_of(t2, [k for k in v if k.endswith("_pal")])))
    out.append(line("horizontal/vertical >= inner/outer (mean over g)", mean_of(t2, [k for k in v if k[0] in "hv"]),
                    mean_of(t2, [k for k in v if k[0] in "io"])))
    out.append(line("client sampling: FedAvg_CS > FedAvg", m["fedavg_cs"], m["fedavg"]))
    out.append(line("client sampling: FedMatch_CS > FedMatch", m["fedmatch_cs"], m["fedmatch"]))
    return out


def recipe_claims(t3: dict, paper: dict) -> list[str]:
    """Today's recipe (constant 5e-5, batch 8) against the paper's on the same questions, per method."""
    out = []
    for method in ("local", "fedavg", "fedmatch"):
        a, b = list(overall(t3, method).values()), list(overall(paper, method).values())
        out.append(f"- {method}: today's recipe {spread_cell(a, '.4f')} vs the paper's {spread_cell(b, '.4f')} — "
                   f"today's > the paper's: {claim(a, b)}.")
    return out


if __name__ == "__main__":
    main()
