"""What one parallel-client job pays to move tensors between the parent and a worker: the round's
global tensors in, the update out, through shared memory (`engines.workers.share`, today) or as
safetensors bytes (before issue 24), alternating the two on one forked worker.

    python bench/worker_ipc.py [--repeats 8]

The tensors have MiniLM-L6's shapes (22.7M float32 values in 101 tensors, 87 MiB); the worker copies
what it receives into its own model, changes it, and sends it back; the parent reads every tensor.
Prints per-job seconds (median) for each way and their ratio.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from safetensors.torch import load, save

from fedsilo.engines.workers import share, unshare

_MODEL: dict[str, torch.Tensor] = {}


def minilm_like() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"embeddings": torch.randn(30522, 384, generator=gen)}
    for layer in range(6):
        for name, shape in (("q", (384, 384)), ("k", (384, 384)), ("v", (384, 384)), ("o", (384, 384)),
                            ("ffn_in", (1536, 384)), ("ffn_out", (384, 1536))):
            tensors[f"{layer}.{name}.weight"] = torch.randn(*shape, generator=gen)
            tensors[f"{layer}.{name}.bias"] = torch.randn(shape[0], generator=gen)
    return tensors


def _init() -> None:
    torch.set_num_threads(1)
    _MODEL.update({k: v.clone() for k, v in minilm_like().items()})


def _train(received: dict[str, torch.Tensor]) -> None:
    for name, t in received.items():
        _MODEL[name].copy_(t).add_(1e-3)


def job_shared(payload):
    _train(unshare(payload))
    return share(_MODEL)


def job_bytes(payload: bytes) -> bytes:
    _train(load(payload))
    return save(_MODEL)


def one_job(pool: ProcessPoolExecutor, way: str, params: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    if way == "shared memory":
        update = unshare(pool.submit(job_shared, share(params)).result())
    else:
        update = load(pool.submit(job_bytes, save(params)).result())
    total = sum(float(t.double().sum()) for t in update.values())  # the parent reads every value
    assert total == total
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    params = minilm_like()
    seconds: dict[str, list[float]] = {"bytes": [], "shared memory": []}
    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork"), initializer=_init) as pool:
        pool.submit(time.sleep, 0).result()
        for _ in range(args.repeats):
            for way in seconds:
                seconds[way].append(one_job(pool, way, params))
    med = {way: statistics.median(v) for way, v in seconds.items()}
    for way, v in seconds.items():
        print(f"{way}: median {med[way]:.3f} s per job (min {min(v):.3f}, max {max(v):.3f}, {len(v)} jobs)")
    print(f"shared memory / bytes: {med['shared memory'] / med['bytes']:.3f}")


if __name__ == "__main__":
    main()
