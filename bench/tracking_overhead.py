"""What tracking costs a run: the same config with `[tracking] backend = "off"` and with "both" (MLflow's
local SQLite store and TensorBoard's event files), side by side in one process, interleaved (off both,
both off, off both …) so that the machine's noise and any drift over the runs hit both sides alike.

Two measures, both printed:
- per round: the seconds the tracked run spends in tracking after each round (timed around
  RunTracking.rounds: its MLflow log_batch and TensorBoard writes), over that round's own seconds
  (training + dev evaluation, from rounds.jsonl); the issue's goal is at most 2 %;
- per run: the wall time of the tracked run over the untracked one (ratio of medians; noisier), and
  the one-off costs: opening the trackers (the first run creates the SQLite store) and the end
  (results, report.md, plots as artifacts).

    python bench/tracking_overhead.py [--config experiments/lorar/small.toml] [--rounds 2] [--max-train 32]
        [--repeats 4] [--first off|both] [--json bench/results/tracking_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsilo.config import load_config  # noqa: E402
from fedsilo.runs import tracked  # noqa: E402
from fedsilo.runs.runner import run_experiment  # noqa: E402

SPENT: dict[str, list[float]] = {"start": [], "rounds": [], "finish": []}


INSIDE: list[str] = []  # the timed call in progress: a round's logging inside start or finish is theirs


def timed(name: str, method):
    def wrapper(*args, **kwargs):
        if INSIDE:
            return method(*args, **kwargs)
        INSIDE.append(name)
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            SPENT[name].append(time.perf_counter() - t0)
            INSIDE.pop()
    return wrapper


def instrument() -> None:
    """Time the three places a run calls its trackers: opening (with its catch-up), each round (the
    runner's call after the round's checkpoint), the end (results, report.md, plots)."""
    cls = tracked.RunTracking
    cls.start, cls.rounds, cls.finish = timed("start", cls.start), timed("rounds", cls.rounds), timed("finish", cls.finish)


def one_run(config: str, overrides: list[str], backend: str, out: Path) -> dict:
    for key in SPENT:
        SPENT[key].clear()
    cfg = load_config(config, [*overrides, f"tracking.backend={backend}"])
    t0 = time.perf_counter()
    run_experiment(cfg, out, show_progress=False)
    wall = time.perf_counter() - t0
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    per_round = [r["seconds"] + (r.get("eval_seconds") or 0.0) for r in rounds]
    return {"backend": backend, "wall": wall, "round_seconds": per_round,
            "tracking_per_round": list(SPENT["rounds"]), "open": SPENT["start"][0] if SPENT["start"] else 0.0,
            "finish": sum(SPENT["finish"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "experiments/lorar/small.toml"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-train", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--first", choices=["off", "both"], default="off",
                    help="which side runs first in the first pair; the pairs then alternate (off both, both off, …), "
                         "so a drift of the machine or the process over the runs hits both sides alike")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    overrides = [f"federation.rounds={args.rounds}", f"task.max_train={args.max_train}"]
    instrument()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedsilo-tracking-bench-") as tmp:
        for i in range(args.repeats):
            pair = ("off", "both") if args.first == "off" else ("both", "off")
            for backend in (pair if i % 2 == 0 else pair[::-1]):
                out = Path(tmp) / f"{backend}-{i}"
                runs.append(one_run(args.config, overrides, backend, out))
                r = runs[-1]
                print(f"{backend:4s} #{i}: wall {r['wall']:.1f} s, rounds {', '.join(f'{s:.1f}' for s in r['round_seconds'])} s"
                      + (f", tracking per round {', '.join(f'{1000 * s:.0f}' for s in r['tracking_per_round'])} ms, "
                         f"open {r['open']:.2f} s, end {r['finish']:.2f} s" if backend != "off" else ""), flush=True)
    both = [r for r in runs if r["backend"] == "both"]
    off = [r for r in runs if r["backend"] == "off"]
    assert all(len(r["tracking_per_round"]) == len(r["round_seconds"]) for r in both), "one tracking call per round"
    shares = [t / s for r in both for t, s in zip(r["tracking_per_round"], r["round_seconds"])]
    # side by side: each tracked round (its own seconds + its tracking) over the same round of the paired untracked run
    ratios = [(sb + t) / so for rb, ro in zip(both, off)
              for sb, t, so in zip(rb["round_seconds"], rb["tracking_per_round"], ro["round_seconds"])]
    summary = {
        "per_round_share_median": statistics.median(shares), "per_round_share_max": max(shares),
        "round_ratio_both_over_off_median": statistics.median(ratios), "round_ratios": ratios,
        "tracking_per_round_ms_median": 1000 * statistics.median(t for r in both for t in r["tracking_per_round"]),
        "round_seconds_median": statistics.median(s for r in both for s in r["round_seconds"]),
        "wall_ratio_both_over_off": statistics.median(r["wall"] for r in both) / statistics.median(r["wall"] for r in off),
        "open_seconds": [r["open"] for r in both], "finish_seconds": [r["finish"] for r in both]}
    print(f"\nper round: tracking {summary['tracking_per_round_ms_median']:.0f} ms (median) over rounds of "
          f"{summary['round_seconds_median']:.1f} s: {100 * summary['per_round_share_median']:.2f} % median, "
          f"{100 * summary['per_round_share_max']:.2f} % max (goal: at most 2 %)")
    print(f"side by side: a tracked round (with its tracking) / the same round untracked = "
          f"{summary['round_ratio_both_over_off_median']:.3f} median over {len(ratios)} pairs of rounds "
          f"({', '.join(f'{x:.3f}' for x in ratios)}: the machine's noise)")
    print(f"per run: wall both / off = {summary['wall_ratio_both_over_off']:.3f} (median of {args.repeats} each); "
          f"opening {', '.join(f'{s:.2f}' for s in summary['open_seconds'])} s (the first creates the store), "
          f"end {', '.join(f'{s:.2f}' for s in summary['finish_seconds'])} s")
    if args.json:
        record = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()}, {platform.python_version()}", "runs": runs, "summary": summary}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
