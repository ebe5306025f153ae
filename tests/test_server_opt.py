"""Server optimisers: closed forms (Reddi et al. 2021), state handling, and Flower 1.41's own strategies.

The Flower tests drive Flower's strategy objects end to end (configure_train → one client's reply →
aggregate_train, or the legacy aggregate_fit) and give fedsilo's optimiser the very Δ Flower
computes (aggregate − current arrays), so only the server-update arithmetic is compared.
"""
import io
import math

import numpy as np
import pytest
import torch

from fedsilo.core.server_opt import SERVER_OPTIMIZERS, ServerOptimizer

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


def test_registry_holds_one_rule_per_name():
    assert SERVER_OPTIMIZERS.names() == ("fedavg", "sgdm", "adam", "yogi", "adagrad")
    assert all(callable(SERVER_OPTIMIZERS.get(n).update) for n in SERVER_OPTIMIZERS)


def test_a_config_without_lr_takes_the_optimizers_default():
    from fedsilo.config import ConfigError, validate
    assert [validate({"server": {"optimizer": n}}).server.effective_lr for n in SERVER_OPTIMIZERS] == \
        [1.0, 1.0, 0.01, 0.01, 0.01]
    assert validate({"server": {"optimizer": "adam", "lr": 0.5}}).server.effective_lr == 0.5
    with pytest.raises(ConfigError, match="bias_correction.*'sgdm'.*does not read it"):
        validate({"server": {"optimizer": "sgdm", "bias_correction": "adam"}})


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


def test_second_moment_starts_at_tau_squared():
    """Reddi et al.'s v₋₁ = τ²: a Yogi step smaller than τ *lowers* v (sign(τ² − Δ²) = +1); from v = 0
    it would rise. Fails under v0 = 0 semantics."""
    opt = ServerOptimizer("yogi", lr=0.1, tau=1e-2)
    w = {"w": torch.zeros(1, dtype=torch.float64)}
    opt.step(w, {"w": torch.tensor([1e-3], dtype=torch.float64)})
    assert opt.state["w"]["v"].item() == pytest.approx(1e-4 - 0.01 * 1e-6, rel=1e-12)
    assert ServerOptimizer("adagrad").initial_v == pytest.approx(1e-6)
    assert ServerOptimizer("adam", v0=0.0).initial_v == 0.0
    assert ServerOptimizer("adam", v0=0.5).initial_v == 0.5


@pytest.mark.parametrize("kind", ["fedavg", "sgdm", "adam", "yogi", "adagrad"])
def test_matches_closed_form_over_three_rounds(kind):
    lr = 1.0 if kind in ("fedavg", "sgdm") else 0.1
    assert run(kind, lr=lr) == [pytest.approx(r, rel=1e-9) for r in scalar_reference(kind, lr)]


def test_yogi_and_adam_differ_after_first_step():
    assert run("yogi", lr=0.1)[0] == pytest.approx(run("adam", lr=0.1)[0])
    assert run("yogi", lr=0.1)[2] != pytest.approx(run("adam", lr=0.1)[2])


def test_adam_bias_correction_kingma_and_ba():
    opt = ServerOptimizer("adam", lr=0.1, v0=0.0, bias_correction="adam")
    w = {"w": torch.tensor([0.0], dtype=torch.float64)}
    opt.step(w, {"w": torch.tensor([0.5], dtype=torch.float64)})
    # t = 1: η·√(1−β2)/(1−β1)·m/(√v + τ) with m = 0.1·Δ, v = 0.01·Δ²
    m, v = 0.1 * 0.5, 0.01 * 0.25
    assert w["w"].item() == pytest.approx(0.1 * math.sqrt(0.01) / 0.1 * m / (math.sqrt(v) + 1e-3), rel=1e-12)


def test_flower_bias_correction_counts_rounds_from_one_plus_one():
    opt = ServerOptimizer("adam", bias_correction="flower")
    for t in (1, 2, 5):
        opt.steps = t  # inside step t, `steps` is t (Flower's server_round); Flower raises β to t + 1
        # Flower's numpy expression; numpy's power may differ from Python's ** in the last bit (numpy 2.4)
        assert opt.adam_correction() == pytest.approx(
            1.0 * np.sqrt(1 - np.power(0.99, t + 1.0)) / (1 - np.power(0.9, t + 1.0)), rel=1e-13)
    assert ServerOptimizer("adam", bias_correction=True).bias_correction == "flower"
    assert ServerOptimizer("adam", bias_correction=False).bias_correction == "none"


@pytest.mark.parametrize("kind", ["fedavg", "sgdm", "yogi", "adagrad"])
def test_bias_correction_is_adams_only(kind):
    with pytest.raises(ValueError, match="adam"):
        ServerOptimizer(kind, bias_correction="flower")


def test_unknown_bias_correction_is_named():
    with pytest.raises(ValueError, match="kingma"):
        ServerOptimizer("adam", bias_correction="kingma")


def test_tensors_nobody_sent_are_untouched():
    opt = ServerOptimizer("sgdm")
    w = {"a": torch.zeros(2), "b": torch.ones(2)}
    opt.step(w, {"a": torch.ones(2)})
    assert torch.equal(w["b"], torch.ones(2)) and "b" not in opt.state


def test_moments_of_an_absent_tensor_are_untouched():
    opt = ServerOptimizer("adam", lr=0.1)
    w = {"a": torch.zeros(2), "b": torch.ones(2)}
    opt.step(w, {"a": torch.ones(2), "b": torch.ones(2)})
    before = {k: t.clone() for k, t in opt.state["b"].items()}
    b = w["b"].clone()
    opt.step(w, {"a": torch.ones(2)})
    assert torch.equal(w["b"], b)
    assert all(torch.equal(opt.state["b"][k], before[k]) for k in before)


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="nadam"):
        ServerOptimizer("nadam")


@pytest.mark.parametrize("kind", ["sgdm", "adam", "yogi", "adagrad"])
def test_state_is_allocated_once_and_updated_in_place(kind):
    opt = ServerOptimizer(kind, lr=0.1)
    w = {"a": torch.zeros(3)}
    opt.step(w, {"a": torch.ones(3)})
    ptrs = {k: t.data_ptr() for k, t in opt.state["a"].items()}
    opt.step(w, {"a": -torch.ones(3)})
    opt.step(w, {"a": 2 * torch.ones(3)})
    assert {k: t.data_ptr() for k, t in opt.state["a"].items()} == ptrs


def test_moments_take_the_parameters_dtype():
    opt = ServerOptimizer("adam", lr=0.1)
    w = {"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.bfloat16)}
    opt.step(w, {"a": torch.ones(3, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float32)})
    assert {k: s["m"].dtype for k, s in opt.state.items()} == {"a": torch.float64, "b": torch.bfloat16}
    assert {k: s["v"].dtype for k, s in opt.state.items()} == {"a": torch.float64, "b": torch.bfloat16}
    assert w["a"].dtype == torch.float64 and w["b"].dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moments_live_on_the_parameters_device():
    opt = ServerOptimizer("yogi", lr=0.1)
    w = {"a": torch.zeros(3, device="cuda")}
    opt.step(w, {"a": torch.ones(3)})  # Δ on the CPU
    assert opt.state["a"]["m"].device.type == "cuda" and opt.state["a"]["v"].device.type == "cuda"


def test_every_step_counts_an_empty_one_included():
    opt = ServerOptimizer("adam", bias_correction="flower")
    opt.step({}, {})
    opt.step({"a": torch.zeros(1)}, {"a": torch.ones(1)})
    assert opt.steps == 2


@pytest.mark.parametrize("kind, hp", [("yogi", {}), ("adam", {"bias_correction": "flower", "v0": 0.0}),
                                      ("sgdm", {})])
def test_state_round_trips_through_a_weights_only_checkpoint(kind, hp):
    a = ServerOptimizer(kind, lr=0.1, **hp)
    w = {"w": torch.tensor(W0), "u": torch.tensor([3.0])}
    a.step(w, {"w": torch.tensor(DELTAS[0]), "u": torch.tensor([0.5])})
    a.step(w, {"w": torch.tensor(DELTAS[1])})
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = ServerOptimizer(kind, lr=0.1, **hp)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.steps == 2
    wa, wb = {k: t.clone() for k, t in w.items()}, {k: t.clone() for k, t in w.items()}
    a.step(wa, {"w": torch.tensor(DELTAS[2]), "u": torch.tensor([0.25])})
    b.step(wb, {"w": torch.tensor(DELTAS[2]), "u": torch.tensor([0.25])})
    assert all(torch.equal(wa[k], wb[k]) for k in w)
    assert all(torch.equal(a.state[n][k], b.state[n][k]) for n in a.state for k in a.state[n])


def test_loaded_state_is_a_copy():
    a = ServerOptimizer("sgdm")
    a.step({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    saved = {"steps": 1, "state": {"w": {"m": torch.ones(2)}}}
    b = ServerOptimizer("sgdm")
    b.load_state_dict(saved)
    b.step({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    assert torch.equal(saved["state"]["w"]["m"], torch.ones(2))


def test_loads_the_earlier_m_v_layout():
    opt = ServerOptimizer("adam")
    opt.load_state_dict({"m": {"w": torch.ones(2)}, "v": {"w": torch.full((2,), 4.0)}})
    assert opt.steps == 0 and set(opt.state["w"]) == {"m", "v"}
    assert torch.equal(opt.state["w"]["v"], torch.full((2,), 4.0))


# ---- against Flower 1.41's own strategies --------------------------------------------------------

RTOL, ATOL = 1e-12, 1e-15  # float64; measured worst: ~3e-14 relative, 2.2e-16 absolute

_rng = np.random.default_rng(0)
F_W0 = {"kernel": _rng.normal(size=(3, 4)), "bias": _rng.normal(size=5)}
F_DELTAS = [{k: _rng.normal(scale=0.1, size=v.shape) for k, v in F_W0.items()} for _ in range(6)]
F_DELTAS[0]["kernel"][0, 0] = F_DELTAS[1]["kernel"][0, 0] = 0.0  # Δ = 0: Yogi's sign(0 − 0) = 0 from v = 0
F_DELTAS[3]["bias"] *= 20  # a large round


class _Grid:
    """Just what Flower's FedAvg.configure_train asks of a Grid: the connected node ids."""

    def get_node_ids(self):
        return [7]


@pytest.fixture
def flower_identity(monkeypatch):
    """Flower's Message needs a run and node id (set by the ServerApp in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def _flower_serverapp_rounds(strategy, w0, deltas):
    """Flower's Message API: configure_train sends the arrays; one client replies w + Δ with
    num-examples 3; aggregate_train averages and applies the strategy's server update."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    arrays = ArrayRecord({k: Array(v.copy()) for k, v in w0.items()})
    out, seen = [], []
    for rnd, d in enumerate(deltas, start=1):
        (msg,) = strategy.configure_train(rnd, arrays, ConfigRecord(), _Grid())
        sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        client = {k: sent[k] + d[k] for k in d}
        reply = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in client.items()}),
                            "metrics": MetricRecord({"num-examples": 3})})
        arrays, _ = strategy.aggregate_train(rnd, [Message(reply, reply_to=msg)])
        seen.append({k: client[k] - sent[k] for k in d})  # Flower's Δ_t: aggregate − current arrays
        out.append({k: arrays[k].numpy().copy() for k in w0})
    return out, seen


def _flower_legacy_rounds(strategy, w0, deltas):
    """Flower's legacy Strategy API (flwr.server.strategy): aggregate_fit on one client's FitRes."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    names = list(w0)
    current = [w0[k].copy() for k in names]
    out, seen = [], []
    for rnd, d in enumerate(deltas, start=1):
        client = [c + d[k] for c, k in zip(current, names)]
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(client), 3, {})
        params, _ = strategy.aggregate_fit(rnd, [(None, res)], [])
        seen.append({k: cl - c for k, cl, c in zip(names, client, current)})
        current = parameters_to_ndarrays(params)
        out.append(dict(zip(names, (c.copy() for c in current))))
    return out, seen


def _fedsilo_rounds(opt, w0, seen):
    w = {k: torch.tensor(v) for k, v in w0.items()}
    out = []
    for delta in seen:
        opt.step(w, {k: torch.from_numpy(v) for k, v in delta.items()})
        out.append({k: t.numpy().copy() for k, t in w.items()})
    return out


def _flower_strategy(api, name, **kw):
    import flwr.server.strategy as legacy
    import flwr.serverapp.strategy as serverapp

    if api == "serverapp":
        return getattr(serverapp, name)(min_train_nodes=1, min_available_nodes=1, **kw)
    from flwr.common import ndarrays_to_parameters
    return getattr(legacy, name)(initial_parameters=ndarrays_to_parameters(list(F_W0.values())), **kw)


# (fedsilo kind, fedsilo settings that reproduce Flower, Flower strategy, its arguments)
FLOWER_CASES = [
    ("adam", dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0, bias_correction="flower"),
     "FedAdam", dict(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ("yogi", dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0),
     "FedYogi", dict(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ("adagrad", dict(lr=0.1, beta1=0.0, tau=1e-3, v0=0.0),  # FedAdagrad takes no β1: it is 0
     "FedAdagrad", dict(eta=0.1, tau=1e-3)),
    ("sgdm", dict(lr=1.0, momentum=0.9), "FedAvgM", dict(server_learning_rate=1.0, server_momentum=0.9)),
    ("sgdm", dict(lr=0.7, momentum=0.5), "FedAvgM", dict(server_learning_rate=0.7, server_momentum=0.5)),
    ("fedavg", dict(lr=0.5), "FedAvgM", dict(server_learning_rate=0.5, server_momentum=0.0)),
    ("fedavg", dict(lr=1.0), "FedAvg", {}),
]


@pytest.mark.parametrize("api", ["serverapp", "legacy"])
@pytest.mark.parametrize("kind, hp, flower, flower_kw", FLOWER_CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(FLOWER_CASES)])
def test_matches_flowers_strategy(api, kind, hp, flower, flower_kw, flower_identity):
    rounds = _flower_serverapp_rounds if api == "serverapp" else _flower_legacy_rounds
    expected, seen = rounds(_flower_strategy(api, flower, **flower_kw), F_W0, F_DELTAS)
    got = _fedsilo_rounds(ServerOptimizer(kind, **hp), F_W0, seen)
    for r, (g, e) in enumerate(zip(got, expected)):
        for k in F_W0:
            np.testing.assert_allclose(g[k], e[k], rtol=RTOL, atol=ATOL, err_msg=f"round {r + 1}, {k}")


@pytest.mark.parametrize("kind, hp, flower, flower_kw", FLOWER_CASES[:3], ids=["adam", "yogi", "adagrad"])
def test_matches_flowers_strategy_in_float32(kind, hp, flower, flower_kw, flower_identity):
    """A float32 model: fedsilo keeps float32 (Flower's FedAdam returns float64 arrays: its bias-
    corrected η is a NumPy float64 scalar, which NumPy ≥ 2 does not demote)."""
    w0 = {k: v.astype(np.float32) for k, v in F_W0.items()}
    deltas = [{k: v.astype(np.float32) for k, v in d.items()} for d in F_DELTAS]
    expected, seen = _flower_serverapp_rounds(_flower_strategy("serverapp", flower, **flower_kw), w0, deltas)
    got = _fedsilo_rounds(ServerOptimizer(kind, **hp), w0, [{k: v.astype(np.float32) for k, v in s.items()}
                                                             for s in seen])
    assert all(g[k].dtype == np.float32 for g in got for k in g)
    for g, e in zip(got, expected):
        for k in w0:
            np.testing.assert_allclose(g[k], e[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, hp, flower, flower_kw", [
    ("adam", dict(lr=0.1, tau=1e-3), "FedAdam", dict(eta=0.1, tau=1e-3)),           # v0 = τ², no correction
    ("adam", dict(lr=0.1, tau=1e-3, v0=0.0, bias_correction="adam"),                  # Kingma's t, not Flower's
     "FedAdam", dict(eta=0.1, tau=1e-3)),
    ("yogi", dict(lr=0.1, tau=1e-3), "FedYogi", dict(eta=0.1, tau=1e-3)),              # v0 = τ²
    ("adagrad", dict(lr=0.1, tau=1e-3, v0=0.0), "FedAdagrad", dict(eta=0.1, tau=1e-3)),  # β1 = 0.9
])
def test_fedsilo_defaults_differ_from_flower(kind, hp, flower, flower_kw, flower_identity):
    """The documented differences are real: without the reproducing settings the trajectories part."""
    expected, seen = _flower_serverapp_rounds(_flower_strategy("serverapp", flower, **flower_kw), F_W0, F_DELTAS)
    got = _fedsilo_rounds(ServerOptimizer(kind, **hp), F_W0, seen)
    assert not all(np.allclose(g[k], e[k], rtol=1e-6, atol=0) for g, e in zip(got, expected) for k in F_W0)
