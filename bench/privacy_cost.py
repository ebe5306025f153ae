"""What privacy costs in time and memory, side by side in one run: the README's main job (answer selection
on 5 QA silos, FedAvg, MiniLM-L6) trained plainly, with DP-SGD (ghost and per-example clipping), with
secure aggregation, and with both. Each variant runs in its own process (its peak memory is its own), one
silo after another (engine.workers = 1), and the variants are interleaved over --repeat passes so that a
busy machine slows them alike. Training time is the rounds' own seconds (rounds.jsonl), without the
evaluations.

    python bench/privacy_cost.py [--rounds 1] [--repeat 2] [--json bench/results/privacy-cost.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from flower_engines import run_with_peak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "privacy" / "qa_dp.toml"
VARIANTS = {
    "plain": [],
    "dp-ghost": ["client.dp.target_epsilon=8", "client.dp.clipping=\"ghost\""],
    "dp-per-example": ["client.dp.target_epsilon=8", "client.dp.clipping=\"per_example\""],
    "secure-aggregation": ["federation.secure_aggregation={}"],
    "dp-ghost + secure": ["client.dp.target_epsilon=8", "client.dp.clipping=\"ghost\"",
                          "federation.secure_aggregation={}"],
}


def base_config(tmp: Path, rounds: int) -> Path:
    """The study's [base] as a run config file."""
    import tomllib

    from fedsilo.config import to_toml, validate

    base = tomllib.loads(STUDY.read_text())["base"]
    base["federation"]["rounds"] = rounds
    base["federation"]["eval_every"] = rounds
    base["engine"] = {"workers": 1}
    path = tmp / "qa.toml"
    path.write_text(to_toml(validate(base)))
    return path


def measure(config: Path, sets: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "fedsilo", "run", str(config), "--out", str(out), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    proc, err, rss, pss = run_with_peak(cmd, {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode()[-2000:]}")
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    return {"train_s": sum(r["seconds"] for r in rounds), "wall_s": wall, "peak_rss_gib": rss / 2**30,
            "peak_pss_gib": pss / 2**30, "bytes_up": sum(r["bytes_up"] for r in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", help="comma-separated variants")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    names = [v for v in VARIANTS if not args.only or v in args.only.split(",")]
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as tmp:
        config = base_config(Path(tmp), args.rounds)
        for rep in range(args.repeat):
            for v in names:
                runs[v].append(measure(config, VARIANTS[v], Path(tmp) / f"{v}-{rep}"))
                print(f"pass {rep + 1}/{args.repeat} {v}: {runs[v][-1]}", file=sys.stderr, flush=True)
    plain = statistics.median(r["train_s"] for r in runs["plain"]) if "plain" in runs else None
    rows = []
    for v, rs in runs.items():
        train = statistics.median(r["train_s"] for r in rs)
        rows.append({"variant": v, "train_s": train, "train_s_runs": [r["train_s"] for r in rs],
                     "vs_plain": train / plain if plain else None,
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in rs), "peak_pss_gib": max(r["peak_pss_gib"] for r in rs),
                     "bytes_up": rs[0]["bytes_up"]})
    print(f"| variant | training s ({args.rounds} round(s), median of {args.repeat}) | × plain | peak RSS GiB | "
          "peak PSS GiB | bytes up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['train_s']:.1f} | {r['vs_plain']:.2f} | {r['peak_rss_gib']:.2f} | "
              f"{r['peak_pss_gib']:.2f} | {r['bytes_up'] / 1e6:,.0f} MB |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
