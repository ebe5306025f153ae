"""Training throughput: fedsilo's client loop (`train_local`) vs a tuned bare PyTorch loop, per precision.

Both loops train the same seq2seq T5 (built by fedsilo from scratch; the defaults give the issue's
59.7M-parameter model) from the same initial weights on the same batches of a text-to-SQL silo (ATIS,
max 256/256 tokens, batch 32) in the same order (fedsilo's `length_grouped` policy), with the same
optimiser kind (the CLIENT_OPTIMIZERS entry) and gradient clipping at 1.0. The bare loop pads every batch once,
moves them to the device up front, and never reads a value back per step; the engine gets `rows`,
`task.pad` and the token lengths exactly as a `SiloClient` passes them. Only the `--steps` optimiser
steps after `--warmup` are timed (a device sync at both ends only). Precisions: fp32 (TF32 off), tf32
(fp32 weights, TF32 matmuls; CUDA only), bf16 and fp16 (autocast; fp16 with a grad scaler, CUDA only).
Runs alternate A B B A ... per precision; the table gives the medians, engine/bare (target >= 0.9),
and each precision's speed-up over fp32 for both loops.

    python bench/gpu_throughput.py                                   # on a GPU, the issue's workload
    OMP_NUM_THREADS=1 python bench/gpu_throughput.py --device cpu --d-model 128 --d-ff 256 --layers 2 \\
        --heads 4 --max-train 64 --steps 4 --warmup 1 --repeats 1 --precisions fp32,bf16   # CPU smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time

import torch

from fedsilo.client.batching import BATCH_ORDERS, default_window
from fedsilo.client.optim import CLIENT_OPTIMIZERS
from fedsilo.client.train import TrainingParts
from fedsilo.client.train import train_local
from fedsilo.config import ConfigError, validate
from fedsilo.datafetch import default_data_root, ensure
from fedsilo.models.precision import check_precision, grad_scaler, set_tf32
from fedsilo.recipe import build_model, build_task
from fedsilo.tasks.tokens import default_cache_dir, row_length, tokenized

SEED = 0
AMP = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16"}  # bench precision → fedsilo's


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def batch_plan(lengths: list[int], batch_size: int, n_steps: int) -> list[list[int]]:
    """The first `n_steps` batches (lists of row indices) `train_local` visits with length_grouped
    order and seed SEED: the same generator, window and epochs."""
    rng = torch.Generator().manual_seed(SEED)
    window = default_window(len(lengths), batch_size)
    batches: list[list[int]] = []
    while len(batches) < n_steps:
        order = BATCH_ORDERS.get("length_grouped")(lengths, batch_size, rng, window)
        batches += [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    return batches[:n_steps]


def engine_loop(model, task, rows, lengths, init, args, precision, device) -> float:
    """Seconds of the timed steps through fedsilo's per-client loop."""
    model.load_state_dict(init)
    marks, done = [], 0

    def on_step() -> None:
        nonlocal done
        done += 1
        if done in (args.warmup, args.warmup + args.steps):
            marks.append(clock(device))

    train_local(model, rows, task.pad, lambda m, b: task.loss(m, b), epochs=1, lr=args.lr,
                batch_size=args.batch_size, parts=TrainingParts(optimizer=CLIENT_OPTIMIZERS.get(args.optimizer)),
                seed=SEED, max_grad_norm=1.0, on_step=on_step, max_steps=args.warmup + args.steps, lengths=lengths,
                precision=AMP[precision])
    return marks[1] - marks[0]


def bare_loop(model, batches, init, args, precision, device) -> float:
    """Seconds of the timed steps of a hand-written loop over pre-padded, on-device batches."""
    model.load_state_dict(init)
    torch.manual_seed(SEED)  # dropout, as train_local seeds it
    params = [p for p in model.parameters() if p.requires_grad]
    opt = CLIENT_OPTIMIZERS.get(args.optimizer)(params, args.lr, 0.0)  # torch's own optimisers default to foreach on CUDA
    amp = AMP[precision]
    scaler = grad_scaler(amp, device)
    model.train()
    for i, batch in enumerate(batches):
        if i == args.warmup:
            start = clock(device)
        with torch.autocast(device.type, dtype=torch.float16 if amp == "fp16" else torch.bfloat16,
                            enabled=amp != "fp32"):
            loss = model(**batch).loss
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    stop = clock(device)
    model.eval()
    return stop - start


def skip_reason(precision: str, device: torch.device) -> str | None:
    if precision == "tf32" and device.type != "cuda":
        return "tf32 skipped: TF32 matmuls exist on CUDA (Ampere or newer) only"
    try:
        check_precision(AMP[precision], device)
    except ConfigError as err:
        return f"{precision} skipped: {err}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    ap.add_argument("--precisions", default="fp32,tf32,bf16", help="comma-separated: fp32, tf32, bf16, fp16")
    ap.add_argument("--silo", default="atis")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6, help="encoder and decoder layers each")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-source-length", type=int, default=256)
    ap.add_argument("--max-target-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-train", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30, help="timed optimiser steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them (at least 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--optimizer", default="adafactor", help="a fedsilo client optimizer: adafactor, adamw, sgd")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if unknown := [p for p in precisions if p not in AMP]:
        ap.error(f"--precisions: unknown {unknown}; choose from {list(AMP)}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the clock starts at the end of warmup)")

    data_dir = ensure("text2sql", default_data_root() / "text2sql", progress=False)
    cfg = validate({
        "seed": SEED,
        "task": {"name": "text2sql", "silos": [args.silo], "data_dir": str(data_dir), "exec_accuracy": False,
                 "max_train": args.max_train, "max_source_length": args.max_source_length,
                 "max_target_length": args.max_target_length},
        "model": {"name": "tiny-t5", "d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers,
                  "num_decoder_layers": args.layers, "num_heads": args.heads, "device": args.device,
                  "tf32": False},
    })
    model, tokenizer = build_model(cfg)
    device = next(model.parameters()).device
    task = build_task(cfg, tokenizer)
    rows = tokenized(task, task.examples(args.silo, "train"), default_cache_dir())
    lengths = [row_length(r) for r in rows]
    plan = batch_plan(lengths, args.batch_size, args.warmup + args.steps)
    timed_examples = sum(len(b) for b in plan[args.warmup:])
    pin = device.type == "cuda"
    batches = [{k: (v.pin_memory() if pin else v).to(device, non_blocking=True)
                for k, v in task.pad([rows[i] for i in b]).items()} for b in plan]
    clock(device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())

    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)")
    command = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"command: {command}\ndevice: {device_name}\ntorch: {torch.__version__}\ndate: {date}")
    print(f"workload: T5 {n_params / 1e6:.1f}M params (d_model {args.d_model}, d_ff {args.d_ff}, "
          f"{args.layers}+{args.layers} layers, {args.heads} heads), {args.silo} {len(rows)} train examples, "
          f"batch {args.batch_size}, max {args.max_source_length}/{args.max_target_length} tokens, "
          f"{args.optimizer} lr {args.lr}; {args.steps} timed steps ({timed_examples} examples) after "
          f"{args.warmup} warmup, {args.repeats} repeats", flush=True)

    results, notes = {}, []
    for precision in precisions:
        if reason := skip_reason(precision, device):
            notes.append(reason)
            continue
        set_tf32(device, precision == "tf32")
        runs = {"engine": lambda: engine_loop(model, task, rows, lengths, init, args, precision, device),
                "bare": lambda: bare_loop(model, batches, init, args, precision, device)}
        rates = {"engine": [], "bare": []}
        for rep in range(args.repeats):
            for name in ("engine", "bare") if rep % 2 == 0 else ("bare", "engine"):
                rates[name].append(timed_examples / runs[name]())
                print(f"  {precision} repeat {rep + 1}: {name:6s} {rates[name][-1]:8.1f} ex/s", flush=True)
        results[precision] = {k: {"runs": v, "median": statistics.median(v)} for k, v in rates.items()}
        results[precision]["ratio"] = results[precision]["engine"]["median"] / results[precision]["bare"]["median"]
    set_tf32(device, False)

    base = results.get("fp32")
    print("\n| precision | engine ex/s | bare ex/s | engine/bare | engine vs fp32 | bare vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for precision, r in results.items():
        for loop in ("engine", "bare"):
            r[loop]["vs_fp32"] = r[loop]["median"] / base[loop]["median"] if base else None
        speed = [f"{r[loop]['vs_fp32']:.2f}x" if base else "n/a" for loop in ("engine", "bare")]
        print(f"| {precision} | {r['engine']['median']:.1f} | {r['bare']['median']:.1f} | {r['ratio']:.3f} | "
              f"{speed[0]} | {speed[1]} |")
    below = [p for p, r in results.items() if r["ratio"] < 0.9]
    print(f"\ntarget: engine/bare >= 0.9 at every precision: {'met' if not below else 'NOT met at ' + ', '.join(below)}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "device": device_name, "torch": torch.__version__, "date": date,
                       "params": n_params, "timed_examples": timed_examples, "args": vars(args),
                       "results": results, "notes": notes}, f, indent=2)


if __name__ == "__main__":
    main()
