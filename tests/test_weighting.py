import math

import pytest
import torch

from fedsilo.core.aggregate import RoundAggregator
from fedsilo.core.weighting import client_weights, delta_loss


def test_delta_loss_is_max_minus_min_not_first_minus_last():
    assert delta_loss([3.0, 2.6, 2.2]) == pytest.approx(0.8)
    assert delta_loss([5.0, 3.0, 4.0]) == pytest.approx(2.0)
    assert delta_loss([1.0]) == 0.0
    assert math.isnan(delta_loss([]))
    assert math.isnan(delta_loss([1.0, float("nan")]))


def test_lorar_from_logged_windows():
    logs = {"a": [3.0, 2.6, 2.2], "b": [5.0, 3.0, 4.0], "c": [1.0]}
    deltas = [delta_loss(v) for v in logs.values()]
    w = client_weights("lorar", [100, 50, 10], deltas)
    # |D|·ΔL = 80, 100, 0
    assert w.values == pytest.approx([80 / 180, 100 / 180, 0.0])
    assert not w.fallback


@pytest.mark.parametrize("policy, expected", [
    ("size", [100 / 160, 50 / 160, 10 / 160]),
    ("equal", [1 / 3, 1 / 3, 1 / 3]),
    ("loss_reduction", [0.8 / 2.8, 2.0 / 2.8, 0.0]),
])
def test_other_policies(policy, expected):
    assert client_weights(policy, [100, 50, 10], [0.8, 2.0, 0.0]).values == pytest.approx(expected)


def test_loss_policy_weighs_harder_clients_more():
    w = client_weights("loss", [1, 1], [1.0, 3.0])
    assert w.values == pytest.approx([0.25, 0.75])


@pytest.mark.parametrize("deltas", [[0.0, 0.0, 0.0], [0.5, float("nan"), 1.0], [0.5, float("inf"), 1.0]])
def test_degenerate_round_falls_back_to_size(deltas):
    w = client_weights("lorar", [100, 50, 10], deltas)
    assert w.fallback
    assert w.values == pytest.approx([100 / 160, 50 / 160, 10 / 160])


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="bogus"):
        client_weights("bogus", [1], [1.0])


def test_streaming_aggregate_equals_weighted_mean():
    agg = RoundAggregator("lorar")
    d1, d2 = torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 4.0])
    agg.add("a", {"t": d1}, n_examples=10, value=1.0)
    agg.add("b", {"t": d2}, n_examples=30, value=2.0)
    delta, w = agg.finish()
    assert w.values == pytest.approx([10 / 70, 60 / 70])
    assert torch.allclose(delta["t"], (10 * d1 + 60 * d2) / 70)


def test_streaming_aggregate_degenerate_uses_size_sum():
    agg = RoundAggregator("lorar")
    agg.add("a", {"t": torch.tensor([1.0])}, n_examples=10, value=0.0)
    agg.add("b", {"t": torch.tensor([4.0])}, n_examples=30, value=0.0)
    delta, w = agg.finish()
    assert w.fallback
    assert delta["t"].item() == pytest.approx((10 * 1 + 30 * 4) / 40)


def test_partial_uploads_average_over_senders_only():
    agg = RoundAggregator("size")
    agg.add("a", {"t1": torch.tensor([1.0]), "t2": torch.tensor([5.0])}, n_examples=1)
    agg.add("b", {"t1": torch.tensor([3.0])}, n_examples=3)
    delta, _ = agg.finish()
    assert delta["t1"].item() == pytest.approx((1 + 9) / 4)
    assert delta["t2"].item() == pytest.approx(5.0)  # only a sent it


def test_float64_updates_are_summed_in_float64():
    like = {"t": torch.zeros(3, dtype=torch.float64)}
    agg = RoundAggregator("size", like=like)
    a = torch.tensor([1e-12, 1.0, 3.0], dtype=torch.float64)
    b = torch.tensor([2e-12, 2.0, 1.0], dtype=torch.float64)
    agg.add("a", {"t": a}, n_examples=1)
    agg.add("b", {"t": b}, n_examples=3)
    delta, _ = agg.finish()
    assert delta["t"].dtype == torch.float64
    assert torch.allclose(delta["t"], (a + 3 * b) / 4, rtol=0, atol=1e-15)


def test_policies_that_cannot_degenerate_keep_one_sum():
    for policy in ("size", "equal"):
        agg = RoundAggregator(policy)
        agg.add("a", {"t": torch.ones(2)}, n_examples=2)
        assert agg.by_size is None and len(agg.primary.sums) == 1
    assert RoundAggregator("lorar").by_size is not None


def test_weighting_reads_a_named_statistic():
    from fedsilo.core.weighting import WEIGHTINGS

    assert WEIGHTINGS.get("lorar").reads == "delta_loss"
    assert WEIGHTINGS.get("loss").reads == "mean_loss"
    assert WEIGHTINGS.get("size").reads is None
