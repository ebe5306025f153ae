"""What secure aggregation costs against a plain sum: seconds and peak RSS, side by side.

Sums 3 clients' float64 vectors of MiniLM-L6's size (22.7 M coordinates) once with
`fedsilo.privacy.secagg.secure_sum` (all four stages, in memory) and once with numpy (a copy and
in-place adds), each in a fresh process, alternating (A B A B ...) so a busy machine slows both alike.
Peak RSS is the process's maximum; "above inputs" subtracts the RSS once the inputs exist.

    python bench/secagg_cost.py [--repeats 2] [--clients 3] [--length 22700000]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from fedsilo.privacy.secagg import secure_sum


def rss_gib() -> float:
    """The current resident set size (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def measure(mode: str, clients: int, length: int) -> dict:
    """One timed sum in this process (run it in a fresh one: peak RSS is per process)."""
    rng = np.random.default_rng(0)
    inputs = {f"silo{i}": rng.standard_normal(length) * 0.05 for i in range(clients)}
    ready = rss_gib()
    start = time.perf_counter()
    if mode == "secagg":
        total, _ = secure_sum(inputs)
    else:
        total = inputs["silo0"].copy()
        for name in list(inputs)[1:]:
            total += inputs[name]
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"seconds": seconds, "peak_gib": peak, "above_inputs_gib": peak - ready, "checksum": float(total[:1000].sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--length", type=int, default=22_700_000)
    ap.add_argument("--child", choices=["secagg", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.clients, args.length)))
        return
    got: dict[str, list[dict]] = {"plain": [], "secagg": []}
    for rep in range(args.repeats):
        for mode in got:
            cmd = [sys.executable, __file__, "--child", mode, "--clients", str(args.clients), "--length", str(args.length)]
            got[mode].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            print(f"repeat {rep + 1}/{args.repeats} {mode}: {got[mode][-1]['seconds']:.2f} s", flush=True)
    if abs(got["plain"][0]["checksum"] - got["secagg"][0]["checksum"]) > 1000 * args.clients * 2.0 ** -33:
        sys.exit("secure_sum and the plain sum disagree")
    print(f"\n{args.clients} clients x {args.length:,} float64 coordinates, median of {args.repeats}:")
    print(f"{'':8} {'seconds':>8} {'peak RSS GiB':>13} {'above inputs GiB':>17}")
    for mode, runs in got.items():
        print(f"{mode:8} {statistics.median(r['seconds'] for r in runs):8.2f} "
              f"{max(r['peak_gib'] for r in runs):13.2f} {max(r['above_inputs_gib'] for r in runs):17.2f}")


if __name__ == "__main__":
    main()
