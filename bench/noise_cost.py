"""What secret noise costs (issue 40): N(0, 1) for 22.7 M float64 coordinates (the main job's model,
the size one silo-level DP release noises) from torch's Mersenne Twister (`torch.normal`, what
seeded noise and, before, secret noise used) and from fedsilo.privacy.noise's AES-256-CTR keystream
with Box–Muller (`SecretNormal`, what secret noise uses now); and, for DP-SGD's float32 gradients,
Opacus's secure_mode (four torch draws summed, what a secret DP-SGD step drew before) against one
secret draw rounded to float32. One line per method: the best and the median of --repeats timed
draws (the methods take turns), and the draws per second of the best.

    python bench/noise_cost.py [--n 22700000] [--repeats 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fedsilo.privacy.noise import SecretNormal


def interleaved(methods: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per draw of each method, the methods taking turns in every repeat (after one warm-up
    each), so that a shared machine's busy spells fall on all of them alike."""
    for draw in methods.values():
        draw()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, draw in methods.items():
            start = time.perf_counter()
            draw()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=22_700_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    secret = SecretNormal()
    from opacus.optimizers.optimizer import _generate_noise
    float32 = torch.zeros(args.n)
    methods = {
        "torch.normal float64 (Mersenne Twister)": lambda: torch.normal(0.0, 1.0, (args.n,), generator=g,
                                                                        dtype=torch.float64),
        "SecretNormal float64 (AES-256-CTR + Box-Muller)": lambda: secret.normal(1.0, (args.n,)),
        # DP-SGD's step before and after, float32 gradients: Opacus's secure_mode sums 4 torch draws
        "Opacus secure_mode float32 (4 torch draws)": lambda: _generate_noise(1.0, float32, g, secure_mode=True),
        "SecretNormal to float32 (DP-SGD's step now)": lambda: secret.normal(1.0, (args.n,)).float(),
    }
    print(f"{args.n:,} float64 N(0, 1) draws, {args.repeats} repeats, torch threads {args.threads}, "
          f"{platform.processor() or platform.machine()}")
    for name, times in interleaved(methods, args.repeats).items():
        best = min(times)
        print(f"{name:48s} best {best:.3f} s  median {statistics.median(times):.3f} s  "
              f"{args.n / best / 1e6:.1f} M draws/s")


if __name__ == "__main__":
    main()
