"""The order in which a client's examples are batched: one policy axis, seeded per epoch.

An order is a permutation of example indices; batches are its consecutive runs of `batch_size`, so
every policy visits each example exactly once per epoch and yields the same number of batches.

`length_grouped` (the default) cuts padding: a shuffled permutation is split into windows of
`window` batches, each window is sorted by length and cut into batches, and the batches of the whole
epoch are shuffled (so long batches do not all come first). `shuffle` is a plain random permutation
(the Hugging Face Trainer's random sampler, which the Lorar authors' runs used).
Evaluation has no randomness: `fedsilo.tasks.tokens.sorted_batches` runs examples from the longest down.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedsilo.registry import Registry

BatchOrder = Callable[[Sequence[int], int, torch.Generator, int], list[int]]
BATCH_ORDERS: Registry[BatchOrder] = Registry("batch order")


def default_window(n_examples: int, batch_size: int) -> int:
    """Batches per sorted window: the Hugging Face Trainer's rule for `group_by_length`
    (n / (4·batch), at most 50), so a small silo still gets several windows of fresh batches."""
    return max(1, min(n_examples // (4 * batch_size), 50))


@BATCH_ORDERS.register("shuffle")
def shuffled(lengths: Sequence[int], batch_size: int, rng: torch.Generator, window: int = 0) -> list[int]:
    return torch.randperm(len(lengths), generator=rng).tolist()


@BATCH_ORDERS.register("length_grouped")
def length_grouped(lengths: Sequence[int], batch_size: int, rng: torch.Generator, window: int = 50) -> list[int]:
    """Batches of similar length: sorted inside shuffled windows of `window` batches, then shuffled."""
    order = torch.randperm(len(lengths), generator=rng).tolist()
    span = max(1, window) * batch_size
    batches: list[list[int]] = []
    for w in range(0, len(order), span):
        ranked = sorted(order[w:w + span], key=lambda i: -lengths[i])  # stable: ties keep the shuffle
        batches += [ranked[s:s + batch_size] for s in range(0, len(ranked), batch_size)]
    # The epoch's one short batch (if any) stays last, as in a plain permutation: batch count and
    # gradient-accumulation boundaries do not depend on the policy.
    full = [b for b in batches if len(b) == batch_size]
    short = [b for b in batches if len(b) < batch_size]
    shuffled_full = [full[i] for i in torch.randperm(len(full), generator=rng).tolist()]
    return [i for b in shuffled_full + short for i in b]


def padding_share(lengths: Sequence[int], order: Sequence[int], batch_size: int) -> float:
    """Padded positions / all positions when batches of `order` pad to their longest member."""
    real = padded = 0
    for s in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[s:s + batch_size]]
        real += sum(batch)
        padded += max(batch) * len(batch)
    return 1.0 - real / padded if padded else 0.0
