import math

import pytest

from fedsilo.core.weighting import WEIGHTINGS, client_weights, delta_loss


def test_delta_loss_is_max_minus_min_not_first_minus_last():
    assert delta_loss([3.0, 2.6, 2.2]) == pytest.approx(0.8)
    assert delta_loss([5.0, 3.0, 4.0]) == pytest.approx(2.0)
    assert delta_loss([1.0]) == 0.0
    assert math.isnan(delta_loss([]))
    assert math.isnan(delta_loss([1.0, float("nan")]))


def test_lorar_from_logged_windows():
    logs = {"a": [3.0, 2.6, 2.2], "b": [5.0, 3.0, 4.0], "c": [1.0]}
    deltas = [delta_loss(v) for v in logs.values()]
    w = client_weights(WEIGHTINGS.get("lorar"), [100, 50, 10], deltas)
    # |D|·ΔL = 80, 100, 0
    assert w.values == pytest.approx([80 / 180, 100 / 180, 0.0])
    assert not w.any_fallback


@pytest.mark.parametrize("policy, expected", [
    ("size", [100 / 160, 50 / 160, 10 / 160]),
    ("equal", [1 / 3, 1 / 3, 1 / 3]),
    ("loss_reduction", [0.8 / 2.8, 2.0 / 2.8, 0.0]),
])
def test_other_policies(policy, expected):
    assert client_weights(WEIGHTINGS.get(policy), [100, 50, 10], [0.8, 2.0, 0.0]).values == pytest.approx(expected)


def test_loss_policy_weighs_harder_clients_more():
    w = client_weights(WEIGHTINGS.get("loss"), [1, 1], [1.0, 3.0])
    assert w.values == pytest.approx([0.25, 0.75])


def test_all_zero_delta_losses_fall_back_to_size():
    w = client_weights(WEIGHTINGS.get("lorar"), [100, 50, 10], [0.0, 0.0, 0.0])
    assert all(w.fallback)
    assert w.values == pytest.approx([100 / 160, 50 / 160, 10 / 160])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_one_unusable_delta_loss_falls_back_alone(bad):
    """The client with an unusable ΔL takes its size share (50/160); the others share the rest by
    n·ΔL (50 and 10), so one client cannot flip the whole round to size weights."""
    w = client_weights(WEIGHTINGS.get("lorar"), [100, 50, 10], [0.5, bad, 1.0])
    assert w.fallback == [False, True, False]
    rest = 110 / 160
    assert w.values == pytest.approx([rest * 50 / 60, 50 / 160, rest * 10 / 60])


def test_weight_cap_hands_the_excess_to_the_others():
    """A client claiming a huge ΔL would take ~all the weight; capped at 0.6 it takes 0.6 and the
    others share 0.4 in proportion to their own weights. At 0.4 the second one (0.5) is capped too."""
    w = client_weights(WEIGHTINGS.get("lorar"), [100, 50, 10], [1e30, 1.0, 1.0], max_weight=0.6)
    assert w.values == pytest.approx([0.6, 0.4 * 50 / 60, 0.4 * 10 / 60])
    assert w.capped == [True, False, False]
    w = client_weights(WEIGHTINGS.get("lorar"), [100, 50, 10], [1e30, 1.0, 1.0], max_weight=0.4)
    assert w.values == pytest.approx([0.4, 0.4, 0.2]) and w.capped == [True, True, False]


def test_cap_below_one_over_k_gives_equal_weights():
    w = client_weights(WEIGHTINGS.get("size"), [100, 50, 10], max_weight=0.2)
    assert w.values == pytest.approx([1 / 3] * 3)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="bogus"):
        client_weights(WEIGHTINGS.get("bogus"), [1], [1.0])


def test_weighting_reads_a_named_statistic():
    from fedsilo.core.weighting import WEIGHTINGS

    assert WEIGHTINGS.get("lorar").reads == "delta_loss"
    assert WEIGHTINGS.get("loss").reads == "mean_loss"
    assert WEIGHTINGS.get("size").reads is None
