"""Instruction tuning throughput: one silo's fedsilo client round (SiloClient.fit) vs a bare transformers + peft loop.

Both sides train one decoder: by default the built-in tiny-llama (fedsilo builds its weights from the seed;
the bare side gets the very same LlamaForCausalLM weights), or with `--model` a checkpoint: a built-in
pretrained name (`smollm2-135m-instruct`, resolved with fedsilo.models.pretrained.pretrained_folder) or a
local `AutoModelForCausalLM` folder. fedsilo's config then carries `model.kind = "causal"` and `model.name`,
so the instruct task renders the records with that checkpoint's own tokenizer and chat template
(`task.template = "auto"`); the bare side loads the same folder with `AutoModelForCausalLM.from_pretrained`
(fp32) and `AutoTokenizer.from_pretrained` (pad = EOS where it has none, as fedsilo does). Both train on the
same silo's real records (default Code Alpaca), rendered and tokenised by the instruct task (completion-only
labels), in the same batches in the same order (fedsilo's length_grouped order for the silo's round seed,
replayed), with torch.optim.AdamW and gradient clipping at 1.0. Each side hashes the token rows of its
planned batches; the parent refuses the run if the two hashes differ. Two pairs:
- lora: fedsilo's `lora` surgery vs peft's `get_peft_model` with the same LoraConfig (rank, alpha,
  `--target-modules`, default q_proj/v_proj), its adapters loaded with fedsilo's initial ones so both
  start from one point;
- full: every weight trains (no LoRA).

Warm-up, outside the clock on both sides (`--warmup` optimiser steps, default 1): fedsilo's clock covers a
whole `fit` (loading the received tensors, training, selecting and copying the upload, keeping its state),
so the fedsilo side first runs an untimed warm-up `fit` of `--warmup` steps (a second SiloClient on the same
model with its own store, so the timed round is still a first round: same batches, same schedule), then
times one `fit` of `--steps` steps, which starts again from the received tensors. The bare side runs the
same `--warmup` batches through the same loop code (its own AdamW), puts the trained tensors back to their
start, and times the loop over the `--steps` batches (creating its AdamW inside the clock, as `fit` does).
So both clocks cover the same steps from the same start, after the same warm-up; equal mean training losses
show the work was the same. The bare loop pads every batch up front (outside its clock) and takes the loss
transformers computes from `labels`. Trained tokens are the timed batches' non-pad tokens, counted the same
way for both.

Each measurement is a fresh child process; the sides alternate (A B B A ...), one pair per repeat, and the
parent samples the child's process tree (peak RSS, as bench/flower_engines.py) while the child samples its
own RSS during training (peak above the RSS just before it). Besides wall-clock tokens/s, tokens per
CPU-second of the child (time.process_time, all its threads): on a shared machine other processes stretch
the wall clock, much less the CPU time the work itself takes.

The goal (issue: client training >= 0.95x the bare loop in tokens/s and tokens per CPU-second) is judged
on the per-pair ratios fedsilo/bare (each pair measured back to back). Adaptive repeats: pairs continue
until, for both metrics, the spread of the per-pair ratios — their min..max — lies entirely at or above
0.95 ("holds") or entirely below it ("below"), at least `--repeats` and at most `--max-repeats` pairs per
mode; otherwise the verdict is "spread overlaps 0.95 after N repeats". The min..max of n per-pair ratios is
a distribution-free interval for the median pair ratio of coverage 1 - 2^(1-n) (sign test: 75 % at 3 pairs,
87.5 % at 4, 94 % at 5, 97 % at 6); the script prints it with each verdict.

    python bench/instruct_throughput.py --json bench/results/instruct_throughput.json        # tiny-llama
    python bench/instruct_throughput.py --d-model 64 --d-ff 128 --layers 2 --max-train 32 --steps 2 \\
        --repeats 1 --max-repeats 1 --vocab-size 1000        # smoke run
    python bench/instruct_throughput.py --model smollm2-135m-instruct --max-length 256 --batch-size 4 --steps 4 \\
        --json bench/results/instruct_throughput_smollm2.json   # SmolLM2-135M-Instruct: ~10 min on 2 quiet cores

With `--model`, `--batch-size` and `--steps` default to 4 and 4 (tiny-llama: 8 and 8), and the tiny-llama
sizes (`--d-model` ... `--vocab-size`) are not read. On 2 cores SmolLM2-135M takes about 3.5 s a LoRA step
at batch 4 (the study's rounds); a measurement (start, load, warm-up, 4 timed steps) is about 35 s for
LoRA and 50 s for full fine-tuning, so 3 to 4 pairs per mode take 8 to 11 minutes.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
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
GOAL = 0.95  # fedsilo/bare, tokens per second and per CPU-second
TINY_DEFAULTS = {"batch_size": 8, "steps": 8}   # the built-in tiny-llama (unchanged)
MODEL_DEFAULTS = {"batch_size": 4, "steps": 4}  # a checkpoint (--model): SmolLM2-135M fits ~10 min on 2 cores


# ---------------------------------------------------------------------------------------------------------
# The adaptive stop rule (pure functions: tests/test_gpu_suite.py checks them)

def interval(ratios: list[float]) -> tuple[float, float]:
    """The spread the rule reads: min..max of the per-pair ratios."""
    return min(ratios), max(ratios)


def coverage(n: int) -> float:
    """How often min..max of n paired ratios covers their median (distribution-free, sign test): 1 - 2^(1-n)."""
    return max(0.0, 1 - 2.0 ** (1 - n))


def judge(ratios: list[float], goal: float = GOAL, min_pairs: int = 3) -> str:
    """"holds" (every pair ratio >= goal), "below" (every one < goal), "overlaps" (the spread straddles the
    goal), or "undecided" (fewer than `min_pairs` pairs yet)."""
    if len(ratios) < max(1, min_pairs):
        return "undecided"
    lo, hi = interval(ratios)
    if lo >= goal:
        return "holds"
    if hi < goal:
        return "below"
    return "overlaps"


def should_stop(wall: list[float], cpu: list[float], goal: float = GOAL, min_pairs: int = 3,
                max_pairs: int = 4) -> bool:
    """After each pair: stop once both metrics' spreads are clear of the goal (at least `min_pairs` pairs),
    or at `max_pairs`."""
    if len(wall) >= max_pairs:
        return True
    return all(judge(r, goal, min_pairs) in ("holds", "below") for r in (wall, cpu))


def verdict(ratios: list[float], goal: float = GOAL, min_pairs: int = 3) -> str:
    """The verdict line's words for one metric."""
    j = judge(ratios, goal, min_pairs)
    if j == "holds":
        return f">= {goal} holds"
    if j == "below":
        return f"below {goal}"
    if j == "undecided":
        return f"undecided: {len(ratios)} of the {min_pairs} repeats the rule needs"
    return f"spread overlaps {goal} after {len(ratios)} repeats"


# ---------------------------------------------------------------------------------------------------------

def run_config(args, lora: bool, steps: int | None = None):
    """The run's config: the instruct task on one silo; the tiny-llama of the asked sizes, or `--model`."""
    from fedsilo.config import validate
    task = {"name": "instruct", "silos": [args.silo], "max_train": args.max_train, "max_eval": 1,
            "max_length": args.max_length}
    if args.model:  # the checkpoint's own tokenizer and chat template render the records
        model = {"kind": "causal", "name": args.model, "device": "cpu"}
    else:
        task["vocab_size"] = args.vocab_size
        model = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads,
                 "dropout": 0.0, "device": "cpu"}
    raw = {
        "seed": 0, "task": task, "model": model,
        "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": args.batch_size,
                   "steps": args.steps if steps is None else steps, "max_grad_norm": 1.0},
    }
    if lora:
        raw["model"]["surgery"] = [{"name": "lora", "options": {"rank": args.rank, "alpha": args.alpha,
                                                                 "target_modules": targets(args)}}]
    return validate(raw)


def targets(args) -> list[str]:
    return [t.strip() for t in args.target_modules.split(",") if t.strip()]


def checkpoint_folder(name: str) -> Path:
    """`--model`'s folder: a built-in pretrained name's (converted once) or a local checkpoint folder."""
    from fedsilo.models.pretrained import PRETRAINED, pretrained_folder
    if name in PRETRAINED:
        return pretrained_folder(name, say=lambda line: print(line, file=sys.stderr, flush=True))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: neither a built-in pretrained model ({', '.join(PRETRAINED)}) nor a "
                         "checkpoint folder with a config.json")
    return path


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


def rows_digest(rows, plan: list[list[int]]) -> str:
    """sha256 of the planned batches' token rows (every tensor as int64, keys sorted) and their order."""
    import torch
    h = hashlib.sha256()
    for batch in plan:
        for i in batch:
            h.update(f"[{i}]".encode())
            for key in sorted(rows[i]):
                t = torch.as_tensor(rows[i][key])
                h.update(key.encode() + (t.to(torch.int64) if not t.is_floating_point() else t.float()).numpy().tobytes())
    return h.hexdigest()


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


def fedsilo_side(cfg, warm_cfg, adapters_path: Path) -> dict:
    """One round of the silo's SiloClient, from the global tensors the server would send, after an untimed
    warm-up round of `warm_cfg.client.steps` steps (None: none) by a twin client on the same model."""
    import torch
    from safetensors.torch import save_file

    from fedsilo.client.silo import SiloClient, federated_parameters
    from fedsilo.client.store import MemoryStore
    from fedsilo.recipe import build_model, build_task, silo_recipe
    from fedsilo.tasks.tokens import row_length

    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    silo = task.clients[0]
    examples = task.examples(silo, "train")
    client = SiloClient(silo, task, examples, model, MemoryStore(), silo_recipe(cfg.client_config(silo), index=0))
    received = {k: p.detach().clone() for k, p in federated_parameters(model).items()}
    if cfg.model.surgeries and not adapters_path.exists():
        save_file({k: v.contiguous() for k, v in received.items()}, str(adapters_path))
    plan = batch_plan(cfg, [row_length(r) for r in client.rows])
    tokens = sum(len(client.rows[i]["input_ids"]) for b in plan for i in b)
    if warm_cfg is not None:  # its own store: the timed fit is still the silo's first round
        warm = SiloClient(silo, task, examples, model, MemoryStore(), silo_recipe(warm_cfg.client_config(silo), index=0))
        warm.fit(1, received, cfg.seed)
        del warm
    with RssPeak() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        update = client.fit(1, received, cfg.seed)  # starts again from `received`
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert update.steps == len(plan), (update.steps, len(plan))
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "mean_loss": update.mean_loss,
            "train_peak_delta": mem.peak - mem.start, "trainable": sum(p.numel() for p in federated_parameters(model).values()),
            "digest": rows_digest(client.rows, plan), "threads": torch.get_num_threads()}


def bare_train(model, params, batches, c) -> torch.Tensor:
    """The hand-written loop: AdamW made here, forward with `labels`, backward, clip, step. The summed loss."""
    import torch
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
    return loss_sum


def bare_model(cfg, folder: Path | None):
    """(model, tokenizer) as a user gets them: from_pretrained on the folder, or fedsilo's tiny-llama weights."""
    if folder is None:
        from fedsilo.recipe import build_model
        base = cfg.model_copy(update={"model": cfg.model.model_copy(update={"surgery": None})})
        return build_model(base)  # a plain LlamaForCausalLM: fedsilo's weights for this seed, no surgery
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token is None:  # batching needs one; padded positions are labelled -100
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def bare_side(cfg, warm_cfg, adapters_path: Path, folder: Path | None) -> dict:
    """What a user writes with transformers + peft: the same weights, batches and optimiser."""
    import torch
    from safetensors.torch import load_file

    from fedsilo.models.lora import lora_settings
    from fedsilo.recipe import build_task
    from fedsilo.tasks.tokens import row_length

    lora = lora_settings(cfg.model)
    model, tokenizer = bare_model(cfg, folder)
    n_params = sum(p.numel() for p in model.parameters())
    task = build_task(cfg, tokenizer)
    rows = task.tokenize(task.examples(task.clients[0], "train"))
    lengths = [row_length(r) for r in rows]
    plan = batch_plan(cfg, lengths)
    batches = [task.pad([rows[i] for i in b]) for b in plan]
    warm_batches = [task.pad([rows[i] for i in b]) for b in batch_plan(warm_cfg, lengths)] if warm_cfg else []
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
    if warm_batches:  # untimed, then every trained tensor back to its start (the fedsilo side reloads `received`)
        start_values = [p.detach().clone() for p in params]
        bare_train(model, params, warm_batches, c)
        with torch.no_grad():
            for p, v in zip(params, start_values):
                p.copy_(v)
                p.grad = None
        del start_values
    with RssPeak() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        loss_sum = bare_train(model, params, batches, c)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "mean_loss": float(loss_sum) / len(batches),
            "train_peak_delta": mem.peak - mem.start, "trainable": sum(p.numel() for p in params),
            "digest": rows_digest(rows, plan), "params": n_params, "threads": torch.get_num_threads()}


def child(args) -> None:
    import warnings
    warnings.simplefilter("ignore")  # truncation notes: the parent's run says them once
    lora = args.mode == "lora"
    cfg = run_config(args, lora)
    warm_cfg = run_config(args, lora, steps=args.warmup) if args.warmup > 0 else None
    if args.child == "fedsilo":
        result = fedsilo_side(cfg, warm_cfg, args.adapters)
    else:
        result = bare_side(cfg, warm_cfg, args.adapters, checkpoint_folder(args.model) if args.model else None)
    args.result.write_text(json.dumps(result))


def measure(side: str, mode: str, args, work: Path) -> dict:
    from flower_engines import run_with_peak

    result = work / f"{side}-{mode}.json"
    cmd = [sys.executable, __file__, "--child", side, "--mode", mode, "--result", str(result),
           "--adapters", str(work / f"adapters-{mode}.safetensors"), *passthrough(args)]
    proc, err, peak, _ = run_with_peak(cmd, {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"{side} {mode} child failed (exit {proc.returncode}):\n{err.decode()[-3000:]}")
    out = json.loads(result.read_text())
    return {**out, "tokens_per_s": out["tokens"] / out["seconds"], "tokens_per_cpu_s": out["tokens"] / out["cpu_seconds"],
            "tree_peak": peak}


KNOBS = ("model", "silo", "max_train", "max_length", "vocab_size", "d_model", "d_ff", "layers", "heads", "batch_size",
         "steps", "warmup", "lr", "rank", "alpha", "target_modules")


def passthrough(args) -> list[str]:
    return [a for k in KNOBS if getattr(args, k) is not None for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def summary(runs: list[dict]) -> dict:
    rates, cpu_rates = [r["tokens_per_s"] for r in runs], [r["tokens_per_cpu_s"] for r in runs]
    return {"runs": runs, "median_tokens_per_s": statistics.median(rates), "min_tokens_per_s": min(rates),
            "max_tokens_per_s": max(rates), "median_tokens_per_cpu_s": statistics.median(cpu_rates),
            "min_tokens_per_cpu_s": min(cpu_rates), "max_tokens_per_cpu_s": max(cpu_rates), "median_tree_peak_mib": statistics.median(r["tree_peak"] for r in runs) / 2**20,
            "median_train_peak_delta_mib": statistics.median(r["train_peak_delta"] for r in runs) / 2**20,
            "mean_loss": runs[0]["mean_loss"], "tokens": runs[0]["tokens"], "trainable": runs[0]["trainable"]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--adapters", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    ap.add_argument("--model", help="a built-in pretrained decoder (smollm2-135m-instruct) or a local "
                                    "AutoModelForCausalLM checkpoint folder; default: the built-in tiny-llama")
    ap.add_argument("--silo", default="codealpaca", help="the instruct silo whose records train")
    ap.add_argument("--max-train", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=8000, help="tiny-llama only")
    ap.add_argument("--d-model", type=int, default=128, help="tiny-llama only")
    ap.add_argument("--d-ff", type=int, default=344, help="tiny-llama only")
    ap.add_argument("--layers", type=int, default=2, help="tiny-llama only")
    ap.add_argument("--heads", type=int, default=4, help="tiny-llama only")
    ap.add_argument("--batch-size", type=int, help="default 8 (tiny-llama), 4 (--model)")
    ap.add_argument("--steps", type=int, help="timed optimiser steps per measurement (one round); default 8 "
                                              "(tiny-llama), 4 (--model)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed optimiser steps before them, on both sides "
                                                          "(fedsilo: a warm-up round); 0: none")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--target-modules", default="q_proj,v_proj", help="LoRA's, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="pairs (fedsilo, bare) per mode before the stop rule may "
                                                           "end the mode")
    ap.add_argument("--max-repeats", type=int, default=4, help="pairs per mode at most: the stop rule ends a mode "
                                                               "earlier once both ratios' spreads are clear of 0.95")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    for key, value in (MODEL_DEFAULTS if args.model else TINY_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.batch_size < 1 or args.warmup < 0:
        ap.error("--steps and --batch-size must be at least 1, --warmup at least 0")
    if args.repeats < 1 or args.max_repeats < args.repeats:
        ap.error("--repeats must be at least 1 and --max-repeats at least --repeats")
    return ap, args


def main() -> None:
    ap, args = parse_args()
    if args.child:
        child(args)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    folder = checkpoint_folder(args.model) if args.model else None  # converted (once) here, not in a child

    command = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    print(f"command: {command}\ndate: {date}\ncpu: {os.cpu_count()} cores, load average at start "
          f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    results, params = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in modes:
            runs = {s: [] for s in SIDES}
            wall, cpu = [], []
            for rep in range(args.max_repeats):
                for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                    runs[side].append(measure(side, mode, args, work))
                    r = runs[side][-1]
                    print(f"  {mode} repeat {rep + 1}: {side:7s} {r['tokens_per_s']:8.0f} tokens/s  "
                          f"{r['tokens_per_cpu_s']:6.0f} tokens/CPU-s  {r['seconds']:6.1f} s timed  "
                          f"tree peak {r['tree_peak'] / 2**20:6.0f} MiB  training +{r['train_peak_delta'] / 2**20:5.0f} MiB  "
                          f"mean loss {r['mean_loss']:.5f}", flush=True)
                f, b = runs["fedsilo"][-1], runs["bare"][-1]
                if f["digest"] != b["digest"]:
                    raise SystemExit(f"{mode}: the two sides trained on different token rows (sha256 {f['digest'][:12]} "
                                     f"vs {b['digest'][:12]}): the comparison would not be fair")
                wall.append(f["tokens_per_s"] / b["tokens_per_s"])
                cpu.append(f["tokens_per_cpu_s"] / b["tokens_per_cpu_s"])
                print(f"  {mode} pair {rep + 1}: fedsilo/bare {wall[-1]:.3f} (wall), {cpu[-1]:.3f} (CPU)", flush=True)
                if should_stop(wall, cpu, GOAL, args.repeats, args.max_repeats):
                    break
            params = runs["bare"][0]["params"]
            results[mode] = {s: summary(runs[s]) for s in SIDES}
            f, b = results[mode]["fedsilo"], results[mode]["bare"]
            results[mode].update({
                "pairs": len(wall), "wall_ratios": wall, "cpu_ratios": cpu,
                "ratio": f["median_tokens_per_s"] / b["median_tokens_per_s"],  # of the medians, as before
                "cpu_ratio": f["median_tokens_per_cpu_s"] / b["median_tokens_per_cpu_s"],
                "pair_ratio_median": statistics.median(wall), "pair_cpu_ratio_median": statistics.median(cpu),
                "wall_interval": interval(wall), "cpu_interval": interval(cpu), "interval_coverage": coverage(len(wall)),
                "wall_verdict": verdict(wall, GOAL, args.repeats), "cpu_verdict": verdict(cpu, GOAL, args.repeats),
                "memory_ratio": f["median_tree_peak_mib"] / b["median_tree_peak_mib"],
                "losses_equal": all(abs(x["mean_loss"] - y["mean_loss"]) <= 1e-4 * max(1.0, abs(y["mean_loss"]))
                                    for x, y in zip(runs["fedsilo"], runs["bare"]))})

    load_end = os.getloadavg()
    any_side = results[modes[0]]["fedsilo"] if modes else None
    print(f"load average at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    model_name = args.model or "tiny-llama"
    if any_side:
        shape = (f"{args.model} ({folder}), {params / 1e6:,.1f}M params" if args.model else
                 f"tiny-llama d_model {args.d_model}, d_ff {args.d_ff}, {args.layers} layers, {args.heads} heads, "
                 f"vocab {args.vocab_size}, {params / 1e6:,.2f}M params")
        print(f"workload: {shape}; silo {args.silo} ({args.max_train} records, max {args.max_length} tokens), "
              f"batch {args.batch_size}, {args.steps} timed steps after {args.warmup} warm-up = {any_side['tokens']} "
              f"trained tokens; AdamW lr {args.lr}; LoRA r {args.rank} alpha {args.alpha} on {', '.join(targets(args))}; "
              f"{args.repeats} to {args.max_repeats} pairs of child processes per mode")
    print("\n| mode | side | trainable params | tokens/s median (min–max) | fedsilo/bare pair ratio median (min–max) | "
          "tokens per CPU-second median (min–max) | CPU pair ratio median (min–max) | process-tree peak MiB | "
          "training peak above start MiB | mean loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        for side in SIDES:
            s = r[side]
            ratio, cpu_ratio = ((f"{r['pair_ratio_median']:.3f} ({r['wall_interval'][0]:.3f}–{r['wall_interval'][1]:.3f})",
                                 f"{r['pair_cpu_ratio_median']:.3f} ({r['cpu_interval'][0]:.3f}–{r['cpu_interval'][1]:.3f})")
                                if side == "fedsilo" else ("", ""))
            print(f"| {mode} | {side} | {s['trainable']:,} | {s['median_tokens_per_s']:.0f} ({s['min_tokens_per_s']:.0f}–"
                  f"{s['max_tokens_per_s']:.0f}) | {ratio} | {s['median_tokens_per_cpu_s']:.0f} ({s['min_tokens_per_cpu_s']:.0f}–"
                  f"{s['max_tokens_per_cpu_s']:.0f}) | {cpu_ratio} | {s['median_tree_peak_mib']:.0f} | "
                  f"{s['median_train_peak_delta_mib']:.1f} | {s['mean_loss']:.5f} |")
    print(f"\ngoal: fedsilo/bare >= {GOAL} in tokens/s and in tokens per CPU-second; spread = min..max of the per-pair "
          "ratios")
    for mode, r in results.items():
        n = r["pairs"]
        print(f"{mode}: {n} pairs; wall median {r['pair_ratio_median']:.3f}, spread {r['wall_interval'][0]:.3f}–"
              f"{r['wall_interval'][1]:.3f}: {r['wall_verdict']}; CPU median {r['pair_cpu_ratio_median']:.3f}, spread "
              f"{r['cpu_interval'][0]:.3f}–{r['cpu_interval'][1]:.3f}: {r['cpu_verdict']} (min..max of {n} pairs covers "
              f"the median pair ratio with probability {r['interval_coverage']:.1%}); mean losses "
              f"{'equal' if r['losses_equal'] else 'DIFFER'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": command, "date": date,
            "machine": {"cpu_count": os.cpu_count(), "load_average_start": load_start, "load_average_end": load_end},
            "model": {"name": model_name, "folder": str(folder) if folder else None, "params": params},
            "goal": GOAL, "spread": "min..max of the per-pair ratios",
            "args": {k: getattr(args, k) for k in (*KNOBS, "repeats", "max_repeats", "modes")},
            "results": results}, indent=2))


if __name__ == "__main__":
    main()
