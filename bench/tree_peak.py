"""Wall time and peak memory of a command's whole process tree (forked workers, Ray, Flower
subprocesses included), as RSS and as PSS; `/usr/bin/time` reports only the largest process.

    python bench/tree_peak.py make study ARGS=--no-progress
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from flower_engines import run_with_peak  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    start = time.perf_counter()
    proc, err, rss, pss = run_with_peak(sys.argv[1:], dict(os.environ))
    sys.stderr.write(err.decode()[-3000:])
    print(f"exit {proc.returncode}; wall {time.perf_counter() - start:.1f} s; "
          f"tree peak RSS {rss / 2**30:.2f} GiB, PSS {pss / 2**30:.2f} GiB")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
