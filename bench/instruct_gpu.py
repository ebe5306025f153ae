"""Instruction tuning on a GPU at 0.5–1B parameters: fedsilo's client round vs a bare transformers + peft loop,
bf16 + LoRA and 4-bit QLoRA.

No pretrained decoder is obtainable here, so the bench writes one: a Llama-architecture checkpoint with
random weights (default hidden 2048, intermediate 5632, 16 layers, 16 heads, vocab 32000: about 0.95B
parameters, untied head) and the instruct task's byte-level BPE, saved in a folder; both sides load that folder, as a
user's local checkpoint is loaded. The records are one silo's (default Code Alpaca), tokenised once by the
instruct task (completion-only labels), batched in the same order (fedsilo's length_grouped order for the
silo's round seed, replayed, as bench/instruct_throughput.py), AdamW, clipping at 1.0. Configurations:
- bf16-lora: fp32 weights, bf16 autocast, LoRA on q_proj/v_proj (fedsilo's `model.precision = "bf16"`);
  sides: fedsilo (SiloClient.fit), bare (the same numerics: from_pretrained fp32, get_peft_model, autocast)
  and bare-bf16-weights (the weights loaded in bf16, as many hand-written recipes do: shows what keeping
  fp32 weights costs, not an overhead of fedsilo's);
- qlora: NF4 weights with double quantisation and bf16 compute (bitsandbytes), prepare_model_for_kbit_training,
  LoRA adapters in fp32, bf16 autocast (fedsilo's `model.quantization = "4bit"`); sides: fedsilo, bare.
Only the optimiser steps after `--warmup` are timed (a device sync at both ends); peak GPU memory is
torch.cuda.max_memory_allocated over the training, weights included. Sides alternate per repeat in one
process; each measurement loads the checkpoint afresh and frees it after.

    python bench/instruct_gpu.py --json bench/results/instruct_gpu.json          # on a CUDA GPU
    python bench/instruct_gpu.py --cpu-smoke                                     # plumbing only, tiny, CPU
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from instruct_throughput import batch_plan

CONFIGS = {"bf16-lora": ("fedsilo", "bare", "bare-bf16-weights"), "qlora": ("fedsilo", "bare")}
SMOKE = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 4, "vocab": 1000, "max_train": 16,
         "max_length": 128, "batch_size": 2, "steps": 2, "warmup": 1, "repeats": 1}


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def write_checkpoint(args, folder: Path, device: torch.device) -> None:
    """A random-init Llama of the asked size and the instruct task's tokenizer, saved as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedsilo.recipe import task_tokenizer

    tokenizer = task_tokenizer(run_config(args, None, "fp32", None))()
    config = LlamaConfig(vocab_size=max(args.vocab, len(tokenizer)), hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    free(device)


def run_config(args, checkpoint: Path | None, precision: str, quantization: str | None, lora: bool = True):
    """The run's config: the instruct task on one silo; the model the checkpoint folder (None: only the
    task's tokenizer settings matter)."""
    from fedsilo.config import validate
    model = {"device": args.device, "precision": precision, "gradient_checkpointing": args.gradient_checkpointing}
    if checkpoint is not None:
        model["name"] = str(checkpoint)
    if quantization:
        model["quantization"] = quantization
    if lora:
        model["surgery"] = [{"name": "lora", "options": {"rank": args.rank, "alpha": args.alpha,
                                                          "target_modules": ["q_proj", "v_proj"]}}]
    task = {"name": "instruct", "silos": [args.silo], "max_train": args.max_train, "max_eval": 1,
            "max_length": args.max_length}
    if checkpoint is None:
        task["vocab_size"] = args.vocab
    return validate({"seed": 0, "task": task, "model": model,
                     "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": args.batch_size,
                                "steps": args.warmup + args.steps, "max_grad_norm": 1.0}})


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fedsilo_side(cfg, device: torch.device, warmup: int) -> dict:
    from fedsilo.client.silo import SiloClient, federated_parameters
    from fedsilo.client.store import MemoryStore
    from fedsilo.recipe import build_model, build_task, silo_recipe
    from fedsilo.tasks.tokens import row_length

    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    silo = task.clients[0]
    client = SiloClient(silo, task, task.examples(silo, "train"), model, MemoryStore(),
                        silo_recipe(cfg.client_config(silo), index=0, precision=cfg.model.precision))
    plan = batch_plan(cfg, [row_length(r) for r in client.rows])
    tokens = sum(len(client.rows[i]["input_ids"]) for b in plan[warmup:] for i in b)
    received = {k: p.detach().clone() for k, p in federated_parameters(model).items()}
    marks, done = [], 0

    def on_step() -> None:
        nonlocal done
        done += 1
        if done in (warmup, len(plan)):
            marks.append(clock(device))

    reset_peak(device)
    update = client.fit(1, received, cfg.seed, on_step=on_step)
    return {"seconds": marks[1] - marks[0], "tokens": tokens, "mean_loss": update.mean_loss,
            "peak_gib": peak(device), "trainable": sum(p.numel() for p in federated_parameters(model).values())}


def bare_side(cfg, device: torch.device, warmup: int, weights_bf16: bool) -> dict:
    """transformers + peft as a user writes it, on the same checkpoint, batches and optimiser."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from fedsilo.models.lora import lora_settings
    from fedsilo.recipe import build_task
    from fedsilo.tasks.tokens import row_length

    m = cfg.model
    tokenizer = AutoTokenizer.from_pretrained(m.name)
    task = build_task(cfg, tokenizer)
    rows = task.tokenize(task.examples(task.clients[0], "train"))
    plan = batch_plan(cfg, [row_length(r) for r in rows])
    batches = [{k: v.to(device) for k, v in task.pad([rows[i] for i in b]).items()} for b in plan]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:])
    if m.quantization == "4bit":
        model = AutoModelForCausalLM.from_pretrained(m.name, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16), device_map={"": device.index or 0}, dtype=torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=m.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model = AutoModelForCausalLM.from_pretrained(m.name, dtype=torch.bfloat16 if weights_bf16 else torch.float32)
        model.to(device)
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = lora_settings(m)
    model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                             target_modules=lora.target_modules, bias="none"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.client.lr, weight_decay=cfg.client.weight_decay)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=m.precision == "bf16")
    reset_peak(device)
    model.train()
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        if i == warmup:
            start = clock(device)
        with amp:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.client.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach().float()
    stop = clock(device)
    return {"seconds": stop - start, "tokens": tokens, "mean_loss": float(loss_sum) / len(batches),
            "peak_gib": peak(device), "trainable": sum(p.numel() for p in params)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def skip_reason(config: str, device: torch.device) -> str | None:
    if config != "qlora":
        return None
    if device.type != "cuda":
        return "qlora skipped: bitsandbytes' 4-bit kernels need a CUDA GPU"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "qlora skipped: bitsandbytes is not installed (pip install fedsilo[gpu])"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, fp32: checks the plumbing only")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--silo", default="codealpaca")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary (the tokenizer is fitted to it)")
    ap.add_argument("--max-train", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed optimiser steps per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (at least 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the clock starts at the end of warmup)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in configs if c not in CONFIGS]:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if args.cpu_smoke:
        vars(args).update(SMOKE)
        args.device = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("bench/instruct_gpu.py: no CUDA GPU here (torch sees none); run it on a GPU, or pass --cpu-smoke "
                 "to check its plumbing at a tiny size")
    else:
        args.device = "cuda"
    device = torch.device(args.device)
    precision = "fp32" if args.cpu_smoke else "bf16"

    command = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    print(f"command: {command}\ndevice: {device_name}\ntorch: {torch.__version__}\ndate: {date}", flush=True)
    results, notes = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        write_checkpoint(args, checkpoint, device)
        n_params = param_count(checkpoint)
        print(f"model: random-init Llama {n_params / 1e6:,.1f}M params (hidden {args.hidden}, intermediate "
              f"{args.intermediate}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}); "
              f"silo {args.silo} {args.max_train} records, max {args.max_length} tokens, batch {args.batch_size}; "
              f"{args.steps} timed steps after {args.warmup}; LoRA r {args.rank} alpha {args.alpha}; "
              f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}", flush=True)
        for config in configs:
            if reason := skip_reason(config, device):
                notes.append(reason)
                continue
            cfg = run_config(args, checkpoint, precision, "4bit" if config == "qlora" else None)
            sides = CONFIGS[config]
            runs = {s: [] for s in sides}
            for rep in range(args.repeats):
                for side in sides if rep % 2 == 0 else sides[::-1]:
                    r = fedsilo_side(cfg, device, args.warmup) if side == "fedsilo" else \
                        bare_side(cfg, device, args.warmup, side == "bare-bf16-weights")
                    free(device)
                    r["tokens_per_s"] = r["tokens"] / r["seconds"]
                    runs[side].append(r)
                    print(f"  {config} repeat {rep + 1}: {side:18s} {r['tokens_per_s']:9.0f} tokens/s  peak "
                          f"{_gib(r['peak_gib'])} GiB  mean loss {r['mean_loss']:.4f}", flush=True)
            results[config] = {s: {"runs": rs, "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                                   "peak_gib": max((r["peak_gib"] or 0) for r in rs) or None}
                               for s, rs in runs.items()}
            results[config]["ratio"] = results[config]["fedsilo"]["median_tokens_per_s"] / \
                results[config]["bare"]["median_tokens_per_s"]

    print("\n| config | side | tokens/s (median) | fedsilo/side | peak GPU GiB | mean loss |")
    print("|---|---|---:|---:|---:|---:|")
    for config, r in results.items():
        for side in CONFIGS[config]:
            s = r[side]
            ratio = "" if side == "fedsilo" else f"{r['fedsilo']['median_tokens_per_s'] / s['median_tokens_per_s']:.3f}"
            print(f"| {config} | {side} | {s['median_tokens_per_s']:.0f} | {ratio} | {_gib(s['peak_gib'])} | "
                  f"{s['runs'][0]['mean_loss']:.4f} |")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "device": device_name, "torch": torch.__version__,
                                         "date": date, "params": n_params, "args": {k: str(v) if isinstance(v, Path) else v
                                                                       for k, v in vars(args).items()}, "results": results,
                                         "notes": notes}, indent=2))


def param_count(folder: Path) -> int:
    """Parameters in a checkpoint folder's safetensors files, read from their headers."""
    from safetensors import safe_open
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
