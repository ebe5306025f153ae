"""Time, memory and bytes of a study's variants side by side in one run: each variant of a study file's
[base] (changed by --set assignments) runs in its own process (its peak memory is its own), one silo
after another (engine.workers = 1), and the variants are interleaved over --repeat passes so that a busy
machine slows them alike. Training time is the rounds' own seconds (rounds.jsonl), without evaluations.
bench/privacy_cost.py and bench/adapters_cost.py are this over their own variants."""
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


def base_config(study: Path, tmp: Path, rounds: int) -> Path:
    """The study's [base] as a run config file."""
    import tomllib

    from fedsilo.config import to_toml, validate

    base = tomllib.loads(study.read_text())["base"]
    base["federation"]["rounds"] = rounds
    base["federation"]["eval_every"] = rounds
    base["engine"] = {"workers": 1}
    path = tmp / "base.toml"
    path.write_text(to_toml(validate(base)))
    return path


def study_variants(study: Path) -> dict[str, list[str]]:
    """A study file's [variants.NAME] tables as --set assignments (a table's own keys, values as TOML)."""
    import tomllib

    from fedsilo.settings import toml_value as _fmt

    out = {}
    for name, changes in tomllib.loads(study.read_text()).get("variants", {}).items():
        out[name] = [f"{section}.{key}={_fmt(value)}" for section, table in changes.items() if isinstance(table, dict)
                     for key, value in table.items()] + \
                    [f"{key}={_fmt(value)}" for key, value in changes.items() if not isinstance(value, dict)]
    return out


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
            "peak_pss_gib": pss / 2**30, "bytes_up": sum(r["bytes_up"] for r in rounds),
            "bytes_down": sum(r["bytes_down"] for r in rounds)}


def compare(study: Path, variants: dict[str, list[str]], doc: str, baseline: str) -> None:
    """Parse the command line, measure `variants` (name → --set assignments), print the table (times as
    multiples of `baseline`'s), optionally write JSON."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", help="comma-separated variants")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    names = [v for v in variants if not args.only or v in args.only.split(",")]
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as tmp:
        config = base_config(study, Path(tmp), args.rounds)
        for rep in range(args.repeat):
            for v in names:
                runs[v].append(measure(config, variants[v], Path(tmp) / f"{v}-{rep}"))
                print(f"pass {rep + 1}/{args.repeat} {v}: {runs[v][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(r["train_s"] for r in runs[baseline]) if baseline in runs else None
    rows = []
    for v, rs in runs.items():
        train = statistics.median(r["train_s"] for r in rs)
        rows.append({"variant": v, "train_s": train, "train_s_runs": [r["train_s"] for r in rs],
                     "vs_baseline": train / base if base else None,
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in rs), "peak_pss_gib": max(r["peak_pss_gib"] for r in rs),
                     "bytes_up": rs[0]["bytes_up"], "bytes_down": rs[0]["bytes_down"]})
    print(f"| variant | training s ({args.rounds} round(s), median of {args.repeat}) | × {baseline} | peak RSS GiB | "
          "peak PSS GiB | bytes up | bytes down |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{r['vs_baseline']:.2f}" if r["vs_baseline"] else "–"
        print(f"| {r['variant']} | {r['train_s']:.1f} | {ratio} | {r['peak_rss_gib']:.2f} | "
              f"{r['peak_pss_gib']:.2f} | {r['bytes_up']:,} | {r['bytes_down']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
            "baseline": baseline, "rows": rows}, indent=1))
