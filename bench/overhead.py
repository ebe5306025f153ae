"""Engine overhead: the same local steps through fedsilo's in-process engine vs a bare PyTorch loop.

Both sides train the same model from the same weights on the same batches in the same order with
the same optimiser; fedsilo adds what federation costs (loading the global tensors, loss logging,
deltas, the server's safeguards, streaming Lorar aggregation, the server optimiser, byte accounting). Runs are interleaved
(A B A B ...) so machine noise hits both; the ratio of medians is reported.

    python bench/overhead.py [--repeats 3] [--rounds 2] [--max-train 32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedsilo.client.silo import SiloClient, client_seed
from fedsilo.client.optim import CLIENT_OPTIMIZERS
from fedsilo.client.store import MemoryStore
from fedsilo.config import validate
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.engines.local import run_round
from fedsilo.recipe import build_model, build_task, silo_recipe
from fedsilo.core.rounds import Limits
from fedsilo.server import Server, ServerRecipe


def fedsilo_engine(model, task, cfg, init, rounds):
    model.load_state_dict(init)
    params = dict(model.named_parameters())
    f = cfg.federation  # the default safeguards: size bounds, the update-norm guard, the tried server step
    server = Server({k: v.detach() for k, v in params.items()},
                    ServerRecipe(ServerOptimizer("sgdm"), WEIGHTINGS.resolve("lorar"),
                                 limits=Limits(max_update_ratio=f.max_update_ratio, clip_norm=f.clip_norm)))
    server.register({s: len(task.examples(s, "train")) for s in task.clients})
    store = MemoryStore()
    clients = {s: SiloClient(s, task, task.examples(s, "train"), model, store, silo_recipe(cfg.client_config(s), index=i))
               for i, s in enumerate(task.clients)}
    for r in range(1, rounds + 1):
        run_round(server, clients, list(clients), r, cfg.seed)


def bare_loop(model, task, cfg, init, rounds):
    """What a user would write by hand: per silo, per round, plain training steps."""
    model.load_state_dict(init)
    for r in range(1, rounds + 1):
        for i, silo in enumerate(task.clients):
            c = cfg.client_config(silo)
            examples = task.examples(silo, "train")
            seed = client_seed(cfg.seed, r, i)
            torch.manual_seed(seed)
            gen = torch.Generator().manual_seed(seed)
            opt = CLIENT_OPTIMIZERS.get(c.optimizer)([p for p in model.parameters() if p.requires_grad], c.lr, 0.0)
            model.train()
            for _ in range(c.epochs):
                order = torch.randperm(len(examples), generator=gen).tolist()
                for j in range(0, len(order), c.batch_size):
                    loss = model(**task.collate([examples[k] for k in order[j:j + c.batch_size]])).loss
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
                    opt.step()
            model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-train", type=int, default=32)
    args = ap.parse_args()
    cfg = validate({"task": {"silos": ["geography", "restaurants", "scholar", "academic"],
                             "max_train": args.max_train, "max_source_length": 128, "max_target_length": 96},
                    "client": {"epochs": 1, "batch_size": 8, "lr": 3e-3}})
    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    steps = args.rounds * sum(-(-len(task.examples(s, "train")) // 8) for s in task.clients)
    times = {"fedsilo": [], "bare": []}
    for rep in range(args.repeats):
        for name, fn in (("fedsilo", fedsilo_engine), ("bare", bare_loop)) if rep % 2 == 0 else \
                        (("bare", bare_loop), ("fedsilo", fedsilo_engine)):
            t = time.perf_counter()
            fn(model, task, cfg, init, args.rounds)
            times[name].append(time.perf_counter() - t)
            print(f"  repeat {rep + 1}: {name:8s} {times[name][-1]:.2f}s", flush=True)
    fed, bare = statistics.median(times["fedsilo"]), statistics.median(times["bare"])
    print(f"model: tiny-t5, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
          f"{len(task.clients)} silos x {args.rounds} rounds = {steps} local steps per run; threads {torch.get_num_threads()}")
    print(f"median wall time: fedsilo {fed:.2f}s, bare loop {bare:.2f}s")
    print(f"overhead ratio fedsilo/bare = {fed / bare:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
