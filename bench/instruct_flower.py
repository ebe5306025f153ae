"""One instruction-tuning round: fedsilo's engines vs a FlowerTune-style app on Flower's own API.

The workload: three instruct silos (GSM8K, PubMedQA, Code Alpaca), the built-in tiny-llama with LoRA on
q_proj/v_proj, AdamW, the same batch size, steps per client and gradient clipping, one round. Engines:
- fedsilo-local: fedsilo's in-process engine (`run_experiment`);
- fedsilo-flower-sim: fedsilo on Flower's simulation engine (`run_simulation`);
- flowertune-sim: an app written as Flower's FlowerTune LLM template writes one (flwr 1.41 Message
  API: a `ServerApp` running `flwr.serverapp.strategy.FedAvg` over the peft adapters'
  `get_peft_model_state_dict`, a `ClientApp` whose `@app.train()` loads the model from a checkpoint
  folder, wraps it with `get_peft_model`, sets the received adapters, trains and replies with its
  adapters), run by `flwr.simulation.run_simulation`. FlowerTune trains with trl's SFTTrainer (trl is
  not installed here), so its client runs a plain loop: seeded shuffle, right padding, the transformers
  loss over completion-only labels. Its data are the instruct task's own tokenised records of each silo
  (written once before the simulation: a FlowerTune app loads its partition), its base weights
  fedsilo's tiny-llama for the seed (saved with `save_pretrained`).
Each engine runs in a fresh child process, alternating across repeats; the parent samples the child's
process tree (Ray's workers included) every 0.2 s for peak RSS (bench/flower_engines.py). Reported:
the round's seconds (fedsilo: rounds.jsonl, which leaves evaluation out; the FlowerTune app: around
`strategy.start` with federated and central evaluation off), the child's wall time and its peak memory,
and their ratios to fedsilo-local. Clients get one CPU each in every engine (fedsilo's in-process pool:
one thread per client; Flower: `client_resources.num_cpus = 1`).

    python bench/instruct_flower.py --json bench/results/instruct_flower.json
    python bench/instruct_flower.py --max-train 16 --steps 2 --repeats 1 --vocab-size 1000   # smoke run
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
import time
from pathlib import Path

ENGINES = ("fedsilo-local", "fedsilo-flower-sim", "flowertune-sim")
SILOS = ("gsm8k", "pubmedqa", "codealpaca")


def run_config(args, name: str, lora: bool = True):
    from fedsilo.config import validate
    model = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads,
             "dropout": 0.0, "device": "cpu"}
    if lora:
        model["surgery"] = [{"name": "lora", "options": {"rank": args.rank, "alpha": args.alpha,
                                                          "target_modules": ["q_proj", "v_proj"]}}]
    return validate({
        "name": name, "seed": 0,
        "task": {"name": "instruct", "silos": list(SILOS), "max_train": args.max_train, "max_eval": args.max_eval,
                 "max_length": args.max_length, "max_new_tokens": 8, "vocab_size": args.vocab_size},
        "model": model,
        "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": args.batch_size, "steps": args.steps,
                   "max_grad_norm": 1.0},
        "federation": {"rounds": 1},
        "flower": {"num_cpus": 1, "connect_timeout": 1800},  # a loaded machine is slow to describe its silos
    })


# ---- the FlowerTune-style app (Flower's API, transformers and peft only) ---------------------------

def get_model(spec: dict):
    """FlowerTune's `get_model`: the causal LM from its folder, wrapped by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    return get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"], bias="none"))


_PARTITIONS: dict[str, list] = {}  # per worker process, as FlowerTune caches its FederatedDataset


def load_partition(spec: dict, partition_id: int) -> list:
    import torch
    silo = spec["silos"][partition_id]
    if silo not in _PARTITIONS:
        _PARTITIONS[silo] = torch.load(Path(spec["data_dir"]) / f"{silo}.pt")
    return _PARTITIONS[silo]


def collate(rows: list, pad_id: int) -> dict:
    import torch
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id)
    labels = torch.full((len(rows), length), -100)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def make_client_app():
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        import torch
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        spec = json.loads(Path(msg.content["config"]["spec"]).read_text())
        partition_id = int(context.node_config["partition-id"])
        rows = load_partition(spec, partition_id)
        model = get_model(spec)
        set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=spec["lr"])
        gen = torch.Generator().manual_seed(1000 * int(msg.content["config"]["server-round"]) + partition_id)
        order: list[int] = []
        model.train()
        losses = []
        for _ in range(spec["steps"]):
            if len(order) < spec["batch_size"]:
                order += torch.randperm(len(rows), generator=gen).tolist()
            batch, order = order[:spec["batch_size"]], order[spec["batch_size"]:]
            loss = model(**collate([rows[i] for i in batch], spec["pad_id"])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        content = RecordDict({"arrays": ArrayRecord(get_peft_model_state_dict(model)),
                              "metrics": MetricRecord({"train_loss": sum(losses) / len(losses),
                                                       "num-examples": len(rows)})})
        return Message(content=content, reply_to=msg)

    return app


def make_server_app(spec_path: Path, result: Path):
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from peft import get_peft_model_state_dict
        spec = json.loads(spec_path.read_text())
        arrays = ArrayRecord(get_peft_model_state_dict(get_model(spec)))
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=len(spec["silos"]),
                          min_available_nodes=len(spec["silos"]))
        start = time.perf_counter()
        strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"spec": str(spec_path)}),
                       num_rounds=1)
        result.write_text(json.dumps({"round": time.perf_counter() - start}))

    return app


def flowertune(args, out: Path) -> None:
    """Prepare what a FlowerTune app starts from (a checkpoint folder, each silo's tokenised
    partition), then run it in Flower's simulation engine."""
    import torch
    from flwr.simulation import run_simulation

    from fedsilo.recipe import build_model, build_task

    cfg = run_config(args, "flowertune", lora=False)
    model, tokenizer = build_model(cfg)
    model.save_pretrained(out / "model")
    task = build_task(cfg, tokenizer)
    (out / "data").mkdir()
    for silo in task.clients:
        torch.save(task.tokenize(task.examples(silo, "train")), out / "data" / f"{silo}.pt")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(out / "model"), "data_dir": str(out / "data"), "silos": task.clients,
                                "pad_id": task.pad_id, "rank": args.rank, "alpha": args.alpha, "lr": args.lr,
                                "steps": args.steps, "batch_size": args.batch_size}))
    del model, task
    run_simulation(server_app=make_server_app(spec, out / "round.json"), client_app=make_client_app(),
                   num_supernodes=len(SILOS),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False}})


def child(engine: str, out: Path, args) -> None:
    import warnings
    warnings.simplefilter("ignore")  # truncation notes, once per silo: not what is measured
    if engine == "flowertune-sim":
        flowertune(args, out)
        return
    cfg = run_config(args, engine)
    if engine == "fedsilo-local":
        from fedsilo.runs.runner import run_experiment
        run_experiment(cfg, out / "run", show_progress=False)
    else:
        from fedsilo.runs.flower import run_simulation
        run_simulation(cfg, out / "run", show_progress=False)


# ---- the parent ----------------------------------------------------------------------------------

KNOBS = ("max_train", "max_eval", "max_length", "vocab_size", "d_model", "d_ff", "layers", "heads", "batch_size",
         "steps", "lr", "rank", "alpha")


def measure(engine: str, args) -> dict:
    from flower_engines import run_with_peak

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, __file__, "--child", engine, "--out", str(out),
               *[a for k in KNOBS for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]]
        start = time.perf_counter()
        proc, err, peak, _ = run_with_peak(cmd, {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{engine} failed (exit {proc.returncode}):\n{err.decode()[-3000:]}")
        if engine == "flowertune-sim":
            seconds = json.loads((out / "round.json").read_text())["round"]
        else:
            rounds = [json.loads(line) for line in (out / "run" / "rounds.jsonl").read_text().splitlines()]
            seconds = rounds[0]["seconds"]
    return {"round": seconds, "wall": wall, "peak_mib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: " + ", ".join(ENGINES))
    ap.add_argument("--max-train", type=int, default=64, help="training records per silo")
    ap.add_argument("--max-eval", type=int, default=8, help="dev/test records per silo (fedsilo evaluates them)")
    ap.add_argument("--max-length", type=int, default=512, help="PubMedQA records need it: at 256 most are cut before their answer")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=344)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="optimiser steps per client in the round")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=2, help="child processes per engine")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out, args)
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := [e for e in engines if e not in ENGINES]:
        ap.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

    command = " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load = os.getloadavg()
    print(f"command: {command}\ndate: {date}\ncpu: {os.cpu_count()} cores, load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rep in range(args.repeats):
        for engine in engines if rep % 2 == 0 else engines[::-1]:
            runs[engine].append(measure(engine, args))
            r = runs[engine][-1]
            print(f"  repeat {rep + 1}: {engine:19s} round {r['round']:6.2f}s  wall {r['wall']:6.1f}s  "
                  f"peak {r['peak_mib']:6.0f} MiB", flush=True)
    results = {e: {k: statistics.median(r[k] for r in rs) for k in ("round", "wall", "peak_mib")} |
               {"runs": rs} for e, rs in runs.items()}
    base = results.get("fedsilo-local")
    for r in results.values():
        for k in ("round", "wall", "peak_mib"):
            r[f"{k}_vs_fedsilo_local"] = r[k] / base[k] if base else None
    load = os.getloadavg()
    print(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"workload: {len(SILOS)} silos x {args.max_train} records (max {args.max_length} tokens), tiny-llama d_model "
          f"{args.d_model}, d_ff {args.d_ff}, {args.layers} layers, vocab {args.vocab_size}, LoRA r {args.rank}; "
          f"{args.steps} AdamW steps of batch {args.batch_size} per client, 1 round; {args.repeats} runs per engine "
          "(medians; min–max in brackets)")
    print("\n| engine | round s | wall s | process-tree peak MiB | round ratio | wall ratio | memory ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for e, r in results.items():
        span = {k: f"{min(x[k] for x in r['runs']):.{d}f}–{max(x[k] for x in r['runs']):.{d}f}"
                for k, d in (("round", 2), ("wall", 1), ("peak_mib", 0))}
        ratios = [f"{r[f'{k}_vs_fedsilo_local']:.2f}" if base else "n/a" for k in ("round", "wall", "peak_mib")]
        print(f"| {e} | {r['round']:.2f} ({span['round']}) | {r['wall']:.1f} ({span['wall']}) | "
              f"{r['peak_mib']:.0f} ({span['peak_mib']}) | {' | '.join(ratios)} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "date": date, "cpu_count": os.cpu_count(),
                                         "args": {k: getattr(args, k) for k in (*KNOBS, "repeats", "engines")},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
