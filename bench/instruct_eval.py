"""Evaluating a real decoder before and after issue 51, side by side: the same test records, the same
model, fedsilo's instruct evaluation as it was (a checkout of the commit before, default 5f856b6) and as
it is (this checkout).

Before: multiple choice scored one record at a time, each option a pass over prompt + option (three
passes over a PubMedQA abstract, besides the loss pass); GSM8K answers generated in chunks of
eval_batch_size in the split's order. After: the options read off the loss pass (one-token options) or
batched by prompt length, answers generated in chunks sorted by prompt length, and every answer kept.
Each side runs in a child process of its own (`--child`, the checkout first on sys.path), alternating
before / after / after / before ... with `--repeats`; each times `task.evaluate(model, silo, "test",
final=True)` per silo after building the model and task (outside the clock), wall and CPU seconds of
the process. The statistics both sides give are compared: the speed-up must not change a score.

    python bench/instruct_eval.py --json bench/results/instruct_eval.json        # SmolLM2, 16 records a silo
    python bench/instruct_eval.py --max-eval 4 --max-new-tokens 16 --repeats 1     # smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATS = ("loss_sum", "loss_n", "mc_hit", "mc_n", "em_hit", "em_n")


def child(args) -> None:
    """One side: build the model and task from `args.src`'s fedsilo, time each silo's final test evaluation."""
    sys.path.insert(0, str(Path(args.src).resolve()))
    import warnings

    import torch

    from fedsilo.config import validate
    from fedsilo.recipe import build_model, build_task

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    cfg = validate({"name": "eval", "task": {"name": "instruct", "silos": args.silos.split(","), "max_train": 1,
                                             "max_eval": args.max_eval, "max_length": args.max_length,
                                             "truncation": "prompt_start", "max_new_tokens": args.max_new_tokens,
                                             "eval_batch_size": args.eval_batch_size},
                    "model": {"kind": "causal", "name": args.folder}})
    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    out = {}
    for silo in task.clients:
        task.rows((silo, "test"), task.examples(silo, "test"))  # tokenised outside the clock, as a run's cache does
        wall, cpu = time.perf_counter(), time.process_time()
        row, = task.evaluate(model, silo, "test", final=True)
        out[silo] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                     "stats": {k: row["stats"].get(k) for k in STATS}}
    print(json.dumps(out))


def checkout(commit: str) -> Path:
    """A worktree of `commit` (made once, reused)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fedsilo-before-{commit[:12]}"
    if not (path / "fedsilo").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def measure(side_src: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--src", str(side_src), "--folder", args.folder, "--silos", args.silos,
           "--max-eval", str(args.max_eval), "--max-length", str(args.max_length), "--max-new-tokens",
           str(args.max_new_tokens), "--eval-batch-size", str(args.eval_batch_size), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode:
        sys.exit(f"instruct_eval: the {side_src} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in pretrained name or a checkpoint folder")
    ap.add_argument("--before", default="5f856b6", help="the commit evaluated as 'before'")
    ap.add_argument("--silos", default="gsm8k,pubmedqa,codealpaca")
    ap.add_argument("--max-eval", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--eval-batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="pairs, alternating before/after, after/before, ...")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from fedsilo.models.pretrained import PRETRAINED, pretrained_folder

    # the folder, not the name: the commit before knows no built-in pretrained model
    args.folder = str(pretrained_folder(args.model) if args.model in PRETRAINED else Path(args.model).resolve())
    sides = {"before": checkout(args.before), "after": ROOT}
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.repeats):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[side].append(measure(sides[side], args))
            print(f"{side} {r + 1}: " + ", ".join(f"{s} {v['wall']:.1f}s" for s, v in runs[side][-1].items()),
                  flush=True)
    load.append(os.getloadavg()[0])
    silos = list(runs["after"][0])
    table, same = [], True
    for silo in silos + ["all"]:
        pick = (lambda run, key: sum(v[key] for v in run.values())) if silo == "all" else \
            (lambda run, key, s=silo: run[s][key])
        before = statistics.median(pick(x, "wall") for x in runs["before"])
        after = statistics.median(pick(x, "wall") for x in runs["after"])
        cpu_b = statistics.median(pick(x, "cpu") for x in runs["before"])
        cpu_a = statistics.median(pick(x, "cpu") for x in runs["after"])
        equal = silo == "all" or all(_close(a[silo]["stats"], b[silo]["stats"])
                                     for a in runs["after"] for b in runs["before"])
        same &= equal
        table.append({"silo": silo, "before_s": before, "after_s": after, "speedup": before / after,
                      "before_cpu_s": cpu_b, "after_cpu_s": cpu_a, "cpu_speedup": cpu_b / cpu_a,
                      "same_scores": equal})
    print(f"\n{'silo':<12}{'before s':>10}{'after s':>10}{'speed-up':>10}{'CPU-s before':>14}{'CPU-s after':>13}"
          f"{'CPU speed-up':>14}  same scores")
    for t in table:
        print(f"{t['silo']:<12}{t['before_s']:>10.1f}{t['after_s']:>10.1f}{t['speedup']:>9.2f}x{t['before_cpu_s']:>14.1f}"
              f"{t['after_cpu_s']:>13.1f}{t['cpu_speedup']:>13.2f}x  {'yes' if t['same_scores'] else 'NO'}")
    print(f"load average (1 min) {load[0]:.2f} at the start, {load[1]:.2f} at the end; {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(map(shlex.quote, sys.argv)), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "load": load, "model": args.model, "before": args.before,
            "settings": {k: getattr(args, k) for k in ("silos", "max_eval", "max_length", "max_new_tokens",
                                                       "eval_batch_size", "threads", "repeats")},
            "table": table, "runs": runs}, indent=2) + "\n")
    return 0 if same else 1


def _close(a: dict, b: dict) -> bool:
    """The same scores: hits and counts equal, summed losses to 1e-4 relative (batch shapes differ)."""
    for key in STATS:
        x, y = a.get(key), b.get(key)
        if (x is None) != (y is None):
            return False
        if x is not None and (abs(x - y) > 1e-4 * max(1.0, abs(x)) if key == "loss_sum" else x != y):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
