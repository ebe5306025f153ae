"""Peak memory of an 8-silo federation vs training one silo alone (target <= 1.3x).

Each variant runs in a fresh process (`fedsilo run` through run_experiment) and reports its peak
resident set size; a model large enough to dominate memory (default ~45M parameters) makes a
per-client model copy impossible to miss. The same model, rounds and per-silo data cap on both sides.

`--personal`: every client keeps a whole personal model between rounds (it trains from its own model
and only regularises toward the global one, as FewFedWeight/Ditto clients do). With the disk client
store RAM must still hold one model; the memory store is measured beside it for contrast.

`--fewfedweight`: the multitask task with FewFedWeight (pseudo labels from the global model, energy
token weights, a personal model per client in the disk store, loss-proportional aggregation) on the
default `minilm2bert` model, 8 clients with one real CrossFit task each vs one client alone.

    python bench/memory.py [--d-model 512] [--layers 4] [--personal | --fewfedweight]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

SILOS = ["advising", "atis", "geography", "restaurants", "scholar", "academic", "imdb", "yelp"]
MT_TASKS = ["glue-sst2", "superglue-cb", "tweet_eval-hate", "medical_questions_pairs", "codah", "numer_sense",
            "aeslc", "crows_pairs"]
MT_CLIENTS = [f"client_{i + 1}" for i in range(len(MT_TASKS))]


def fewfedweight_child(silos: list[str]) -> None:
    """FewFedWeight on 8 one-task clients (or a subset of them), 2 rounds, in this process."""
    from fedsilo.config import validate
    from fedsilo.runs.runner import run_experiment

    cfg = validate({
        "task": {"name": "multitask", "tasks": MT_TASKS, "clients": len(MT_TASKS), "silos": silos,
                 "k_per_class": 8, "k_total": 16, "max_source_length": 96, "max_target_length": 24},
        "model": {"kind": "seq2seq", "name": "minilm2bert", "num_decoder_layers": 2, "d_ff": 768},
        "client": {"optimizer": "adamw", "lr": 1e-4, "batch_size": 8, "epochs": 1,
                   "before_training": "pseudo_labels", "regularizers": {"personal": 0.01},
                   "tracked_terms": ["annotated", "pseudo"]},
        "exchange": {"overwrite": "none"}, "engine": {"store": "disk"},
        "federation": {"rounds": 2, "weighting": "loss"},
    })
    with tempfile.TemporaryDirectory() as out:
        run_experiment(cfg, out, show_progress=False)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


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
    if args.fewfedweight:
        cmd = [sys.executable, __file__, "--child", ",".join(silos), "--fewfedweight"]
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
    ap.add_argument("--fewfedweight", action="store_true",
                    help="multitask FewFedWeight, 8 one-task clients with personal models (disk store) vs one")
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child and args.fewfedweight:
        fewfedweight_child(args.child.split(","))
        return
    if args.fewfedweight:
        one, eight = measure(MT_CLIENTS[:1], args), measure(MT_CLIENTS, args)
        print(f"FewFedWeight, minilm2bert, disk store: peak RSS one client {one:.0f} MiB, eight clients "
              f"{eight:.0f} MiB, ratio {eight / one:.3f} (target <= 1.3)")
        return
    if args.child:
        child(args.child.split(","), args.d_model, args.layers, args.weighting, args.server, args.store)
        return
    from fedsilo.config import validate
    from fedsilo.recipe import build_model
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
