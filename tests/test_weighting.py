import math

import pytest

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


def test_weighting_reads_a_named_statistic():
    from fedsilo.core.weighting import WEIGHTINGS

    assert WEIGHTINGS.get("lorar").reads == "delta_loss"
    assert WEIGHTINGS.get("loss").reads == "mean_loss"
    assert WEIGHTINGS.get("size").reads is None
