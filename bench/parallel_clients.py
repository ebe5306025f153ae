"""Per-round wall time of the 8-silo text-to-SQL demo: clients one after another (engine.workers = 1)
vs a round's clients in parallel worker processes (engine.workers = 2), vs Flower's simulation on
the same workload — each engine in a fresh child process, one after another, on this machine.
A fifth variant runs workers = 1 as the engine was before issue 11 (batches shuffled and
re-tokenised every epoch) to show what tokenise-once and length grouping alone give.

The workload is experiments/lorar/small.toml (8 silos × 64 examples, tiny-t5, FedOPT + Lorar) with
`--rounds` rounds and one evaluation at the end. Round time is rounds.jsonl's `seconds` (send,
train, receive, aggregate), averaged over rounds 2.. (round 1 also starts the worker pool or Ray).
Memory is the peak of the whole process tree, as RSS (a page shared by forked workers counts once
per process) and as PSS (shared pages split between the processes: what the tree really holds).

    python bench/parallel_clients.py [--rounds 3] [--json out.json]
    python bench/parallel_clients.py --rounds 1 --max-train 4 --max-eval 2   # a quick check that it runs
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from flower_engines import run_with_peak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "lorar" / "small.toml"
BEFORE_ISSUE_11 = ["client.batching=shuffle", "engine.token_cache=false"]
# name → (engine, workers, torch threads per process, further overrides)
VARIANTS = {
    "in-process, workers=1, before issue 11": ("local", 1, None, BEFORE_ISSUE_11),
    "in-process, workers=1": ("local", 1, None, []),
    "in-process, workers=1, 1 thread": ("local", 1, 1, []),
    "in-process, workers=2": ("local", 2, None, []),
    "Flower simulation": ("flower-sim", 1, 1, []),
}


def child(engine: str, workers: int, out: Path, rounds: int, overrides: list[str]) -> None:
    from fedsilo.config import load_config
    cfg = load_config(CONFIG, [f"federation.rounds={rounds}", f"federation.eval_every={rounds}",
                               f"engine.workers={workers}", *overrides])
    if engine == "local":
        from fedsilo.runs.runner import run_experiment
        run_experiment(cfg, out, show_progress=False)
    else:
        from fedsilo.runs.flower import run_simulation
        run_simulation(cfg, out, show_progress=False)


def measure(name: str, rounds: int, size: list[str]) -> dict:
    engine, workers, threads, overrides = VARIANTS[name]
    overrides = [*overrides, *size]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        start = time.perf_counter()
        proc, err, rss, pss = run_with_peak([sys.executable, __file__, "--child", engine, "--workers",
                                             str(workers), "--out", str(out), "--rounds", str(rounds),
                                             *[f"--set={o}" for o in overrides]], env)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{err.decode()[-2000:]}")
        logged = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        later = [r["seconds"] for r in logged[1:]] or [logged[0]["seconds"]]
        return {"round": sum(later) / len(later), "first_round": logged[0]["seconds"],
                "wall": time.perf_counter() - start, "rss_mib": rss / 2**20, "pss_mib": pss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("local", "flower-sim"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--max-train", type=int, help="examples per silo (default: the config's 64)")
    ap.add_argument("--max-eval", type=int, help="dev/test examples per silo (default: the config's 16)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.workers, args.out, args.rounds, args.set)
        return
    size = [f"task.{key}={value}" for key, value in (("max_train", args.max_train), ("max_eval", args.max_eval))
            if value is not None]
    print(f"$ python {' '.join(sys.argv)}")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores; "
          f"{CONFIG.relative_to(ROOT)}, {args.rounds} rounds" + "".join(f", {s}" for s in size))
    res = {}
    for name in VARIANTS:
        print(f"running {name} …", file=sys.stderr, flush=True)
        res[name] = measure(name, args.rounds, size)
    base = res["in-process, workers=1"]["round"]
    print("\n| engine | round s (rounds 2..) | first round s | wall s | peak RSS MiB | peak PSS MiB | "
          "workers=1 round / this round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in res.items():
        print(f"| {name} | {r['round']:.2f} | {r['first_round']:.2f} | {r['wall']:.1f} | {r['rss_mib']:.0f} | "
              f"{r['pss_mib']:.0f} | {base / r['round']:.2f}× |")
    before = res["in-process, workers=1, before issue 11"]["round"]
    print(f"\ntokenise once + length grouping (workers=1): {before / base:.2f}× faster per round")
    w2, sim = res["in-process, workers=2"]["round"], res["Flower simulation"]["round"]
    print(f"\nworkers=2 vs workers=1: {base / w2:.2f}× faster per round (target ≥ 1.6×)")
    print(f"workers=2 vs Flower simulation: {sim / w2:.2f}× faster per round (target ≥ 2×)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
