"""Energy-based token weights of pseudo labels (FewFedWeight Eq. 3-4) against hand-computed values."""
import math

import pytest
import torch

from fedsilo.client.pseudo import TOKEN_WEIGHTINGS, neg_energy, softplus_weights, token_weights, uniform_weights


def test_neg_energy_by_hand_top_k_and_temperature():
    top = torch.tensor([[2.0, 1.0, 0.0]])
    assert neg_energy(top).item() == pytest.approx(math.log(math.e ** 2 + math.e + 1))
    # T = 2: −E = 2·log Σ exp(f/2)
    assert neg_energy(top, 2.0).item() == pytest.approx(2 * math.log(math.e + math.e ** 0.5 + 1))


def test_paper_weights_for_positive_energies():
    top = torch.tensor([[3.0, 1.0], [1.0, 1.0], [5.0, -2.0]])
    e = [math.log(math.exp(3) + math.exp(1)), math.log(2 * math.e), math.log(math.exp(5) + math.exp(-2))]
    w = token_weights(top)
    assert w.tolist() == pytest.approx([x / sum(e) for x in e])
    assert w.sum().item() == pytest.approx(1.0)
    assert w[2] > w[0] > w[1]  # lower energy (more confident) → larger weight


def test_negative_logits_fall_back_to_softplus_for_the_whole_sequence():
    top = torch.tensor([[-3.0, -4.0], [2.0, 0.0]])
    e = [math.log(math.exp(-3) + math.exp(-4)), math.log(math.exp(2) + 1)]
    assert e[0] < 0 < e[1]
    sp = [math.log1p(math.exp(x)) for x in e]
    w = token_weights(top)
    assert w.tolist() == pytest.approx([x / sum(sp) for x in sp])
    assert (w > 0).all() and w[1] > w[0]


def test_all_nonpositive_energies_still_give_a_distribution():
    top = torch.full((3, 7), -50.0)
    w = token_weights(top)
    assert torch.isfinite(w).all() and w.tolist() == pytest.approx([1 / 3] * 3)


def test_uniform_and_softplus_weightings():
    top = torch.tensor([[4.0, 0.0], [1.0, 0.0], [0.5, 0.2], [9.0, 9.0]])
    assert token_weights(top, uniform_weights).tolist() == pytest.approx([0.25] * 4)
    e = neg_energy(top)
    sp = torch.nn.functional.softplus(e)
    assert token_weights(top, softplus_weights).tolist() == pytest.approx((sp / sp.sum()).tolist())
    assert set(TOKEN_WEIGHTINGS) >= {"energy", "energy_softplus", "uniform"}


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="non-empty sequence"):
        token_weights(torch.zeros(0, 7))
    with pytest.raises(ValueError, match="non-empty sequence"):
        token_weights(torch.zeros(7))
