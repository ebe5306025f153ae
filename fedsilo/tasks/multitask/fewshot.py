"""Few-shot samples as CrossFit draws them (Gao et al. 2021's protocol), with the test few-shot too.

For one seed, CrossFit shuffles the train pool with numpy's legacy generator seeded by the seed and
takes, per class in first-seen order, the first k as train and the next k as dev (classification),
or the first k and the next k of the whole pool (text-to-text). Where the pools are CrossFit's own
train lines, the train and dev samples are CrossFit's. The FewFedWeight paper makes the test
few-shot as well ("our test sets also followed the same few-shot setting"): the test pool is
shuffled with the same seed and sampled the same way. A test record whose input is also a sampled
train or dev input is passed over (sources repeat some texts across their splits).

Several seeds "collectively construct the training set and test set" (the paper): each split is the
union of the seeds' samples, a record counted once, and dev and test keep out what train (and dev)
already hold. Samples of different seeds are independent draws from one pool, so they overlap.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .catalog import Pools, Record

CROSSFIT_SEEDS = (100, 13, 21, 42, 87)
K_PER_CLASS = 16   # classification: per class
K_TOTAL = 32       # every other task: in total


@dataclass(frozen=True)
class FewShot:
    train: list[Record]
    dev: list[Record]
    test: list[Record]


def _shuffled(records: Sequence[Record], seed: int) -> list[Record]:
    order = list(range(len(records)))
    np.random.RandomState(seed).shuffle(order)  # = np.random.seed(seed); np.random.shuffle(lines)
    return [records[i] for i in order]


def _by_class(records: Sequence[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.outputs[0], []).append(r)
    return groups


def _take(records: Sequence[Record], per_class: bool, start: int, k: int) -> list[Record]:
    """records[start:start+k], per class (classes in first-seen order) or in total."""
    if not per_class:
        return list(records[start:start + k])
    return [r for group in _by_class(records).values() for r in group[start:start + k]]


def sample(pools: Pools, per_class: bool, k: int, seed: int) -> FewShot:
    """One seed's train, dev and test samples (k per class, or k in total)."""
    train_pool = _shuffled(pools.train, seed)
    train = _take(train_pool, per_class, 0, k)
    dev = _take(train_pool, per_class, k, k)
    seen = {r.input for r in (*train, *dev)}
    test_pool = [r for r in _shuffled(pools.test, seed) if r.input not in seen]
    return FewShot(train, dev, _take(test_pool, per_class, 0, k))


def sample_seeds(pools: Pools, per_class: bool, k: int, seeds: Sequence[int]) -> FewShot:
    """The union of several seeds' samples, each record once; dev and test keep out train's inputs
    (and test dev's)."""
    draws = [sample(pools, per_class, k, s) for s in seeds]
    train = _unique(r for d in draws for r in d.train)
    taken = {r.input for r in train}
    dev = [r for r in _unique(r for d in draws for r in d.dev) if r.input not in taken]
    taken |= {r.input for r in dev}
    test = [r for r in _unique(r for d in draws for r in d.test) if r.input not in taken]
    return FewShot(train, dev, test)


def _unique(records) -> list[Record]:
    return list(dict.fromkeys(records))
