"""Batching cost on the real training sets: padding per batch order, and tokenising once vs per batch.

(a) Padding share: padded positions / all positions of one epoch's batches, per field (source
`input_ids` padded to the batch's longest source, `labels` to its longest label) and combined, for
the `shuffle` and `length_grouped` orders of `fedsilo.client.batching` (grouped by
`tokens.row_length`, window `default_window`, as the trainer does), pooled over `--seeds` epochs.
(b) Tokenisation per epoch: the old way (`task.collate` on each batch of raw examples, which
tokenises every batch) vs the new (rows from `tokens.tokenized`, loaded from the on-disk cache, then
`task.pad` per batch), both over the same batches (seed 0's length-grouped order); plus the first
run's encode+write and the cache load. The token cache is a temporary folder. Each time is the best
of `--repeats` runs (the machine may be shared).

Workloads: text-to-SQL, the 8 silos of experiments/lorar/small.toml with full training sets
(max_train = 0); translation, the domains of experiments/nmt/fedavg.toml (its settings: all pairs).

    OMP_NUM_THREADS=1 python bench/batching.py [--seeds 5] [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedsilo.client.batching import BATCH_ORDERS, default_window, padding_share
from fedsilo.config import load_config
from fedsilo.datafetch import DataError, default_data_root, ensure
from fedsilo.recipe import build_model, build_task, task_tokenizer
from fedsilo.tasks.tokens import row_length, tokenized

ORDERS = ("shuffle", "length_grouped")
FIELDS = ("input_ids", "labels")
WORKLOADS = (("text2sql", "experiments/lorar/small.toml", ["task.max_train=0"]),
             ("translation", "experiments/nmt/fedavg.toml", []))


def field_counts(rows, order, batch_size: int) -> dict[str, tuple[int, float]]:
    """(real, padded) positions per field over the batches of `order`, each field padded on its own
    (padded = real / (1 - that field's padding share))."""
    out = {}
    for f in FIELDS:
        lengths = [int(r[f].shape[0]) for r in rows]
        out[f] = (sum(lengths), sum(lengths) / (1.0 - padding_share(lengths, order, batch_size)))
    return out


def shares(counts: dict[str, list[float]]) -> dict[str, float]:
    """Padding % per field and combined, from summed [real, padded] counts."""
    out = {f: 100.0 * (1 - r / p) for f, (r, p) in counts.items()}
    out["combined"] = 100.0 * (1 - sum(r for r, _ in counts.values()) / sum(p for _, p in counts.values()))
    return out


def best(fn, repeats: int, setup=lambda: None):
    """(fn's last result, its shortest time over `repeats` runs, each after an untimed `setup`)."""
    times = []
    for _ in range(repeats):
        setup()
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return result, min(times)


def measure_silo(task, silo: str, batch_size: int, seeds: int, repeats: int, cache_dir: Path) -> dict:
    examples = task.examples(silo, "train")
    cache = cache_dir / task.name / silo
    rows, encode_s = best(lambda: tokenized(task, examples, cache), repeats,  # empty cache: encode + write
                          setup=lambda: shutil.rmtree(cache, ignore_errors=True))
    rows, load_s = best(lambda: tokenized(task, examples, cache), repeats)    # written above: load only
    lengths = [row_length(r) for r in rows]
    window = default_window(len(rows), batch_size)
    padding = {}
    for name in ORDERS:
        counts = {f: [0, 0.0] for f in FIELDS}
        for seed in range(seeds):
            order = BATCH_ORDERS.get(name)(lengths, batch_size, torch.Generator().manual_seed(seed), window)
            for f, (real, padded) in field_counts(rows, order, batch_size).items():
                counts[f][0] += real
                counts[f][1] += padded
        padding[name] = counts
    order = BATCH_ORDERS.get("length_grouped")(lengths, batch_size, torch.Generator().manual_seed(0), window)
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    _, old_s = best(lambda: [task.collate([examples[i] for i in b]) for b in batches], repeats)
    _, new_s = best(lambda: [task.pad([rows[i] for i in b]) for b in batches], repeats)
    return {"silo": silo, "n": len(rows), "batch_size": batch_size, "batches": len(batches), "padding": padding,
            "encode_write_s": encode_s, "load_s": load_s, "old_epoch_s": old_s, "new_epoch_s": new_s}


def total_row(rows: list[dict]) -> dict:
    padding = {name: {f: [sum(r["padding"][name][f][i] for r in rows) for i in (0, 1)] for f in FIELDS}
               for name in ORDERS}
    summed = {k: sum(r[k] for r in rows) for k in ("n", "batches", "encode_write_s", "load_s", "old_epoch_s",
                                                    "new_epoch_s")}
    return {"silo": "**total**", "batch_size": "", "padding": padding, **summed}


def workload(task_name: str, config: str, overrides: list[str], seeds: int, repeats: int,
             cache_dir: Path) -> list[dict] | None:
    try:
        ensure(task_name, default_data_root() / task_name, progress=False)
    except DataError as err:
        print(f"\n_{task_name}: skipped, data not available offline ({err})_")
        return None
    cfg = load_config(config, overrides)
    tokenizer = build_model(cfg)[1] if task_name == "text2sql" else task_tokenizer(cfg)()
    task = build_task(cfg, tokenizer)
    rows = []
    for silo in task.clients:
        rows.append(measure_silo(task, silo, cfg.client_config(silo).batch_size, seeds, repeats,
                                 cache_dir))
        print(f"  {task_name}/{silo}: {rows[-1]['n']} examples measured", file=sys.stderr, flush=True)
    s = cfg.task
    print(f"\n### {task_name} ({config}, overrides {overrides or 'none'}; max_source_length {s.max_source_length}, "
          f"max_target_length {s.max_target_length}, max_train {s.max_train} = all)\n")
    table(rows + [total_row(rows)])
    return rows


def table(rows: list[dict]) -> None:
    print("Padding share, % of positions (pooled over the seeds' epochs): shuffle → length_grouped\n")
    print("| silo | train n | batch | input_ids | labels | combined |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        a, b = shares(r["padding"]["shuffle"]), shares(r["padding"]["length_grouped"])
        cells = " | ".join(f"{a[k]:.1f} → {b[k]:.1f}" for k in (*FIELDS, "combined"))
        print(f"| {r['silo']} | {r['n']} | {r['batch_size']} | {cells} |")
    print("\nTokenisation, seconds (best of the repeats): first run (encode + write cache), cache load, "
          "one epoch of batches old (collate: tokenise + pad) vs new (pad cached rows)\n")
    print("| silo | batches | encode+write | cache load | old epoch | new epoch | old/new |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['silo']} | {r['batches']} | {r['encode_write_s']:.3f} | {r['load_s']:.3f} | "
              f"{r['old_epoch_s']:.3f} | {r['new_epoch_s']:.3f} | {r['old_epoch_s'] / r['new_epoch_s']:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="epochs (seeded orders) the padding share pools")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (the best is kept)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    print("command: " + " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
                                 if k in os.environ) + " python " + " ".join(sys.argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
          f"date {datetime.datetime.now().isoformat(timespec='seconds')}; seeds {args.seeds}, "
          f"repeats {args.repeats} (best kept)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedsilo-bench-tokens-") as cache_dir:
        for task_name, config, overrides in WORKLOADS:
            rows = workload(task_name, config, overrides, args.seeds, args.repeats, Path(cache_dir))
            if rows is not None:
                results[task_name] = rows
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "cores": os.cpu_count(), "seeds": args.seeds,
                                         "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
