"""The Dynamic Pulling study (Passban et al. 2022, Tables 2-7) at a scale that fits 2 CPU cores, or
at the paper's scale on a GPU (`--scale paper`).

Runs every config of experiments/nmt/ in dependency order once per seed (--seeds, default 0,1,2;
applied as `fedsilo study` does, fedsilo.runs.studyfile.seeded: model init, data order, dropout) into
--out: OUT/NAME/seed-S with several seeds, OUT/NAME with one. Each seed is a whole chain of its own:
its own generic engine (stage 1 is seeded too: its model init differs), then that seed's runs start
from it (model.init_from = OUT/generic/seed-S), the chained links from that seed's previous link and
the post-FL fine-tuning from that seed's FedAvg. All runs of one seed finish before the next seed
starts, so an interrupted study already holds a whole comparison. `--jobs N` runs N seeds' chains at
once, each in its own process with cores // N torch threads and one engine worker (a 2-core machine
keeps both cores busy through the single-client stages: generic, alone, chained, combination).

Then writes a markdown report: the paper's tables as cross-domain BLEU matrices (each cell mean ± sd
over the seeds), the parameters each method exchanged per round as a share of FedAvg's (round 1 and
the mean over rounds, up and down, each seed against FedAvg of the same seed), wall time per round,
and the paper's claims judged by the shared significance rule (fedsilo.runs.spread.claim_marked:
Welch's t-test over the seeds on these records, never below BLEU's shown precision, 0.01; a verdict
the old spread rule judged otherwise is marked). The exchange table is printed too. A hand-written `## Reading`
section already in the doc is kept. Finished runs are skipped on a re-run (results.json present).

    python bench/nmt_study.py --out runs/nmt --doc docs/nmt-study.md [--seeds 0,1,2] [--only generic,fedavg]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from fedsilo.config import RunConfig, load_config
from fedsilo.rundir.records import read_rounds
from fedsilo.runs.spread import CHANGED, RULE, SPREAD, claim_marked as claim, mean_sd, spread_cell
from fedsilo.runs.study import run_dir
from fedsilo.runs.studyfile import parse_seeds, seeded
from fedsilo.runs.tables import markdown_table

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments" / "nmt"
DOMAINS = ["news", "ted", "tatoeba", "docs", "ui"]
LABEL = {"news": "News", "ted": "TED", "tatoeba": "Tatoeba", "docs": "Docs", "ui": "UI"}
CHAIN = ["ui", "tatoeba", "docs", "ted", "news"]  # the news engine's own domain last
FL = ["fedavg", "fedavg-r10", "fedavg-r25", "dp_l", "dp_g", "random", "dp_l-33", "dp_g-33", "controllers",
      "controllers-8e8d", "dp_l-count"]
READING = "## Reading"
OPTIONAL = ["dp_l-count"]  # beyond the paper: its text read literally (θ = count median), reported when it has run
ORDER = ["generic", "alone", *(f"chained-{i + 1}" for i in range(len(CHAIN))), "combination", "fedavg",
         "finetune-after-fl", *FL[1:-1], *OPTIONAL]

# The paper's scale (section 5.1): Transformer base, 10K steps per round, all data, 2,000-pair
# dev/test sets, a 30K-ish joint vocabulary; Controllers 6E6D (0-3) exchange layers 0 and 3 of 6.
PAPER = ["model.d_model=512", "model.d_ff=2048", "model.num_heads=8", "model.num_layers=6",
         "model.num_decoder_layers=6", "task.vocab_size=32000", "task.max_eval=2000",
         "task.max_source_length=128", "task.max_target_length=128", "client.batch_size=64"]
PAPER_STEPS = {"generic": 20000, "alone": 50000, "chained": 10000, "combination": 10000, "finetune-after-fl": 10000}
PAPER_CONTROLLERS = ('exchange.shared=["model.encoder.layers.0.*", "model.encoder.layers.3.*", '
                     '"model.decoder.layers.0.*", "model.decoder.layers.3.*"]')


def source_of(name: str) -> str | None:
    """The run a run starts from (model.init_from), within the same seed; None: from scratch."""
    if name in ("generic", "alone"):
        return None
    if name.startswith("chained-"):
        link = int(name.split("-")[1])
        return "generic" if link == 1 else f"chained-{link - 1}"
    return "fedavg" if name == "finetune-after-fl" else "generic"


def config_for(name: str, out: Path, scale: str, seed: int = 0, multi: bool = False) -> tuple[Path, list[str]]:
    """(config file, overrides) of one experiment; init_from points at the same seed's run in `out`."""
    base = "chained" if name.startswith("chained-") else name
    sets = []
    if name.startswith("chained-"):
        sets.append(f'task.silos=["{CHAIN[int(name.split("-")[1]) - 1]}"]')
    source = source_of(name)
    if source is not None:
        sets.append(f"model.init_from={run_dir(out, source, seed, multi)}")
    if scale == "paper":
        sets += PAPER
        steps = PAPER_STEPS.get(base, 10000 if base not in ("fedavg-r10", "fedavg-r25") else None)
        rounds_steps = {"fedavg-r10": 5000, "fedavg-r25": 2000}
        sets.append(f"client.steps={steps or rounds_steps[base]}")
        if base == "controllers":
            sets.append(PAPER_CONTROLLERS)
        if base == "controllers-8e8d":
            sets.append("model.surgery.options.after=[0, 5]")  # after the first and last of 6: 8E8D (0-6)
    return EXPERIMENTS / f"{base}.toml", sets


def config(name: str, out: Path, scale: str, seed: int, multi: bool) -> RunConfig:
    """The validated config of one experiment and seed, seeded as `fedsilo study` seeds a variant."""
    path, sets = config_for(name, out, scale, seed, multi)
    cfg = seeded(load_config(path, sets), seed)
    return cfg.model_copy(update={"name": f"{cfg.name}/seed-{seed}"}) if multi else cfg


def run_all(out: Path, scale: str, only: set[str] | None, seeds: list[int],
            multi: bool | None = None, threads: int | None = None) -> dict[str, dict[int, dict]]:
    """name → seed → results; every name of one seed before the next seed. `threads`: a fixed torch thread
    count and one engine worker (a chain running beside others, `--jobs`)."""
    from fedsilo.runs.runner import run_experiment

    multi = len(seeds) > 1 if multi is None else multi
    results: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        for name in ORDER:
            target = run_dir(out, name, seed, multi)
            if only and name not in only and not (target / "results.json").is_file():
                continue
            if (target / "results.json").is_file():  # finished (also by a chain of --jobs): read, not resumed
                results.setdefault(name, {})[seed] = json.loads((target / "results.json").read_text())
                continue
            cfg = config(name, out, scale, seed, multi)
            if threads is not None:
                cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"threads": threads,
                                                                                     "workers": 1})})
            t0 = time.perf_counter()
            print(f"[nmt study] {name} seed {seed}: {' '.join(config_for(name, out, scale, seed, multi)[1])}",
                  flush=True)
            results.setdefault(name, {})[seed] = run_experiment(cfg, target, resume=target.exists(),
                                                                show_progress=False)
            print(f"[nmt study] {name} seed {seed} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return results


# ---------------------------------------------------------------- reading results

def matrix(results: dict) -> dict[str, dict[str, float]]:
    """model → domain → test BLEU."""
    return {m: {r["client"]: r["metrics"]["bleu"] for r in s["rows"]}
            for m, s in results.get("matrix", {}).get("models", {}).items()}


def own_domain(results: dict) -> dict[str, float]:
    """Each client's own model on its own domain (the paper's DP^c rows), else the test rows."""
    grid = matrix(results)
    if all(d in grid for d in DOMAINS):
        return {d: grid[d][d] for d in DOMAINS}
    return {r["client"]: r["metrics"]["bleu"] for r in results["test"]["rows"]}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def own_means(runs: list[dict]) -> list[float]:
    """Per seed: the mean over domains of each client's model on its own domain."""
    return [mean(own_domain(r)[d] for d in DOMAINS) for r in runs]


def global_means(runs: list[dict]) -> list[float]:
    """Per seed: the mean over domains of the server's (global) model."""
    return [mean(matrix(r)["global"][d] for d in DOMAINS) for r in runs]


def per_round(run: Path) -> dict[int, dict]:
    """rounds.jsonl by round number."""
    return {int(r["round"]): r for r in read_rounds(run)}


def exchange(run: Path, fedavg: Path) -> dict[str, float | None]:
    """One run's exchange against FedAvg's run of the same seed: totals over the run (all clients), and
    parameters per round as a share of FedAvg's in the same round (`up_1`: round 1, `up_mean`: the
    mean over the rounds both ran; the same for down), mean seconds per round."""
    mine, full = per_round(run), per_round(fedavg)
    out: dict[str, float | None] = {k: float(sum(r.get(k) or 0 for r in mine.values()))
                                    for k in ("params_up", "params_down", "bytes_up", "bytes_down")}
    out["seconds"] = mean(float(r.get("seconds") or 0.0) for r in mine.values()) if mine else None
    for key, short in (("params_up", "up"), ("params_down", "down")):
        shares = {n: (r.get(key) or 0) / full[n][key] for n, r in mine.items() if n in full and full[n].get(key)}
        out[f"{short}_1"] = shares.get(1)
        out[f"{short}_mean"] = mean(shares.values()) if shares else None
    return out


# ---------------------------------------------------------------- tables

HEADER = ["", *(LABEL[d] for d in DOMAINS), "Mean"]


def row(label: str, per_seed: list[dict[str, float]]) -> list[str]:
    """One BLEU row: per domain and the mean over domains, each `mean ± sd` over the seeds."""
    return [label, *(spread_cell([s[d] for s in per_seed]) for d in DOMAINS),
            spread_cell([mean(s[d] for d in DOMAINS) for s in per_seed])]


def pct(values: list[float | None]) -> str:
    """Shares as a percentage, `mean% ± sd` (percentage points) over the seeds; `-` when there is none."""
    m, sd = mean_sd([None if v is None else 100 * v for v in values])
    return "-" if m is None else f"{m:.1f}%" + ("" if sd is None else f" ± {sd:.1f}")


def exchange_rows(out: Path, methods: list[str], seeds: list[int]) -> list[list[str]]:
    """The exchange table: per method, totals and shares of FedAvg's parameters per round, over the seeds."""
    multi = len(seeds) > 1
    table = [["method", "params up (run)", "params down (run)", "MB up", "MB down", "up, round 1",
              "up per round (mean)", "down, round 1", "down per round (mean)", "s/round"]]
    for m in methods:
        xs = [exchange(run_dir(out, m, s, multi), run_dir(out, "fedavg", s, multi)) for s in seeds]
        col = {k: [x[k] for x in xs] for k in xs[0]}
        table.append([m, spread_cell(col["params_up"], ",.0f"), spread_cell(col["params_down"], ",.0f"),
                      spread_cell([v / 1e6 for v in col["bytes_up"]]),
                      spread_cell([v / 1e6 for v in col["bytes_down"]]),
                      pct(col["up_1"]), pct(col["up_mean"]), pct(col["down_1"]), pct(col["down_mean"]),
                      spread_cell(col["seconds"], ".1f")])
    return table


def ran_all(res: dict[str, dict[int, dict]], name: str, seeds: list[int]) -> bool:
    return all(s in res.get(name, {}) for s in seeds)


def write_doc(out: Path, res: dict[str, dict[int, dict]], doc: Path, scale: str, command: str,
              seeds: list[int]) -> None:
    runs = {name: [by_seed[s] for s in seeds] for name, by_seed in res.items() if all(s in by_seed for s in seeds)}

    def glob(name: str) -> list[dict[str, float]]:
        return [matrix(r)["global"] for r in runs[name]]

    n = len(seeds)
    lines = [
        "# Dynamic Pulling study (federated mixed-domain translation)\n",
        f"Measured {date.today()} on {platform.machine()}, {platform.processor() or 'CPU'}, scale `{scale}`; "
        f"command: `{command}`. Every number below is sacreBLEU corpus BLEU (13a, mixed case) on each "
        "domain's test subsample; configs in `experiments/nmt/`, runs in `" + str(out) + "/`.\n",
        (f"Every run ran once per seed ({', '.join(map(str, seeds))}: model init, data order, dropout), each "
         "seed a chain of its own (its generic engine, the runs that start from it). Each cell is mean ± sd over "
         f"n = {n} seeds, {SPREAD}.\n" if n > 1 else f"One seed ({seeds[0]}): no spread, so no claim is judged.\n"),
        "## Stage 1 and Table 2: the generic engine, each domain alone\n",
        "Rows: the model (trained on one domain: the generic engine on news, then each domain alone from "
        "scratch); columns: the test domain.\n",
        markdown_table([HEADER, row("generic (news)", glob("generic")),
                        *(row(f"{LABEL[d]} alone", [matrix(r)[d] for r in runs["alone"]]) for d in DOMAINS)]), "",
        "## Table 3: centralized domain adaptation from the generic engine\n",
        markdown_table([HEADER, row("chained (" + " → ".join(LABEL[d] for d in CHAIN) + ")",
                                    glob(f"chained-{len(CHAIN)}")),
                        row("combination (pooled)", glob("combination"))]), "",
        "## Table 4: FedAvg from the generic engine (S), then each client fine-tuned alone\n",
        markdown_table([HEADER, row("S (FedAvg, global)", glob("fedavg")),
                        *(row(f"{LABEL[d]}^c (fine-tuned after FL)", [matrix(r)[d] for r in runs["finetune-after-fl"]])
                          for d in DOMAINS)]), "",
        "## Table 5: rounds at the same total steps per client\n",
        markdown_table([HEADER, *(row(f"S_{k} ({name})", glob(name))
                                  for k, name in ((5, "fedavg"), (10, "fedavg-r10"), (25, "fedavg-r25")))]), "",
    ]
    methods6 = ["fedavg", "dp_l", "dp_g", "random", *(m for m in OPTIONAL if m in runs)]
    methods7 = ["dp_l-33", "dp_g-33", "controllers", "controllers-8e8d"]
    pulled = (" DP_l and DP_g upload the ranked tensors (least / most changed since the client's previous round; "
              "in round 1, since the start model) until they hold half of each group's parameters "
              "(`exchange.upload_options.share`, 0.5 by default); random draws as many parameters. The whole global "
              "model comes down and a client overwrites only the tensors it uploaded. What each actually sent: the "
              "exchange table below.")
    if "dp_l-count" in methods6:
        pulled += (" dp_l-count (beyond the paper): DP_l with θ the median change over tensors (the paper's text "
                   "read literally, `threshold = \"count\"`) instead of a share of the parameters.")
    for title, methods, more in (("Table 6: Dynamic Pulling, upload only", methods6, pulled),
                                 ("Table 7: a third of the parameters both ways vs Controllers", methods7,
                                  " Controllers 6E6D exchange fixed base layers, 8E8D only the added controller "
                                  "layers.")):
        own = [row(f"{m} (clients, own domain)", [own_domain(r) for r in runs[m]]) for m in methods]
        glb = [row(f"{m} (global)", glob(m)) for m in methods]
        lines += [f"## {title}\n", "Client rows: each client's model on its own domain (the paper's "
                  f"DP^c); global rows: the server's model on every domain.{more}\n",
                  markdown_table([HEADER, *own, *glb]), ""]
    fl = [m for m in FL if m in runs]
    lines += ["## Parameters exchanged and time per round\n",
              "Totals over the run, all clients (mean over the seeds). The shares are parameters per round as a "
              "percentage of FedAvg's in the same round (same seed): round 1, and the mean over the rounds both "
              "ran (a run with more rounds than FedAvg, fedavg-r10/-r25, is compared over FedAvg's rounds). "
              "Every round pulls its part, round 1 included (it ranks against the start model).\n",
              markdown_table(exchange_rows(out, fl, seeds)), "",
              "## The paper's claims at this scale\n", *claims(runs, out, seeds), ""]
    old = doc.read_text() if doc.is_file() else ""  # a hand-written `## Reading` section stays below the tables
    kept = "\n" + old[old.index(READING):] if READING in old else ""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines) + "\n" + kept)
    print(f"[nmt study] wrote {doc}")


def claims(runs: dict[str, list[dict]], out: Path, seeds: list[int]) -> list[str]:
    """The paper's claims "a > b" on per-seed BLEU means, each judged by the shared rule (`claim_marked`),
    then a note naming the verdicts the significance rule changed."""
    multi = len(seeds) > 1
    own = {m: own_means(runs[m]) for m in ("fedavg", "dp_l", "dp_g", "random", "dp_l-33", "dp_g-33",
                                           "controllers", "controllers-8e8d")}
    glob = {m: global_means(runs[m]) for m in ("fedavg", "dp_l")}
    alone = {d: [mean(matrix(r)[d][x] for x in DOMAINS) for r in runs["alone"]] for d in DOMAINS}

    def up(m: str) -> str:
        return pct([exchange(run_dir(out, m, s, multi), run_dir(out, "fedavg", s, multi))["up_mean"] for s in seeds])

    def c(values: list[float]) -> str:
        return spread_cell(values)

    def gap(a: list[float], b: list[float]) -> str:
        return f"{mean_sd(a)[0] - mean_sd(b)[0]:+.2f}"

    lines = [
        "1. FL from the generic engine beats each domain trained alone on average BLEU: FedAvg (global) "
        f"{c(global_means(runs['fedavg']))} vs " + "; ".join(
            f"{LABEL[d]} alone {c(v)}: {claim(global_means(runs['fedavg']), v)}" for d, v in alone.items()) + ".",
        "2. DP_l loses little against exchanging everything (the paper: −1.55 BLEU at half the parameters): on "
        f"the clients' own domains DP_l {c(own['dp_l'])} vs FedAvg {c(own['fedavg'])} (gap "
        f"{gap(own['dp_l'], own['fedavg'])}; FedAvg > DP_l: {claim(own['fedavg'], own['dp_l'])}); the global "
        f"model {c(glob['dp_l'])} vs {c(glob['fedavg'])} (gap {gap(glob['dp_l'], glob['fedavg'])}; FedAvg > "
        f"DP_l: {claim(glob['fedavg'], glob['dp_l'])}); DP_l uploads {up('dp_l')} of FedAvg's parameters per "
        "round (mean over rounds).",
        f"3. DP_l > DP_g (own domains): {c(own['dp_l'])} vs {c(own['dp_g'])} — {claim(own['dp_l'], own['dp_g'])}.",
        f"4. DP_l ≥ random (own domains): {c(own['dp_l'])} vs {c(own['random'])} — DP_l > random: "
        f"{claim(own['dp_l'], own['random'])} (≥ fails only when reversed).",
        f"5. At a third both ways, DP is competitive with Controllers (own domains): DP_l-33 {c(own['dp_l-33'])}, "
        f"DP_g-33 {c(own['dp_g-33'])}, Controllers 6E6D {c(own['controllers'])}, Controllers 8E8D "
        f"{c(own['controllers-8e8d'])} — DP_l-33 > Controllers 6E6D: {claim(own['dp_l-33'], own['controllers'])}; "
        f"DP_l-33 > Controllers 8E8D: {claim(own['dp_l-33'], own['controllers-8e8d'])} (competitive: not "
        f"reversed). Up per round (mean, of FedAvg's): DP_l-33 {up('dp_l-33')}, Controllers 6E6D "
        f"{up('controllers')}, Controllers 8E8D {up('controllers-8e8d')}.",
    ]
    return [f"Each claim \"a > b\" is judged over the {len(seeds)} seed(s) by one rule: {RULE}. These claims "
            "compare matrix cells (cross-domain evaluations, which keep no per-item records), so each is judged "
            "over the seeds.\n",
            changed_note(lines), *lines]


def changed_note(lines: list[str]) -> str:
    """The short note on which verdicts the significance rule changed (old → new), from the marks."""
    changed = sum(line.count(CHANGED) for line in lines)
    return (f"**Verdicts under the significance rule:** {changed} verdict(s) differ from the spread rule's "
            f"(marked `[{CHANGED}: …]` below: old → the verdict before it).\n" if changed else
            "**Verdicts under the significance rule:** none differs from the spread rule's.\n")


def run_chains(out: Path, scale: str, only: str, seeds: list[int], jobs: int) -> None:
    """Each seed's chain in its own process, `jobs` at a time; a failed chain is reported, not fatal."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": str(threads)}

    def chain(seed: int) -> int:
        command = [sys.executable, __file__, "--out", str(out), "--scale", scale, "--seeds", str(seed),
                   "--chain-threads", str(threads)] + (["--only", only] if only else [])
        return subprocess.run(command, env=env).returncode

    with ThreadPoolExecutor(jobs) as pool:
        for seed, code in zip(seeds, pool.map(chain, seeds)):
            if code:
                print(f"[nmt study] the chain of seed {seed} failed (exit {code}); its runs are missing", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/nmt"))
    parser.add_argument("--doc", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    parser.add_argument("--only", default="", help="comma-separated experiments to run (others: as recorded)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each experiment runs once per seed")
    parser.add_argument("--jobs", type=int, default=1, help="seeds' chains run at once (processes)")
    parser.add_argument("--chain-threads", type=int, default=None, help=argparse.SUPPRESS)  # one chain of --jobs
    args = parser.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    only = set(filter(None, args.only.split(","))) or None
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.chain_threads is not None:  # one seed's chain, started by run_chains: the seed-S layout
        run_all(args.out, args.scale, only, seeds, multi=True, threads=args.chain_threads)
        return
    t0 = time.perf_counter()
    if args.jobs > 1 and len(seeds) > 1:
        run_chains(args.out, args.scale, args.only, seeds, args.jobs)  # then run_all below reads them back
    results = run_all(args.out, args.scale, only, seeds)
    print(f"[nmt study] all runs in {time.perf_counter() - t0:.0f}s", flush=True)
    if ran_all(results, "fedavg", seeds):
        fl = [m for m in FL if ran_all(results, m, seeds)]
        print("[nmt study] parameters per round as a share of FedAvg's (same round, same seed):")
        print(markdown_table(exchange_rows(args.out, fl, seeds)), flush=True)
    if args.doc and all(ran_all(results, name, seeds) for name in ORDER if name not in OPTIONAL):
        command = (f"python bench/nmt_study.py --out {args.out} --doc {args.doc} --scale {args.scale} "
                   f"--seeds {','.join(map(str, seeds))}")
        write_doc(args.out, results, args.doc, args.scale, command, seeds)


if __name__ == "__main__":
    main()
