"""Streaming weighted aggregation (fedsilo.core.aggregate.RoundAggregator)."""
import math

import pytest
import torch

from fedsilo.core.aggregate import RoundAggregator, accumulator_dtype
from fedsilo.core.weighting import WEIGHTINGS, WeightingPolicy, client_weights
from fedsilo.registry import Entry


def _held_tensors(obj, skip=(), seen=None):
    """Every distinct tensor reachable from `obj`'s attributes (dicts, lists, tuples, objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [] if any(obj is s for s in skip) else [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return []
    return [t for c in children for t in _held_tensors(c, skip, seen)]


SIZES = [10, 30, 5]
VALUES = [1.0, 2.0, 0.5]


def _updates(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [{"a": torch.randn(4, 3, generator=g, dtype=dtype), "b": torch.randn(7, generator=g, dtype=dtype)}
            for _ in SIZES]


@pytest.mark.parametrize("policy", ["size", "equal", "lorar", "loss_reduction", "loss"])
def test_streaming_equals_the_explicit_weighted_mean(policy):
    updates = _updates()
    agg = RoundAggregator(WEIGHTINGS.get(policy))
    for i, (u, n, v) in enumerate(zip(updates, SIZES, VALUES)):
        agg.add(f"c{i}", u, n_examples=n, value=v)
    delta, w = agg.finish()
    p = client_weights(WEIGHTINGS.get(policy), SIZES, VALUES).values
    assert w.values == pytest.approx(p) and not w.any_fallback
    assert agg.clients == ["c0", "c1", "c2"]
    for k in ("a", "b"):
        expected = sum(pi * u[k] for pi, u in zip(p, updates))
        torch.testing.assert_close(delta[k], expected, rtol=1e-12, atol=1e-14)


def test_lorar_hand_computed():
    agg = RoundAggregator(WEIGHTINGS.get("lorar"))
    d1, d2 = torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 4.0])
    agg.add("a", {"t": d1}, n_examples=10, value=1.0)
    agg.add("b", {"t": d2}, n_examples=30, value=2.0)
    delta, w = agg.finish()
    assert w.values == pytest.approx([10 / 70, 60 / 70])
    assert torch.allclose(delta["t"], (10 * d1 + 60 * d2) / 70)


@pytest.mark.parametrize("values, fell_back", [
    ([0.0, 0.0], [True, True]), ([0.5, math.nan], [False, True]),
    ([math.nan, math.nan], [True, True]), ([1.0, math.inf], [False, True])])
def test_degenerate_round_uses_the_size_sum(values, fell_back):
    """All scores unusable: size weights. One unusable: that client alone takes its size share
    (here 30/40), the other the rest — the same numbers, but only b is marked."""
    agg = RoundAggregator(WEIGHTINGS.get("lorar"))
    agg.add("a", {"t": torch.tensor([1.0])}, n_examples=10, value=values[0])
    agg.add("b", {"t": torch.tensor([4.0]), "u": torch.tensor([2.0])}, n_examples=30, value=values[1])
    delta, w = agg.finish()
    assert w.fallback == fell_back and w.values == pytest.approx([10 / 40, 30 / 40])
    assert delta["t"].item() == pytest.approx((10 * 1 + 30 * 4) / 40)
    assert delta["u"].item() == pytest.approx(2.0)  # partial upload under the fallback too


def test_float64_updates_stay_float64_and_exact():
    like = {"t": torch.zeros(3, dtype=torch.float64)}
    a = torch.tensor([1e-12, 1.0 + 1e-10, 3.0], dtype=torch.float64)
    b = torch.tensor([2e-12, 2.0, 1.0 - 1e-10], dtype=torch.float64)
    for policy in ("size", "lorar"):
        agg = RoundAggregator(WEIGHTINGS.get(policy), like=like)
        agg.add("a", {"t": a}, n_examples=1, value=1.0)
        agg.add("b", {"t": b}, n_examples=3, value=1.0)
        delta, _ = agg.finish()
        assert delta["t"].dtype == torch.float64
        assert (delta["t"] - (a + 3 * b) / 4).abs().max().item() <= 1e-12
        # a float32 sum could not hold these: it would be off by ~1e-8
        assert ((a.float() + 3 * b.float()) / 4 - (a + 3 * b) / 4).abs().max().item() > 1e-12


def test_float32_updates_of_a_float64_model_are_summed_in_float64():
    like = {"t": torch.zeros(2, dtype=torch.float64)}
    agg = RoundAggregator(WEIGHTINGS.get("equal"), like=like)
    agg.add("a", {"t": torch.tensor([1.0, 2.0])}, n_examples=1)
    delta, _ = agg.finish()
    assert delta["t"].dtype == torch.float64


@pytest.mark.parametrize("like, update, expected", [
    (torch.float64, torch.float32, torch.float64),
    (torch.float32, torch.float64, torch.float32),   # the model's dtype decides
    (torch.bfloat16, torch.bfloat16, torch.float32),  # never below float32
    (None, torch.float16, torch.float32),
    (None, torch.float64, torch.float64),
    (None, torch.int64, torch.float32),
])
def test_accumulator_dtype(like, update, expected):
    ref = torch.zeros(1, dtype=like) if like is not None else None
    assert accumulator_dtype(torch.zeros(1, dtype=update), ref) == expected


@pytest.mark.parametrize("policy", ["equal", "size"])
def test_a_policy_that_cannot_degenerate_holds_one_sum_per_tensor(policy):
    like = {"a": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(7, dtype=torch.float64)}
    agg = RoundAggregator(WEIGHTINGS.get(policy), like=like)
    for u, n in zip(_updates() * 3, SIZES * 3):  # nine clients
        agg.add("c", u, n_examples=n)
    assert agg.by_size is None
    held = _held_tensors(agg, skip=list(like.values()))
    assert len(held) == 2 and {tuple(t.shape) for t in held} == {(4, 3), (7,)}


def test_a_policy_that_can_degenerate_holds_two_sums_per_tensor():
    assert WEIGHTINGS.get("lorar").can_degenerate
    agg = RoundAggregator(WEIGHTINGS.get("lorar"))
    for u, n, v in zip(_updates() * 3, SIZES * 3, VALUES * 3):
        agg.add("c", u, n_examples=n, value=v)
    assert len(_held_tensors(agg)) == 4


def test_partial_uploads_average_over_senders_only():
    agg = RoundAggregator(WEIGHTINGS.get("size"))
    agg.add("a", {"t1": torch.tensor([1.0]), "t2": torch.tensor([5.0])}, n_examples=1)
    agg.add("b", {"t1": torch.tensor([3.0])}, n_examples=3)
    delta, w = agg.finish()
    assert w.values == pytest.approx([0.25, 0.75])
    assert delta["t1"].item() == pytest.approx((1 + 9) / 4)
    assert delta["t2"].item() == pytest.approx(5.0)  # only a sent it


def test_a_tensor_only_zero_weight_clients_sent_is_left_out():
    agg = RoundAggregator(WEIGHTINGS.get("lorar"))
    agg.add("a", {"t": torch.tensor([1.0])}, n_examples=10, value=1.0)
    agg.add("z", {"t": torch.tensor([9.0]), "only_z": torch.tensor([3.0])}, n_examples=10, value=0.0)
    delta, w = agg.finish()
    assert not w.any_fallback and w.values == pytest.approx([1.0, 0.0])
    assert set(delta) == {"t"} and delta["t"].item() == pytest.approx(1.0)


def test_empty_round():
    assert RoundAggregator(WEIGHTINGS.get("lorar")).finish()[0] == {}
    assert RoundAggregator(WEIGHTINGS.get("lorar")).finish()[1].values == []


def test_finish_is_idempotent_and_closes_the_round():
    agg = RoundAggregator(WEIGHTINGS.get("size"))
    agg.add("a", {"t": torch.tensor([2.0])}, n_examples=2)
    first = agg.finish()
    assert agg.finish() is first and first[0]["t"].item() == 2.0
    with pytest.raises(RuntimeError):
        agg.add("b", {"t": torch.tensor([1.0])}, n_examples=1)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="bogus"):
        RoundAggregator(WEIGHTINGS.get("bogus"))


def test_a_policy_that_wrongly_claims_it_cannot_degenerate_fails_loudly(monkeypatch):
    policy = WeightingPolicy(lambda n, v: v, "delta_loss", can_degenerate=False)
    monkeypatch.setitem(WEIGHTINGS._entries, "liar", Entry("liar", policy))
    agg = RoundAggregator(WEIGHTINGS.get("liar"))
    agg.add("a", {"t": torch.tensor([1.0])}, n_examples=1, value=0.0)
    with pytest.raises(ValueError, match="cannot degenerate"):
        agg.finish()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sums_live_on_the_global_tensors_device():
    like = {"t": torch.zeros(2, device="cuda")}
    agg = RoundAggregator(WEIGHTINGS.get("lorar"), like=like)
    agg.add("a", {"t": torch.ones(2)}, n_examples=1, value=1.0)  # a CPU update
    delta, _ = agg.finish()
    assert delta["t"].device.type == "cuda"
