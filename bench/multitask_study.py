"""The FewFedWeight study (Tables 1, 2 and 4 of the paper) at a scale that fits 2 CPU cores.

Runs every variant of experiments/multitask/study.toml, each in its own process (so each variant's
peak RSS is its own) into --out, then compares each against Data Silo with `fedsilo compare`'s
arithmetic (PIR per task, APIR per client then over clients, Win/Lose/Tie) and writes --doc:
Table 1 (methods), Table 2 (ablations), Table 4 (seconds per local epoch of one client, split into
pseudo-label generation and training) and the paper's claims checked. Finished variants are skipped
on a re-run, so an interrupted study continues.

    python bench/multitask_study.py --out runs/multitask-study --doc docs/multitask-study.md [--jobs 2] [--more-samples 13]
                                    [--only fedavg,fewfedweight]
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

from fedsilo.runs.compare import compare, read_results
from fedsilo.tasks.multitask.catalog import CATALOG
from fedsilo.tasks.multitask.converters import load_all
from fedsilo.runs.report import markdown_table, read_rounds

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "multitask" / "study.toml"
BASE = "data_silo"
NOISE = "data_silo_seed1"
SAMPLED = ["data_silo", "data_silo_da", "fedavg", "ditto", "fewfedweight"]  # re-run on --more-samples
TABLE1 = ["data_silo_da", "fedavg", "ditto", "meta_weighting", "fewfedweight", "centralized"]
TABLE2 = ["fedavg_da", "ffw_no_pseudo", "ffw_uniform", "ffw_size", "ffw_personal_0_01", "fewfedweight"]
LABELS = {"data_silo": "Data Silo", "data_silo_da": "Data Silo DA", "fedavg": "FedAvg", "ditto": "Ditto",
          "meta_weighting": "Meta Weighting", "fewfedweight": "FewFedWeight", "centralized": "Centralized",
          "fedavg_da": "FedAvg + data augmentation (uniform weights, size aggregation)",
          "ffw_no_pseudo": "FewFedWeight without pseudo data", "ffw_uniform": "FewFedWeight without energy weights",
          "ffw_size": "FewFedWeight without dynamic aggregation",
          "ffw_personal_0_01": "FewFedWeight, personal term 0.005·‖·‖² (the paper: 1·‖·‖²)",
          "data_silo_seed1": "Data Silo, another seed"}
READING = "## Reading"
MEASURE = """
import resource, sys
from fedsilo.cli import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def run_variant(variant: str, out: Path, study: Path, threads: int, assignments: tuple[str, ...] = ()) -> str | None:
    """One variant in a fresh process with `threads` torch threads; its peak RSS goes to
    OUT/VARIANT/peak_rss.json. Returns the failure's output, None on success."""
    if (out / variant / "results.json").is_file():
        return None
    print(f"running {variant} {' '.join(assignments)}...", flush=True)
    sets = [a for item in assignments for a in ("--set", item)]
    done = subprocess.run([sys.executable, "-c", MEASURE, "study", str(study), "--only", variant, "--out", str(out),
                           "--no-progress", *sets], capture_output=True, text=True,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        return f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    (out / variant / "peak_rss.json").write_text(json.dumps({"peak_rss_gib": rss / 2**20, "threads": threads}))
    print(f"finished {variant}", flush=True)
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


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def summaries(out: Path, names: list[str]) -> dict[str, tuple[dict, dict]]:
    """{variant: (comparison on the task metrics, comparison on test loss)} against Data Silo."""
    base = read_results(out / BASE)
    return {n: (compare(read_results(out / n), base), compare(on_loss(read_results(out / n)), on_loss(base)))
            for n in names}


def summary_rows(found: dict[str, tuple[dict, dict]], names: list[str]) -> list[list[str]]:
    rows = [["method", "APIR", "Win", "Lose", "Tie", "PIR undefined", "APIR per client", "test-loss APIR"]]
    for name in names:
        s, loss = found[name]
        per_client = ", ".join(f"{c.replace('client_', 'c')} {pct(v)}" for c, v in s["clients"].items())
        rows.append([LABELS.get(name, name), pct(s["apir"]), str(s["win"]), str(s["lose"]), str(s["tie"]),
                     str(s["undefined"]), per_client, pct(loss["apir"])])
    return rows


def samples_section(out: Path, base_seed: list[int], seeds: list[int]) -> list[str]:
    """APIR of the main methods on each few-shot sample (the study's own, then each re-run)."""
    if not seeds:
        return []
    dirs = [(f"sample {base_seed}", out)] + [(f"sample [{s}]", out / f"sample-{s}") for s in seeds]
    found = [summaries(d, SAMPLED[1:]) for _, d in dirs]
    rows = [["method", *(f"{label}: APIR / W-L-T / test-loss APIR" for label, _ in dirs)]]
    for name in SAMPLED[1:]:
        rows.append([LABELS[name], *(f"{pct(f[name][0]['apir'])} / {f[name][0]['win']}-{f[name][0]['lose']}-"
                                     f"{f[name][0]['tie']} / {pct(f[name][1]['apir'])}" for f in found)])
    return ["## Another few-shot sample (the same tasks, clients and settings)", markdown_table(rows)]


def claims(found: dict[str, tuple[dict, dict]]) -> list[str]:
    """The paper's claims, each checked on both signals, next to what a re-seeded Data Silo gives."""
    noise, noise_loss = found[NOISE]
    lines = [f"- Yardstick: Data Silo re-run with another model seed scores APIR {pct(noise['apir'])} "
             f"(Win {noise['win']} / Lose {noise['lose']} / Tie {noise['tie']}), test-loss APIR "
             f"{pct(noise_loss['apir'])}. A difference smaller than this is within what the seed alone moves."]
    ffw, ffw_loss = found["fewfedweight"]
    for other, why in [("fedavg", "FewFedWeight beats FedAvg"), ("ditto", "FewFedWeight beats Ditto"),
                       ("data_silo_da", "FewFedWeight beats Data Silo DA"),
                       ("ffw_no_pseudo", "pseudo data helps"), ("ffw_uniform", "energy weights help"),
                       ("ffw_size", "dynamic (loss) aggregation helps")]:
        o, o_loss = found[other]
        verdicts = []
        for label, a, b, yard in (("task metrics", ffw["apir"], o["apir"], noise["apir"]),
                                  ("test loss", ffw_loss["apir"], o_loss["apir"], noise_loss["apir"])):
            if a is None or b is None:
                verdicts.append(f"{label}: undefined")
                continue
            verdict = "holds" if a > b else "no difference" if a == b else "does not hold"
            within = " (within the yardstick)" if a != b and yard is not None and abs(a - b) <= abs(yard) else ""
            verdicts.append(f"{label}: {verdict}{within} ({pct(a)} vs {pct(b)})")
        lines.append(f"- {why} (FewFedWeight vs {LABELS[other]}): " + "; ".join(verdicts))
    return lines


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
    ap.add_argument("--more-samples", default="",
                    help=f"comma-separated few-shot sample seeds to re-run {', '.join(SAMPLED)} on (into OUT/sample-SEED)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="variants run at once, the cores split between them (Table 4 then times each under that load)")
    args = ap.parse_args()
    load_all()
    out, study = Path(args.out), Path(args.study)
    variants = list(tomllib.loads(study.read_text())["variants"])
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    extra = [int(x) for x in args.more_samples.split(",")] if args.more_samples else []
    jobs = [(v, out, ()) for v in (args.only.split(",") if args.only else variants)]
    jobs += [(v, out / f"sample-{seed}", (f"task.sample_seeds=[{seed}]",)) for seed in extra for v in SAMPLED]
    with ThreadPoolExecutor(args.jobs) as pool:
        failures = [f for f in pool.map(lambda j: run_variant(j[0], j[1], study, threads, j[2]), jobs) if f]
    if failures:
        sys.exit("\n".join(failures))
    if not all((out / v / "results.json").is_file() for v in variants):
        print("not every variant has finished: no tables yet")
        return
    raw = tomllib.loads(study.read_text())
    found = summaries(out, [v for v in variants if v != BASE])
    tasks = task_rows(out, [v for v in variants if v != BASE])
    costs = cost_rows(out, variants, raw["base"]["client"]["epochs"])
    text = "\n\n".join([
        "## Table 1: methods against Data Silo", markdown_table(summary_rows(found, TABLE1)),
        "## Table 2: ablations against Data Silo", markdown_table(summary_rows(found, TABLE2)),
        "## The paper's claims", "\n".join(claims(found)),
        *samples_section(out, raw["base"]["task"]["sample_seeds"], extra),
        "## Table 4: seconds per local epoch of one client (median over clients and rounds)", markdown_table(costs),
        "## Every task (test metric, %)", markdown_table(tasks)])
    print(text)
    if args.doc:
        write_doc(Path(args.doc), text, scale(raw, args.jobs))


def scale(raw: dict, jobs: int) -> str:
    b = raw["base"]
    t, m, c, f = b["task"], b["model"], b["client"], b["federation"]
    return (f"Scale: {t['clients']} clients × {len(t['tasks']) // t['clients']} tasks ({', '.join(t['tasks'])}), "
            f"few-shot sample seed(s) {t['sample_seeds']}, model {m['name']} ({m.get('num_decoder_layers')} decoder "
            f"layers), {c['optimizer']} lr {c['lr']}, batch {c['batch_size']}, {f['rounds']} rounds × {c['epochs']} "
            f"local epochs, source/target ≤ {t['max_source_length']}/{t['max_target_length']} tokens; {jobs} "
            f"variant(s) at a time, {max(1, (os.cpu_count() or 1) // jobs)} torch thread(s) each.")


def write_doc(path: Path, tables: str, scale_line: str) -> None:
    """The generated part; a hand-written `## Reading` section already in the file is kept."""
    kept = ""
    if path.is_file() and READING in path.read_text():
        kept = path.read_text()[path.read_text().index(READING):]
    stamp = (f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, Python "
             f"{platform.python_version()}. Command: `python bench/multitask_study.py {' '.join(sys.argv[1:])}` (variants run in subprocesses; finished ones are skipped on a re-run).")
    head = (f"# FewFedWeight study at CPU scale\n\n<!-- tables generated by bench/multitask_study.py -->\n{stamp}\n\n"
            f"{scale_line}\n\nAPIR: PIR = (m − m_DataSilo)/m_DataSilo per task on the task's own CrossFit metric, "
            f"mean per client, then over clients (`fedsilo compare`); rows where Data Silo scores 0 have no PIR "
            f"(counted as undefined). Test-loss APIR is the same on the teacher-forced test loss (lower is better, "
            f"so a positive value is a lower loss): a graded signal where the few-shot metrics sit at chance.\n\n")
    path.write_text(head + tables + "\n" + (f"\n{kept}" if kept else ""))


if __name__ == "__main__":
    main()
