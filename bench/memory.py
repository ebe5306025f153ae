"""Peak memory of an 8-silo federation vs training one silo alone (target <= 1.3x).

Each variant runs in a fresh process (`fedsilo run` through run_experiment) and reports its peak
resident set size; a model large enough to dominate memory (default ~45M parameters) makes a
per-client model copy impossible to miss. The same model, rounds and per-silo data cap on both sides.

`--personal`: every client keeps a whole personal model between rounds (it trains from its own model
and only regularises toward the global one, as FewFedWeight/Ditto clients do). With the disk client
store RAM must still hold one model; the memory store is measured beside it for contrast.

    python bench/memory.py [--d-model 512] [--layers 4] [--personal]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

SILOS = ["advising", "atis", "geography", "restaurants", "scholar", "academic", "imdb", "yelp"]


def child(silos: list[str], d_model: int, layers: int, weighting: str, server: str, personal: str) -> None:
    from fedsilo.config import validate
    from fedsilo.runs.runner import run_experiment

    cfg = validate({
        "task": {"silos": silos, "max_train": 16, "max_eval": 4, "max_source_length": 64, "max_target_length": 32},
        "model": {"d_model": d_model, "d_ff": 4 * d_model, "num_layers": layers, "num_decoder_layers": layers,
                  "num_heads": 8},
        "client": {"batch_size": 8, "epochs": 1}, "federation": {"rounds": 2, "weighting": weighting},
        "server": {"optimizer": server},
        **({"exchange": {"overwrite": "none"}, "engine": {"store": personal},
            "client": {"batch_size": 8, "epochs": 1, "regularizers": {"personal": 0.1}}} if personal else {}),
    })
    with tempfile.TemporaryDirectory() as out:
        run_experiment(cfg, out, show_progress=False)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(silos: list[str], args, store: str = "") -> float:
    cmd = [sys.executable, __file__, "--child", ",".join(silos), "--d-model", str(args.d_model),
           "--layers", str(args.layers), "--weighting", args.weighting, "--server", args.server,
           "--store", store]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--weighting", default="lorar")
    ap.add_argument("--server", default="adam", help="adam keeps two moment tensors: the worst case")
    ap.add_argument("--personal", action="store_true", help="clients keep personal models (disk vs memory store)")
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child.split(","), args.d_model, args.layers, args.weighting, args.server, args.store)
        return
    from fedsilo.config import validate
    from fedsilo.runs.build import build_model
    cfg = validate({"model": {"d_model": args.d_model, "d_ff": 4 * args.d_model, "num_layers": args.layers,
                              "num_decoder_layers": args.layers, "num_heads": 8}})
    n = sum(p.numel() for p in build_model(cfg)[0].parameters())
    print(f"model: tiny-t5 d_model={args.d_model} layers={args.layers}+{args.layers}: {n / 1e6:.1f}M params "
          f"= {n * 4 / 2**20:.0f} MiB fp32; weighting {args.weighting}, server {args.server}"
          + ("; personal models" if args.personal else ""))
    stores = ["disk", "memory"] if args.personal else [""]
    one = measure(["geography"], args, stores[0])
    for store in stores:
        eight = measure(SILOS, args, store)
        label = f" ({store} store)" if store else ""
        print(f"peak RSS: one silo {one:.0f} MiB, eight silos{label} {eight:.0f} MiB")
        print(f"ratio eight/one{label} = {eight / one:.3f} (target <= 1.3); "
              f"one extra model copy per client would add ~{7 * n * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
