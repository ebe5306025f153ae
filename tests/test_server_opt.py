"""Each server optimiser against its closed form (Reddi et al. 2021) on a 2-parameter problem."""
import math

import pytest
import torch

from fedsilo.core.server_opt import ServerOptimizer

W0 = [1.0, -2.0]
DELTAS = [[0.5, -1.0], [0.25, 0.5], [-0.1, 0.2]]


def run(kind, **hp):
    opt = ServerOptimizer(kind, **hp)
    w = {"w": torch.tensor(W0, dtype=torch.float64)}
    out = []
    for d in DELTAS:
        opt.step(w, {"w": torch.tensor(d, dtype=torch.float64)})
        out.append(w["w"].tolist())
    return out


def scalar_reference(kind, lr, momentum=0.9, b1=0.9, b2=0.99, tau=1e-3):
    """Element-wise plain-float version of the update rules."""
    traj = []
    for j in range(2):
        w, m, v, col = W0[j], 0.0, 0.0, []
        for d in (dd[j] for dd in DELTAS):
            if kind == "fedavg":
                w += lr * d
            elif kind == "sgdm":
                m = momentum * m + d
                w += lr * m
            else:
                m = b1 * m + (1 - b1) * d
                if kind == "adam":
                    v = b2 * v + (1 - b2) * d * d
                elif kind == "yogi":
                    v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
                else:
                    v = v + d * d
                w += lr * m / (math.sqrt(v) + tau)
            col.append(w)
        traj.append(col)
    return [[traj[0][t], traj[1][t]] for t in range(len(DELTAS))]


def test_fedavg_hand_computed():
    assert run("fedavg", lr=1.0)[0] == pytest.approx([1.5, -3.0])
    assert run("fedavg", lr=0.5)[1] == pytest.approx([1.375, -2.25])


def test_sgdm_hand_computed():
    traj = run("sgdm", lr=1.0, momentum=0.9)
    assert traj[0] == pytest.approx([1.5, -3.0])      # m1 = Δ1
    assert traj[1] == pytest.approx([2.2, -3.4])      # m2 = 0.9·Δ1 + Δ2 = [0.7, -0.4]


def test_adam_first_step_hand_computed():
    w = run("adam", lr=0.1)[0]
    # m = 0.1·Δ, v = 0.01·Δ², step = 0.1·m/(√v + 1e-3)
    assert w == pytest.approx([1.0 + 0.1 * 0.05 / (0.05 + 1e-3), -2.0 - 0.1 * 0.1 / (0.1 + 1e-3)])


@pytest.mark.parametrize("kind", ["fedavg", "sgdm", "adam", "yogi", "adagrad"])
def test_matches_closed_form_over_three_rounds(kind):
    lr = 1.0 if kind in ("fedavg", "sgdm") else 0.1
    assert run(kind, lr=lr) == [pytest.approx(r, rel=1e-9) for r in scalar_reference(kind, lr)]


def test_yogi_and_adam_differ_after_first_step():
    assert run("yogi", lr=0.1)[0] == pytest.approx(run("adam", lr=0.1)[0])
    assert run("yogi", lr=0.1)[2] != pytest.approx(run("adam", lr=0.1)[2])


def test_tensors_nobody_sent_are_untouched():
    opt = ServerOptimizer("sgdm")
    w = {"a": torch.zeros(2), "b": torch.ones(2)}
    opt.step(w, {"a": torch.ones(2)})
    assert torch.equal(w["b"], torch.ones(2)) and "b" not in opt.m


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="nadam"):
        ServerOptimizer("nadam")
