"""Instruction tuning throughput: one silo's fedsilo client round (SiloClient.fit) vs a bare transformers + peft loop.

Both sides train the built-in tiny-llama (fedsilo builds its weights from the seed; the bare side gets
the very same LlamaForCausalLM weights) on the same silo's real records (default Code Alpaca), rendered
and tokenised once by the instruct task (completion-only labels), in the same batches in the same order
(fedsilo's length_grouped order for the silo's round seed, replayed), with torch.optim.AdamW and
gradient clipping at 1.0. Two pairs:
- lora: fedsilo's `lora` surgery vs peft's `get_peft_model` with the same LoraConfig (rank, alpha,
  q_proj/v_proj), its adapters loaded with fedsilo's initial ones so both start from one point;
- full: every weight trains (no LoRA).
The bare loop pads every batch up front (outside its clock) and takes the loss transformers computes
from `labels` (the same completion-only cross-entropy); fedsilo's clock covers the whole `fit` (loading
the received tensors, training, selecting and copying the upload). Trained tokens are the batches'
non-pad input tokens, counted the same way for both. Each measurement is a fresh child process
(alternating A B B A ...); the parent samples the child's process tree (peak RSS, as
bench/flower_engines.py) and the child samples its own RSS during training (peak above the RSS just
before training). Besides wall-clock tokens/s, tokens per CPU-second of the child (time.process_time,
all its threads): on a shared machine other processes stretch the wall clock, much less the CPU time
the work itself takes. Both sides' mean training loss is printed: equal values show the work was the same.

    python bench/instruct_throughput.py --json bench/results/instruct_throughput.json
    python bench/instruct_throughput.py --d-model 64 --d-ff 128 --layers 2 --max-train 32 --steps 2 \\
        --repeats 1 --vocab-size 1000        # smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

SIDES = ("fedsilo", "bare")
MODES = ("lora", "full")


def run_config(args, lora: bool):
    from fedsilo.config import validate
    raw = {
        "seed": 0,
        "task": {"name": "instruct", "silos": [args.silo], "max_train": args.max_train, "max_eval": 1,
                 "max_length": args.max_length, "vocab_size": args.vocab_size},
        "model": {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads,
                  "dropout": 0.0, "device": "cpu"},
        "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": args.batch_size, "steps": args.steps,
                   "max_grad_norm": 1.0},
    }
    if lora:
        raw["model"]["surgery"] = [{"name": "lora", "options": {"rank": args.rank, "alpha": args.alpha,
                                                                 "target_modules": ["q_proj", "v_proj"]}}]
    return validate(raw)


def batch_plan(cfg, lengths: list[int]) -> list[list[int]]:
    """The batches (row indices) silo 0's round 1 visits: train_local's order for that round's seed."""
    import torch

    from fedsilo.client.batching import BATCH_ORDERS, default_window
    from fedsilo.client.silo import client_seed

    c = cfg.client
    rng = torch.Generator().manual_seed(client_seed(cfg.seed, 1, 0))
    window = c.length_window or default_window(len(lengths), c.batch_size)
    batches: list[list[int]] = []
    while len(batches) < c.steps:
        order = BATCH_ORDERS.get(c.batching)(lengths, c.batch_size, rng, window)
        batches += [order[s:s + c.batch_size] for s in range(0, len(order), c.batch_size)]
    return batches[:c.steps]


class RssPeak:
    """This process's peak resident memory while the `with` block runs, sampled every 10 ms."""

    def __enter__(self) -> "RssPeak":
        self.start = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.rss())

    @staticmethod
    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def fedsilo_side(cfg, adapters_path: Path) -> dict:
    """One round of the silo's SiloClient, from the global tensors the server would send."""
    from safetensors.torch import save_file

    from fedsilo.client.silo import SiloClient, federated_parameters
    from fedsilo.client.store import MemoryStore
    from fedsilo.recipe import build_model, build_task, silo_recipe
    from fedsilo.tasks.tokens import row_length

    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    silo = task.clients[0]
    client = SiloClient(silo, task, task.examples(silo, "train"), model, MemoryStore(),
                        silo_recipe(cfg.client_config(silo), index=0))
    received = {k: p.detach().clone() for k, p in federated_parameters(model).items()}
    if cfg.model.surgeries and not adapters_path.exists():
        save_file({k: v.contiguous() for k, v in received.items()}, str(adapters_path))
    plan = batch_plan(cfg, [row_length(r) for r in client.rows])
    tokens = sum(len(client.rows[i]["input_ids"]) for b in plan for i in b)
    with RssPeak() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        update = client.fit(1, received, cfg.seed)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert update.steps == len(plan), (update.steps, len(plan))
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "mean_loss": update.mean_loss,
            "train_peak_delta": mem.peak - mem.start, "trainable": sum(p.numel() for p in federated_parameters(model).values())}


def bare_side(cfg, adapters_path: Path) -> dict:
    """What a user writes with transformers + peft: the same weights, batches and optimiser."""
    import torch
    from safetensors.torch import load_file

    from fedsilo.models.lora import lora_settings
    from fedsilo.recipe import build_model, build_task
    from fedsilo.tasks.tokens import row_length

    lora = lora_settings(cfg.model)
    base = cfg.model_copy(update={"model": cfg.model.model_copy(update={"surgery": None})})
    model, tokenizer = build_model(base)  # a plain LlamaForCausalLM: fedsilo's weights for this seed, no surgery
    task = build_task(cfg, tokenizer)
    rows = task.tokenize(task.examples(task.clients[0], "train"))
    plan = batch_plan(cfg, [row_length(r) for r in rows])
    batches = [task.pad([rows[i] for i in b]) for b in plan]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    if lora is not None:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                 target_modules=lora.target_modules, bias="none"))
        start_point = {f"base_model.model.{k}": v for k, v in load_file(str(adapters_path)).items()}
        missing = set(start_point) - set(dict(model.named_parameters()))
        assert not missing, f"adapter names do not map: {sorted(missing)[:3]}"
        model.load_state_dict(start_point, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    c = cfg.client
    with RssPeak() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        model.train()
        loss_sum = torch.zeros(())
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        model.eval()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "mean_loss": float(loss_sum) / len(batches),
            "train_peak_delta": mem.peak - mem.start, "trainable": sum(p.numel() for p in params)}


def child(args) -> None:
    import warnings
    warnings.simplefilter("ignore")  # truncation notes: the parent's run says them once
    cfg = run_config(args, args.mode == "lora")
    result = (fedsilo_side if args.child == "fedsilo" else bare_side)(cfg, args.adapters)
    args.result.write_text(json.dumps(result))


def measure(side: str, mode: str, args, work: Path) -> dict:
    from flower_engines import run_with_peak

    result = work / f"{side}-{mode}.json"
    cmd = [sys.executable, __file__, "--child", side, "--mode", mode, "--result", str(result),
           "--adapters", str(work / "adapters.safetensors"), *passthrough(args)]
    proc, err, peak, _ = run_with_peak(cmd, {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"{side} {mode} child failed (exit {proc.returncode}):\n{err.decode()[-3000:]}")
    out = json.loads(result.read_text())
    return {**out, "tokens_per_s": out["tokens"] / out["seconds"], "tokens_per_cpu_s": out["tokens"] / out["cpu_seconds"],
            "tree_peak": peak}


KNOBS = ("silo", "max_train", "max_length", "vocab_size", "d_model", "d_ff", "layers", "heads", "batch_size", "steps",
         "lr", "rank", "alpha")


def passthrough(args) -> list[str]:
    return [a for k in KNOBS for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def summary(runs: list[dict]) -> dict:
    rates, cpu_rates = [r["tokens_per_s"] for r in runs], [r["tokens_per_cpu_s"] for r in runs]
    return {"runs": runs, "median_tokens_per_s": statistics.median(rates), "min_tokens_per_s": min(rates),
            "max_tokens_per_s": max(rates), "median_tokens_per_cpu_s": statistics.median(cpu_rates),
            "min_tokens_per_cpu_s": min(cpu_rates), "max_tokens_per_cpu_s": max(cpu_rates), "median_tree_peak_mib": statistics.median(r["tree_peak"] for r in runs) / 2**20,
            "median_train_peak_delta_mib": statistics.median(r["train_peak_delta"] for r in runs) / 2**20,
            "mean_loss": runs[0]["mean_loss"], "tokens": runs[0]["tokens"], "trainable": runs[0]["trainable"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--adapters", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    ap.add_argument("--silo", default="codealpaca", help="the instruct silo whose records train")
    ap.add_argument("--max-train", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=344)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="optimiser steps per measurement (one round)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3, help="measurements per side and mode")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")

    command = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load = os.getloadavg()
    print(f"command: {command}\ndate: {date}\ncpu: {os.cpu_count()} cores, load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in modes:
            runs = {s: [] for s in SIDES}
            for rep in range(args.repeats):
                for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                    runs[side].append(measure(side, mode, args, work))
                    r = runs[side][-1]
                    print(f"  {mode} repeat {rep + 1}: {side:7s} {r['tokens_per_s']:8.0f} tokens/s  "
                          f"{r['tokens_per_cpu_s']:6.0f} tokens/CPU-s  "
                          f"tree peak {r['tree_peak'] / 2**20:6.0f} MiB  training +{r['train_peak_delta'] / 2**20:5.0f} MiB  "
                          f"mean loss {r['mean_loss']:.5f}", flush=True)
            results[mode] = {s: summary(runs[s]) for s in SIDES}
            f, b = results[mode]["fedsilo"], results[mode]["bare"]
            results[mode]["ratio"] = f["median_tokens_per_s"] / b["median_tokens_per_s"]
            results[mode]["cpu_ratio"] = f["median_tokens_per_cpu_s"] / b["median_tokens_per_cpu_s"]
            results[mode]["memory_ratio"] = f["median_tree_peak_mib"] / b["median_tree_peak_mib"]

    load = os.getloadavg()
    any_side = results[modes[0]]["fedsilo"] if modes else None
    print(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if any_side:
        print(f"workload: tiny-llama d_model {args.d_model}, d_ff {args.d_ff}, {args.layers} layers, {args.heads} heads, "
              f"vocab {args.vocab_size}; silo {args.silo} ({args.max_train} records, max {args.max_length} tokens), "
              f"batch {args.batch_size}, {args.steps} steps = {any_side['tokens']} trained tokens; AdamW lr {args.lr}; "
              f"LoRA r {args.rank} alpha {args.alpha} on q_proj, v_proj; {args.repeats} child processes per side")
    print("\n| mode | side | trainable params | tokens/s median (min–max) | ratio fedsilo/bare | tokens per CPU-second "
          "median (min–max) | CPU ratio | process-tree peak MiB | training peak above start MiB | mean loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        for side in SIDES:
            s = r[side]
            ratio, cpu_ratio = (f"{r['ratio']:.3f}", f"{r['cpu_ratio']:.3f}") if side == "fedsilo" else ("", "")
            print(f"| {mode} | {side} | {s['trainable']:,} | {s['median_tokens_per_s']:.0f} ({s['min_tokens_per_s']:.0f}–"
                  f"{s['max_tokens_per_s']:.0f}) | {ratio} | {s['median_tokens_per_cpu_s']:.0f} ({s['min_tokens_per_cpu_s']:.0f}–"
                  f"{s['max_tokens_per_cpu_s']:.0f}) | {cpu_ratio} | {s['median_tree_peak_mib']:.0f} | "
                  f"{s['median_train_peak_delta_mib']:.1f} | {s['mean_loss']:.5f} |")
    below = [m for m, r in results.items() if r["ratio"] < 0.95]
    print(f"\ntarget fedsilo/bare >= 0.95 (wall-clock tokens/s): {'met' if not below else 'NOT met for ' + ', '.join(below)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "date": date, "cpu_count": os.cpu_count(),
                                         "args": {k: getattr(args, k) for k in (*KNOBS, "repeats", "modes")},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
