"""Two source trees of fedsilo side by side on one command: wall time and the process tree's peak
memory (PSS and RSS, forked workers included), alternating A, B, A, B ... so the machine's noise
falls on both; prints each run and the ratios of the medians (B / A).

    git worktree add /tmp/before HEAD~1      # or any checkout of the code before a change
    python bench/ab_trees.py /tmp/before . -- study experiments/qa/small.toml --only fedavg --seeds 0

Options go before the two trees (`--repeats 3 /tmp/before . -- ...`): everything after the trees
is the fedsilo command. The fedsilo arguments follow `--`; each run gets a fresh `--out` directory. Both trees use this
Python environment (its installed packages) with PYTHONPATH set to the tree, and the same token
cache, so they differ only in fedsilo's code.

`--keep DIR` keeps each run's `--out` (DIR/A1, DIR/B1, ...) and then compares A's and B's outputs of each
repeat as bench/identical.py does (results.json, rounds.jsonl, study.json and every .md, wall-clock fields
and dates left out), so one run measures a change's cost and shows its behaviour unchanged.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from flower_engines import run_with_peak  # noqa: E402


def measure(tree: Path, args: list[str], keep: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = keep if keep is not None else Path(tmp) / "out"
        env = {**os.environ, "PYTHONPATH": str(tree), "FLWR_TELEMETRY_ENABLED": "0"}
        start = time.perf_counter()
        proc, err, rss, pss = run_with_peak([sys.executable, "-m", "fedsilo", *args, "--out", str(out),
                                             "--no-progress"], env)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{tree}: exit {proc.returncode}\n{err.decode()[-2000:]}")
    return {"wall": wall, "pss": pss / 2**30, "rss": rss / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="the tree before (A)")
    ap.add_argument("b", type=Path, help="the tree after (B)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="keep every run's output here and compare A's with B's")
    ap.add_argument("fedsilo_args", nargs=argparse.REMAINDER, help="-- then the fedsilo command")
    args = ap.parse_args()
    command = [a for a in args.fedsilo_args if a != "--"] if args.fedsilo_args[:1] == ["--"] else args.fedsilo_args
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.repeats):
        for label, tree in (("A", args.a), ("B", args.b)):
            m = measure(tree.resolve(), command, args.keep / f"{label}{i + 1}" if args.keep else None)
            runs[label].append(m)
            print(f"{label} #{i + 1}: wall {m['wall']:.1f} s, tree peak PSS {m['pss']:.2f} GiB, RSS {m['rss']:.2f} GiB",
                  flush=True)
    for key, unit in (("wall", "s"), ("pss", "GiB"), ("rss", "GiB")):
        a, b = (statistics.median(r[key] for r in runs[x]) for x in "AB")
        print(f"{key}: A {a:.2f} {unit}, B {b:.2f} {unit}, B/A {b / a:.3f}")
    if args.keep:
        compare_kept(args.keep, args.repeats)


def compare_kept(keep: Path, repeats: int) -> None:
    """A's and B's outputs of each repeat, as bench/identical.py compares a run item."""
    from identical import Item, compare_item

    today = sorted({time.strftime("%Y-%m-%d"), time.strftime("%Y-%m-%d", time.gmtime())})
    for i in range(1, repeats + 1):
        fa, fb = keep / f"A{i}", keep / f"B{i}"
        for what, diff in compare_item(Item(f"repeat {i}", "run", []), fa, fb, ("", ""), [fa, fb], today):
            print(f"{'IDENTICAL' if diff is None else 'DIFFERS'}  {what}" + (f": {diff}" if diff else ""))


if __name__ == "__main__":
    main()
