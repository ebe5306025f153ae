"""Few-shot sampling (CrossFit / Gao et al.), the few-shot test, several seeds, and task assignment."""
from collections import Counter

import numpy as np
import pytest

from fedsilo.tasks.multitask.catalog import Pools, Record, clean, split_80_20
from fedsilo.tasks.multitask.data import PAPER_CLIENTS, assign
from fedsilo.tasks.multitask.fewshot import sample, sample_seeds


def _pools(n_train=200, n_test=100, labels=("a", "b", "c")):
    train = [Record(f"train {i}", (labels[i % len(labels)],)) for i in range(n_train)]
    test = [Record(f"test {i}", (labels[i % len(labels)],)) for i in range(n_test)]
    return Pools(train, test)


def test_per_class_counts_and_disjoint_splits():
    shots = sample(_pools(), per_class=True, k=16, seed=100)
    for split in (shots.train, shots.dev, shots.test):
        assert Counter(r.outputs[0] for r in split) == {"a": 16, "b": 16, "c": 16}
    inputs = [{r.input for r in s} for s in (shots.train, shots.dev, shots.test)]
    assert not (inputs[0] & inputs[1]) and not (inputs[0] & inputs[2]) and not (inputs[1] & inputs[2])
    assert all(r.input.startswith("test") for r in shots.test)  # the test is few-shot, from the test pool


def test_text_to_text_takes_k_in_total():
    shots = sample(_pools(labels=("x", "y")), per_class=False, k=32, seed=13)
    assert (len(shots.train), len(shots.dev), len(shots.test)) == (32, 32, 32)


def test_reproduces_crossfit_classification_draw():
    """CrossFit: np.random.seed(seed); shuffle the train lines; per label (first seen) k train, next k dev."""
    pools = _pools(n_train=90)
    lines = [(r.input, r.outputs[0]) for r in pools.train]
    np.random.seed(21)
    np.random.shuffle(lines)
    by_label = {}
    for line in lines:
        by_label.setdefault(line[1], []).append(line)
    want_train = [line for label in by_label for line in by_label[label][:4]]
    want_dev = [line for label in by_label for line in by_label[label][4:8]]
    shots = sample(pools, per_class=True, k=4, seed=21)
    assert [(r.input, r.outputs[0]) for r in shots.train] == want_train
    assert [(r.input, r.outputs[0]) for r in shots.dev] == want_dev


def test_seeds_draw_different_samples():
    a, b = (sample(_pools(), per_class=True, k=16, seed=s) for s in (100, 13))
    assert {r.input for r in a.train} != {r.input for r in b.train}
    again = sample(_pools(), per_class=True, k=16, seed=100)
    assert again == a


def test_small_class_gives_what_it_has():
    pools = Pools([Record(f"t{i}", ("rare" if i < 5 else "common",)) for i in range(100)],
                  [Record(f"s{i}", ("rare" if i < 2 else "common",)) for i in range(50)])
    shots = sample(pools, per_class=True, k=16, seed=42)
    train, dev = Counter(r.outputs[0] for r in shots.train), Counter(r.outputs[0] for r in shots.dev)
    assert train["common"] == 16 and dev["common"] == 16
    assert train["rare"] + dev["rare"] == 5 and train["rare"] == 5  # the first k go to train
    assert Counter(r.outputs[0] for r in shots.test) == {"common": 16, "rare": 2}


def test_test_sample_skips_inputs_seen_in_train():
    shared = [Record(f"same {i}", ("a",)) for i in range(40)]
    pools = Pools(shared, shared + [Record(f"new {i}", ("a",)) for i in range(40)])
    shots = sample(pools, per_class=False, k=10, seed=100)
    seen = {r.input for r in shots.train + shots.dev}
    assert len(shots.test) == 10 and not (seen & {r.input for r in shots.test})


def test_several_seeds_form_the_union_without_leaks():
    pools = _pools()
    seeds = [100, 13, 21, 42, 87]
    union = sample_seeds(pools, per_class=True, k=4, seeds=seeds)
    singles = [sample(pools, per_class=True, k=4, seed=s) for s in seeds]
    assert {r for s in singles for r in s.train} == set(union.train)
    assert len(union.train) == len(set(union.train))
    assert not ({r.input for r in union.train} & {r.input for r in union.dev})
    assert not ({r.input for r in union.train + union.dev} & {r.input for r in union.test})
    assert len(union.train) > 12  # five draws of 12 overlap, but not completely


def test_split_80_20_matches_crossfit():
    records = [Record(str(i), ("x",)) for i in range(50)]
    lines = list(records)
    np.random.seed(42)
    np.random.shuffle(lines)
    train, test = split_80_20(records)
    assert train == lines[:40] and test == lines[40:]


def test_clean_removes_tabs_newlines_and_literal_backslash_n():
    assert clean(" a\tb\\nc\r\n  d ") == "a b c d"


def test_random_assignment_is_even_seeded_and_complete():
    tasks = [f"t{i}" for i in range(118)]
    got = assign(tasks, 4, seed=0)
    assert sorted(len(v) for v in got.values()) == [29, 29, 30, 30]
    assert sorted(t for v in got.values() for t in v) == sorted(tasks)
    assert assign(tasks, 4, seed=0) == got and assign(tasks, 4, seed=1) != got


def test_tasks_per_client_keeps_that_many():
    tasks = [f"t{i}" for i in range(30)]
    got = assign(tasks, 8, seed=3, tasks_per_client=2)
    assert list(got) == [f"client_{i}" for i in range(1, 9)] and all(len(v) == 2 for v in got.values())
    assert len({t for v in got.values() for t in v}) == 16
    with pytest.raises(ValueError, match="need 40 tasks"):
        assign(tasks, 8, seed=3, tasks_per_client=5)


def test_paper_assignment_keeps_table5_clients():
    available = ["glue-mrpc", "sick", "crows_pairs", "superglue-cb", "aeslc", "numer_sense"]
    got = assign(available, 4, seed=0, mode="paper")
    assert got == {"client_1": ["aeslc", "glue-mrpc", "numer_sense"], "client_2": ["sick"],
                   "client_3": ["crows_pairs"], "client_4": ["superglue-cb"]}
    assert sum(len(c) for c in PAPER_CLIENTS) == 117  # Table 5's unique tasks
    assert len({t for c in PAPER_CLIENTS for t in c}) == 117


def test_a_client_without_tasks_is_an_error():
    with pytest.raises(ValueError, match="client_3 gets no task"):
        assign(["a", "b"], 3, seed=0)
