import math

import pytest
import torch

from fedsilo.client.train import LossLog
from fedsilo.core.aggregate import RoundAggregator
from fedsilo.core.weighting import client_weights, delta_loss


def test_delta_loss_is_max_minus_min_not_first_minus_last():
    assert delta_loss([3.0, 2.6, 2.2]) == pytest.approx(0.8)
    assert delta_loss([5.0, 3.0, 4.0]) == pytest.approx(2.0)
    assert delta_loss([1.0]) == 0.0
    assert math.isnan(delta_loss([]))
    assert math.isnan(delta_loss([1.0, float("nan")]))


def test_loss_log_windows_first_step_and_epoch_end():
    log = LossLog(every=4)
    for v in range(1, 11):  # one epoch of 10 steps, loss = step number
        log.record(float(v))
    log.end_epoch()
    assert log.points == [(1, 1.0), (4, 2.5), (8, 6.5), (10, 9.5)]
    log.record(20.0)  # a new epoch continues the step count
    log.end_epoch()
    assert log.points[-1] == (11, 20.0)


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
    w = client_weights("loss", [1, 1], losses=[1.0, 3.0])
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
    agg.add("a", {"t": d1}, n_examples=10, delta_loss=1.0)
    agg.add("b", {"t": d2}, n_examples=30, delta_loss=2.0)
    delta, w = agg.finish()
    assert w.values == pytest.approx([10 / 70, 60 / 70])
    assert torch.allclose(delta["t"], (10 * d1 + 60 * d2) / 70)


def test_streaming_aggregate_degenerate_uses_size_sum():
    agg = RoundAggregator("lorar")
    agg.add("a", {"t": torch.tensor([1.0])}, n_examples=10, delta_loss=0.0)
    agg.add("b", {"t": torch.tensor([4.0])}, n_examples=30, delta_loss=0.0)
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
