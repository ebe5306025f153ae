"""The FewFedWeight study (Tables 1, 2 and 4 of the paper) at a scale that fits 2 CPU cores.

Runs every variant of experiments/multitask/study.toml once per seed (--seeds, default 0,1,2), each
variant and seed in its own process (so each run's peak RSS is its own), into --out: OUT/VARIANT/seed-S
with several seeds, OUT/VARIANT with one, each built exactly as `fedsilo study --seeds` builds it
(fedsilo.runs.studyfile.load_study with the seed). Seed S sets the model init, data order and dropout and
also draws another few-shot sample: each of the study's `task.sample_seeds` plus S (seed 0 keeps the
configured sample), unless the study sets `[study] vary_sample = false`. The sample moves a few-shot
result as much as the model seed does, so it belongs in the spread; this is why `--more-samples`
(re-running a few methods on another sample) is gone: the seeds cover it, as they replace the old
yardstick (Data Silo run again with another seed).

Then compares each variant against Data Silo of the same seed with `fedsilo compare`'s arithmetic
(PIR per task, APIR per client then over clients, Win/Lose/Tie) and writes --doc: Table 1 (methods),
Table 2 (ablations), each cell mean ± sd over the seeds; the paper's claims judged on the per-seed
APIRs by the shared significance rule (fedsilo.runs.spread.claim_marked: Welch's t-test over the
seeds, never below the shown precision of an APIR, 0.1 percentage point; a verdict the old spread
rule judged otherwise is marked); Table 4 (seconds per local epoch of one client, split into pseudo-label generation and
training, the mean over the seeds) and every task. A hand-written `## Reading` section already in the
doc is kept. Finished runs are skipped on a re-run, so an interrupted study continues.

    python bench/multitask_study.py --out runs/multitask-study --doc docs/multitask-study.md [--seeds 0,1,2]
                                    [--jobs 2] [--only fedavg,fewfedweight]
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
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from fedsilo.rundir.records import read_rounds
from fedsilo.runs.compare import compare, read_results
from fedsilo.runs.spread import CHANGED, RULE, SPREAD, claim_marked, mean_sd, spread_cell
from fedsilo.runs.study import run_dir
from fedsilo.runs.studyfile import parse_seeds
from fedsilo.runs.tables import markdown_table
from fedsilo.tasks.multitask.catalog import CATALOG
from fedsilo.tasks.multitask.converters import load_all

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "multitask" / "study.toml"
BASE = "data_silo"
TABLE1 = ["data_silo_da", "fedavg", "ditto", "meta_weighting", "fewfedweight", "centralized"]
TABLE2 = ["fedavg_da", "ffw_no_pseudo", "ffw_uniform", "ffw_size", "ffw_personal_0_01", "fewfedweight"]
LABELS = {"data_silo": "Data Silo", "data_silo_da": "Data Silo DA", "fedavg": "FedAvg", "ditto": "Ditto",
          "meta_weighting": "Meta Weighting", "fewfedweight": "FewFedWeight", "centralized": "Centralized",
          "fedavg_da": "FedAvg + data augmentation (uniform weights, size aggregation)",
          "ffw_no_pseudo": "FewFedWeight without pseudo data", "ffw_uniform": "FewFedWeight without energy weights",
          "ffw_size": "FewFedWeight without dynamic aggregation",
          "ffw_personal_0_01": "FewFedWeight, personal term 0.005·‖·‖² (the paper: 1·‖·‖²)"}
READING = "## Reading"
MEASURE = """
import os, resource, sys
from pathlib import Path
from transformers.utils import logging as hf_logging
from fedsilo.runs.report import write_report
from fedsilo.runs.runner import run_experiment
from fedsilo.runs.study import run_dir
from fedsilo.runs.studyfile import load_study
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
study, variant, out, seed, multi = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
cfg = load_study(study, only=[variant], seed=seed, multi_seed=multi)[1][variant]  # exactly as run_study builds it
target = run_dir(out, variant, seed, multi)
run_experiment(cfg, target, resume=True, show_progress="lines")
write_report(target)
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def variants_of(study: Path) -> list[str]:
    return list(tomllib.loads(study.read_text())["variants"])


def run_variant(variant: str, out: Path, study: Path, threads: int, seed: int, multi: bool) -> str | None:
    """One variant with one seed in a fresh process with `threads` torch threads; its peak RSS goes to
    its run directory's peak_rss.json. Returns the failure's output, None on success."""
    target = run_dir(out, variant, seed, multi)
    if (target / "results.json").is_file():
        return None
    print(f"running {variant} seed {seed}...", flush=True)
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",  # as the CLI sets them
           **os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(study), variant, str(out), str(seed), str(int(multi))],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        return f"{variant} seed {seed} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    (target / "peak_rss.json").write_text(json.dumps({"peak_rss_gib": rss / 2**20, "threads": threads}))
    print(f"finished {variant} seed {seed}", flush=True)
    return None


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


def on_loss(results: dict) -> dict:
    """The same results scored by test loss (lower is better): a graded signal where few-shot task
    metrics sit at chance."""
    return {**results, "metric_spec": {**results["metric_spec"], "primary": "loss", "higher_is_better": False}}


def pct(values: list[float | None]) -> str:
    """Rates as percentages, `mean% ± sd` (percentage points) over the seeds; `—` when none is defined."""
    m, sd = mean_sd([None if v is None else 100 * v for v in values])
    return "—" if m is None else f"{m:+.1f}%" + ("" if sd is None else f" ± {sd:.1f}")


Found = dict[str, dict[int, tuple[dict, dict]]]  # variant → seed → (on the task metrics, on test loss)


def summaries(out: Path, names: list[str], seeds: list[int]) -> Found:
    """Each variant against Data Silo of the same seed, on the task metrics and on test loss."""
    multi = len(seeds) > 1
    found: Found = {n: {} for n in names}
    for seed in seeds:
        base = read_results(run_dir(out, BASE, seed, multi))
        for n in names:
            new = read_results(run_dir(out, n, seed, multi))
            found[n][seed] = (compare(new, base), compare(on_loss(new), on_loss(base)))
    return found


def apirs(found: Found, name: str, loss: bool = False) -> list[float | None]:
    """A variant's APIR per seed (None where no PIR was defined)."""
    return [pair[int(loss)]["apir"] for pair in found[name].values()]


def summary_rows(found: Found, names: list[str]) -> list[list[str]]:
    rows = [["method", "APIR", "Win", "Lose", "Tie", "PIR undefined", "APIR per client", "test-loss APIR"]]
    for name in names:
        per_seed = [s for s, _ in found[name].values()]
        clients = list(per_seed[0]["clients"])
        per_client = ", ".join(f"{c.replace('client_', 'c')} {pct([s['clients'][c] for s in per_seed])}"
                               for c in clients)
        counts = [spread_cell([s[k] for s in per_seed], ".1f") for k in ("win", "lose", "tie", "undefined")]
        rows.append([LABELS.get(name, name), pct(apirs(found, name)), *counts, per_client,
                     pct(apirs(found, name, loss=True))])
    return rows


def claims(found: Found) -> list[str]:
    """The paper's claims on the per-seed APIRs (each seed's against its own Data Silo), both signals,
    judged by the shared rule."""
    n = len(next(iter(found.values())))
    lines = [f"- Each claim \"a > b\" is judged on the per-seed APIRs (n = {n}, as fractions: 0.001 = 0.1 "
             f"percentage point) by one rule: {RULE}. \"Beats Data Silo\" compares the APIR with Data Silo's own, "
             "0 on every seed."]

    def verdicts(a: str, b: str | None) -> str:
        out = []
        for label, loss in (("task metrics", False), ("test loss", True)):
            x = [v for v in apirs(found, a, loss) if v is not None]
            y = [0.0] * len(found[a]) if b is None else [v for v in apirs(found, b, loss) if v is not None]
            out.append(f"{label}: {claim_marked(x, y, '.3f')} ({pct(x)} vs {pct(y) if b is not None else '0'})")
        return "; ".join(out)

    lines.append(f"- FewFedWeight beats Data Silo (APIR > 0): {verdicts('fewfedweight', None)}")
    for other, why in [("fedavg", "FewFedWeight beats FedAvg"), ("ditto", "FewFedWeight beats Ditto"),
                       ("data_silo_da", "FewFedWeight beats Data Silo DA"),
                       ("ffw_no_pseudo", "pseudo data helps"), ("ffw_uniform", "energy weights help"),
                       ("ffw_size", "dynamic (loss) aggregation helps")]:
        lines.append(f"- {why} (FewFedWeight vs {LABELS[other]}): {verdicts('fewfedweight', other)}")
    changed = sum(line.count(CHANGED) for line in lines)
    lines.insert(1, f"- **Verdicts under the significance rule:** {changed} verdict(s) differ from the spread rule's "
                    f"(marked `[{CHANGED}: …]`: old → the verdict before it)." if changed else
                    "- **Verdicts under the significance rule:** none differs from the spread rule's.")
    return lines


def task_rows(out: Path, names: list[str], seeds: list[int]) -> list[list[str]]:
    """Every (client, task) row: Data Silo's metric and each method's, mean ± sd over the seeds."""
    multi = len(seeds) > 1
    runs = {n: [read_results(run_dir(out, n, s, multi)) for s in seeds] for n in [BASE, *names]}
    primary = runs[BASE][0]["metric_spec"]["primary"]
    values = {n: [{(r["client"], r["task"]): r["metrics"][primary] for r in res["test"]["rows"]} for res in rs]
              for n, rs in runs.items()}
    head = ["client", "task", "metric", "Data Silo", *(LABELS.get(n, n).split(" (")[0] for n in names)]
    rows = [head]
    for r in runs[BASE][0]["test"]["rows"]:
        key = (r["client"], r["task"])
        rows.append([r["client"], r["task"], CATALOG.get(r["task"]).metric,
                     *(spread_cell([v[key] for v in values[n]], ".1f") for n in [BASE, *names])])
    return rows


def cost_rows(out: Path, names: list[str], epochs: int, seeds: list[int]) -> list[list[str]]:
    """Table 4: seconds per local epoch by phase and wall time, each the mean over the seeds; peak RSS the
    largest over the seeds."""
    multi = len(seeds) > 1
    rows = [["method", "generating s/epoch", "training s/epoch", "personal model s/epoch", "total s/epoch",
             "wall time", "peak RSS"]]
    for name in names:
        dirs = [run_dir(out, name, s, multi) for s in seeds]
        phases = [epoch_seconds(d, epochs) for d in dirs]
        gen, train, pers = (statistics.fmean(p.get(k, 0.0) for p in phases)
                            for k in ("before_training", "training", "personal"))
        wall = statistics.fmean(float(read_results(d).get("wall_seconds") or 0.0) for d in dirs)
        rss = [json.loads((d / "peak_rss.json").read_text())["peak_rss_gib"] for d in dirs
               if (d / "peak_rss.json").is_file()]
        rows.append([LABELS.get(name, name).split(" (")[0], f"{gen:.1f}", f"{train:.1f}", f"{pers:.1f}",
                     f"{gen + train + pers:.1f}", f"{wall / 60:.1f} min", f"{max(rss):.2f} GiB" if rss else "-"])
    return rows


def tables(out: Path, study: Path, seeds: list[int], variants: list[str]) -> str:
    """The generated part of the doc, from finished runs."""
    raw = tomllib.loads(study.read_text())
    others = [v for v in variants if v != BASE]
    found = summaries(out, others, seeds)
    n = len(seeds)
    spread = (f"Each cell: mean ± sd over n = {n} seeds ({', '.join(map(str, seeds))}), {SPREAD}; each seed's "
              "APIR and Win/Lose/Tie are against Data Silo of the same seed (and sample)." if n > 1 else
              f"One seed ({seeds[0]}): no spread.")
    over = ", mean over the seeds" if n > 1 else ""
    return "\n\n".join([
        spread,
        "## Table 1: methods against Data Silo", markdown_table(summary_rows(found, [v for v in TABLE1 if v in found])),
        "## Table 2: ablations against Data Silo",
        markdown_table(summary_rows(found, [v for v in TABLE2 if v in found])),
        "## The paper's claims", "\n".join(claims(found)),
        f"## Table 4: seconds per local epoch of one client (median over clients and rounds{over})",
        markdown_table(cost_rows(out, variants, raw["base"]["client"]["epochs"], seeds)),
        "## Every task (test metric, %)", markdown_table(task_rows(out, others, seeds))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/multitask-study")
    ap.add_argument("--doc", default=None, help="write the study's tables to this markdown file")
    ap.add_argument("--only", default=None, help="comma-separated variants to run (the tables need all)")
    ap.add_argument("--study", default=str(STUDY))
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each variant runs once per seed "
                    "(a seed also shifts the few-shot sample unless [study] vary_sample = false)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, the cores split between them (Table 4 then times each under that load)")
    args = ap.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        ap.error(str(err))
    multi = len(seeds) > 1
    load_all()
    out, study = Path(args.out), Path(args.study)
    variants = variants_of(study)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    chosen = args.only.split(",") if args.only else variants
    jobs = [(v, seed) for seed in seeds for v in chosen]  # every variant of one seed before the next
    with ThreadPoolExecutor(args.jobs) as pool:
        failures = [f for f in pool.map(lambda j: run_variant(j[0], out, study, threads, j[1], multi), jobs) if f]
    if failures:
        sys.exit("\n".join(failures))
    if not all((run_dir(out, v, s, multi) / "results.json").is_file() for v in variants for s in seeds):
        print("not every variant has finished for every seed: no tables yet")
        return
    text = tables(out, study, seeds, variants)
    print(text)
    if args.doc:
        write_doc(Path(args.doc), text, scale(tomllib.loads(study.read_text()), args.jobs, seeds))


def scale(raw: dict, jobs: int, seeds: list[int]) -> str:
    b = raw["base"]
    t, m, c, f = b["task"], b["model"], b["client"], b["federation"]
    vary = raw.get("study", {}).get("vary_sample", True)
    sample = (f"few-shot sample seed(s) {t['sample_seeds']} + S for seed S" if vary else
              f"few-shot sample seed(s) {t['sample_seeds']} for every seed")
    return (f"Scale: {t['clients']} clients × {len(t['tasks']) // t['clients']} tasks ({', '.join(t['tasks'])}), "
            f"seeds {', '.join(map(str, seeds))}, {sample}, model {m['name']} ({m.get('num_decoder_layers')} "
            f"decoder layers), {c['optimizer']} lr {c['lr']}, batch {c['batch_size']}, {f['rounds']} rounds × "
            f"{c['epochs']} local epochs, source/target ≤ {t['max_source_length']}/{t['max_target_length']} tokens; "
            f"{jobs} run(s) at a time, {max(1, (os.cpu_count() or 1) // jobs)} torch thread(s) each.")


def write_doc(path: Path, text: str, scale_line: str) -> None:
    """The generated part; a hand-written `## Reading` section already in the file is kept."""
    kept = ""
    if path.is_file() and READING in path.read_text():
        kept = path.read_text()[path.read_text().index(READING):]
    stamp = (f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, Python "
             f"{platform.python_version()}. Command: `python bench/multitask_study.py {' '.join(sys.argv[1:])}` "
             "(each variant and seed runs in a subprocess; finished ones are skipped on a re-run).")
    head = (f"# FewFedWeight study at CPU scale\n\n<!-- tables generated by bench/multitask_study.py -->\n{stamp}\n\n"
            f"{scale_line}\n\nAPIR: PIR = (m − m_DataSilo)/m_DataSilo per task on the task's own CrossFit metric, "
            f"mean per client, then over clients (`fedsilo compare`); rows where Data Silo scores 0 have no PIR "
            f"(counted as undefined). Test-loss APIR is the same on the teacher-forced test loss (lower is better, "
            f"so a positive value is a lower loss): a graded signal where the few-shot metrics sit at chance.\n\n")
    path.write_text(head + text + "\n" + (f"\n{kept}" if kept else ""))


if __name__ == "__main__":
    main()
