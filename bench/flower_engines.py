"""Flower simulation and deployment vs the in-process engine, on the same workload.

Each engine runs the same config in a fresh child process; the parent samples the resident memory
of the child's whole process tree (Ray workers, SuperLink, SuperNodes, Flower's ServerApp/ClientApp
subprocesses) every 0.2 s. Reported per engine: wall time, mean round time (from rounds.jsonl),
time outside rounds (start-up, evaluation, teardown), peak memory of the tree — and ratios to
in-process.

    python bench/flower_engines.py [--rounds 3] [--max-train 32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENGINES = ("local", "flower-sim", "flower-deploy")


def child(engine: str, out: Path, rounds: int, max_train: int) -> None:
    from fedsilo.config import to_toml, validate
    from fedsilo.datafetch import default_data_root, ensure

    data = ensure("text2sql", default_data_root() / "text2sql", progress=False)
    cfg = validate({"name": engine, "task": {"silos": ["geography", "restaurants", "academic"], "data_dir": str(data),
                                             "max_train": max_train, "max_eval": 16, "max_source_length": 96,
                                             "max_target_length": 64},
                    "federation": {"rounds": rounds, "eval_every": rounds, "weighting": "lorar"},
                    "server": {"optimizer": "sgdm"}})
    if engine == "local":
        from fedsilo.runs.runner import run_experiment
        run_experiment(cfg, out, show_progress=False)
    elif engine == "flower-sim":
        from fedsilo.runs.flower import run_simulation
        run_simulation(cfg, out, show_progress=False)
    else:
        from fedsilo.engines.flower.deploy import LocalDeployment, silo_nodes
        work = out.parent / "deploy"
        config = out.parent / "exp.toml"
        config.write_text(to_toml(cfg))
        with LocalDeployment(work, silo_nodes(cfg.task, data)) as dep:
            dep.run(config, out)


def _kib(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def tree_memory(root: int) -> tuple[int, int]:
    """Resident and proportional (PSS) bytes of `root` and all its descendants. RSS counts a page
    shared by forked processes in each of them; PSS splits it between them, so its sum is what the
    tree really holds."""
    parents: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    members, frontier = {root}, [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in members]
        members.update(frontier)
    rss = pss = 0
    for pid in members:
        try:
            rss += _kib(Path(f"/proc/{pid}/status"), "VmRSS:")
            pss += _kib(Path(f"/proc/{pid}/smaps_rollup"), "Pss:")
        except OSError:
            continue
    return rss, pss


def run_with_peak(cmd: list[str], env: dict) -> tuple[subprocess.Popen, bytes, int, int]:
    """Run `cmd`; (the finished process, its stderr, the peak RSS and peak PSS bytes of its tree)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0, 0]

    def sample() -> None:
        while proc.poll() is None:
            peak[:] = map(max, peak, tree_memory(proc.pid))
            time.sleep(0.2)

    t = threading.Thread(target=sample)
    t.start()
    _, err = proc.communicate()
    t.join()
    return proc, err, peak[0], peak[1]


def measure(engine: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        start = time.perf_counter()
        proc, _, peak, _ = run_with_peak([sys.executable, __file__, "--child", engine, "--out", str(out), "--rounds",
                                       str(args.rounds), "--max-train", str(args.max_train)],
                                      {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed (exit {proc.returncode})")
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        in_rounds = sum(r["seconds"] for r in rounds)
        return {"wall": wall, "round": in_rounds / len(rounds), "outside": wall - in_rounds, "peak_mb": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=ENGINES)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-train", type=int, default=32)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out, args.rounds, args.max_train)
        return
    res = {e: measure(e, args) for e in ENGINES}
    base = res["local"]
    print(f"workload: 3 silos x {args.max_train} examples, {args.rounds} rounds, tiny-t5, 1 torch thread per process")
    print(f"{'engine':15s} {'wall s':>8s} {'round s':>8s} {'outside rounds s':>17s} {'peak MiB':>9s} "
          f"{'round ratio':>11s} {'wall ratio':>10s} {'memory ratio':>12s}")
    for e, r in res.items():
        print(f"{e:15s} {r['wall']:8.1f} {r['round']:8.2f} {r['outside']:17.1f} {r['peak_mb']:9.0f} "
              f"{r['round'] / base['round']:11.2f} {r['wall'] / base['wall']:10.2f} {r['peak_mb'] / base['peak_mb']:12.2f}")


if __name__ == "__main__":
    main()
