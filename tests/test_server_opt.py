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
    """Element-wise plain-float version of the update rules (v starts at τ², Reddi et al.)."""
    traj = []
    for j in range(2):
        w, m, v, col = W0[j], 0.0, tau * tau, []
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
    # m = 0.1·Δ, v = 0.99·τ² + 0.01·Δ² (v starts at τ² = 1e-6), step = 0.1·m/(√v + 1e-3)
    v = [0.99e-6 + 0.01 * 0.25, 0.99e-6 + 0.01 * 1.0]
    assert w == pytest.approx([1.0 + 0.1 * 0.05 / (math.sqrt(v[0]) + 1e-3),
                               -2.0 - 0.1 * 0.1 / (math.sqrt(v[1]) + 1e-3)], rel=1e-12)
    # with v0 = 0 (Flower's convention) the step differs
    zero = ServerOptimizer("adam", lr=0.1, v0=0.0)
    w0 = {"w": torch.tensor(W0, dtype=torch.float64)}
    zero.step(w0, {"w": torch.tensor(DELTAS[0], dtype=torch.float64)})
    assert w0["w"].tolist() == pytest.approx([1.0 + 0.1 * 0.05 / (0.05 + 1e-3), -2.0 - 0.1 * 0.1 / (0.1 + 1e-3)])
    assert w0["w"].tolist() != pytest.approx(w, rel=1e-9)


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
    assert torch.equal(w["b"], torch.ones(2)) and "b" not in opt.state


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="nadam"):
        ServerOptimizer("nadam")


def test_state_is_allocated_once_and_updated_in_place():
    opt = ServerOptimizer("adam", lr=0.1)
    w = {"a": torch.zeros(3)}
    opt.step(w, {"a": torch.ones(3)})
    m, v = opt.state["a"]["m"], opt.state["a"]["v"]
    ptrs = (m.data_ptr(), v.data_ptr())
    opt.step(w, {"a": torch.ones(3)})
    assert (opt.state["a"]["m"].data_ptr(), opt.state["a"]["v"].data_ptr()) == ptrs


def test_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    a = ServerOptimizer("yogi", lr=0.1)
    w = {"w": torch.tensor(W0)}
    a.step(w, {"w": torch.tensor(DELTAS[0])})
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b = ServerOptimizer("yogi", lr=0.1)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    wa, wb = {"w": w["w"].clone()}, {"w": w["w"].clone()}
    a.step(wa, {"w": torch.tensor(DELTAS[1])})
    b.step(wb, {"w": torch.tensor(DELTAS[1])})
    assert torch.equal(wa["w"], wb["w"]) and b.steps == 2


# ---- against Flower 1.41's strategies (flwr.serverapp.strategy), on the same deltas -------------

def _flower_rounds(strategy, monkeypatch, rounds=DELTAS):
    """Flower's own server-update code on a fixed aggregate: FedAvg's client averaging (not what is
    compared) is replaced by handing over the aggregated arrays w + Δ directly."""
    import numpy as np
    import flwr.serverapp.strategy as fs
    from flwr.app import Array, ArrayRecord

    monkeypatch.setattr(fs.FedAvg, "aggregate_train", lambda self, r, replies: (replies, None))
    current = np.array(W0, dtype=np.float64)
    fedavgm = isinstance(strategy, fs.FedAvgM)
    strategy.current_arrays = ArrayRecord({"w": Array(current)}) if fedavgm else None
    out = []
    for r, d in enumerate(rounds, start=1):
        if not fedavgm:  # Flower's configure_train sets this from the global model each round
            strategy.current_arrays = {"w": current}
        arrays, _ = strategy.aggregate_train(r, ArrayRecord({"w": Array(current + np.array(d))}))
        current = arrays["w"].numpy()
        out.append(current.tolist())
    return out


def _fedsilo_rounds(kind, **hp):
    return run(kind, **hp)


@pytest.mark.parametrize("kind, flower, hp", [
    ("adam", "FedAdam", dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0, bias_correction="flower")),
    ("yogi", "FedYogi", dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0)),
    ("adagrad", "FedAdagrad", dict(lr=0.1, beta1=0.0, tau=1e-3, v0=0.0)),
    ("sgdm", "FedAvgM", dict(lr=1.0, momentum=0.9)),
])
def test_matches_flowers_strategy(kind, flower, hp, monkeypatch):
    import flwr.serverapp.strategy as fs

    if kind == "sgdm":
        strategy = fs.FedAvgM(server_learning_rate=hp["lr"], server_momentum=hp["momentum"])
    else:
        args = dict(eta=hp["lr"], tau=hp["tau"])
        if kind != "adagrad":
            args.update(beta_1=hp["beta1"], beta_2=hp["beta2"])
        strategy = getattr(fs, flower)(**args)
    expected = _flower_rounds(strategy, monkeypatch)
    assert _fedsilo_rounds(kind, **hp) == [pytest.approx(r, rel=1e-12) for r in expected]


def test_adam_bias_correction_kingma_and_ba():
    opt = ServerOptimizer("adam", lr=0.1, v0=0.0, bias_correction="adam")
    w = {"w": torch.tensor([0.0], dtype=torch.float64)}
    opt.step(w, {"w": torch.tensor([0.5], dtype=torch.float64)})
    # t = 1: m̂ = Δ, v̂ = Δ²: the step is lr·Δ/(|Δ| + τ·√(1−β2)/(1−β1)·...) = lr·sqrt(1-β2)/(1-β1)·m/(√v+τ)
    m, v = 0.1 * 0.5, 0.01 * 0.25
    assert w["w"].item() == pytest.approx(0.1 * math.sqrt(0.01) / 0.1 * m / (math.sqrt(v) + 1e-3), rel=1e-12)
