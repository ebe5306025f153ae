"""Subset exchange, private tensors and byte accounting on a toy model with tied weights."""
import pytest
import torch

from fedsilo.client.silo import SiloClient
from fedsilo.config import ClientConfig
from fedsilo.core.exchange import ExchangePlan, register_selector
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import nbytes
from fedsilo.engines.local import run_round
from fedsilo.server import Server
from tests.toy import TiedToy, toy_collate, toy_data

CFG = ClientConfig(epochs=1, lr=0.1, batch_size=4, optimizer="sgd", max_grad_norm=0)


def federation(plan: ExchangePlan, n_clients: int = 2):
    torch.manual_seed(0)
    model = TiedToy()
    params = dict(model.named_parameters())
    shared, private = plan.split(params)
    server = Server({k: params[k].detach() for k in shared}, ServerOptimizer("fedavg"), "size")
    clients = {f"c{i}": SiloClient(f"c{i}", i, toy_data(8 + 4 * i, seed=i), toy_collate, CFG, model, plan,
                                   {k: params[k].detach() for k in private})
               for i in range(n_clients)}
    return model, server, clients


def test_tied_weights_are_counted_once():
    model = TiedToy(vocab=5, dim=3)
    unique = 5 * 3 + (3 * 3 + 3) * 2  # emb/head shared, enc, dec
    assert nbytes(dict(model.named_parameters())) == unique * 4
    assert nbytes(model.state_dict()) == unique * 4  # state_dict lists the tied weight twice
    assert len(model.state_dict()) == len(dict(model.named_parameters())) + 1


def test_private_tensors_never_leave_and_survive_rounds():
    plan = ExchangePlan(shared=("*",), private=("dec.*",))
    model, server, clients = federation(plan)
    assert set(server.params) == {"emb.weight", "enc.weight", "enc.bias"}
    sent = []
    original_receive = server.receive
    server.receive = lambda c, u: sent.append(set(u.tensors)) or original_receive(c, u)
    run_round(server, clients, list(clients), 1, seed=0)
    assert all(not any(n.startswith("dec.") for n in s) for s in sent)
    after_r1 = {c: {k: v.clone() for k, v in cl.private.items()} for c, cl in clients.items()}
    assert not torch.equal(after_r1["c0"]["dec.weight"], after_r1["c1"]["dec.weight"])
    # Round 2 starts each client from its own private tensors, not from another client's.
    seen = {}
    for name, client in clients.items():
        client.load_into_model(server.payload())
        seen[name] = model.dec.weight.detach().clone()
    assert torch.equal(seen["c0"], after_r1["c0"]["dec.weight"])
    assert torch.equal(seen["c1"], after_r1["c1"]["dec.weight"])


def test_fixed_subset_exchange_and_bytes():
    plan = ExchangePlan(shared=("enc.*",))
    model, server, clients = federation(plan)
    record = run_round(server, clients, list(clients), 1, seed=0)
    enc_bytes = (3 * 3 + 3) * 4
    for c in record["clients"].values():
        assert c["bytes_up"] == enc_bytes and c["bytes_down"] == enc_bytes
    assert record["bytes_up"] == 2 * enc_bytes


@register_selector("test-enc-weight-on-odd-rounds")
def _odd_round_selector(round_idx, local, reference):
    return ["enc.weight"] if round_idx % 2 else list(local)


def test_per_round_selection_uploads_subset_and_server_keeps_the_rest():
    plan = ExchangePlan(select="test-enc-weight-on-odd-rounds")
    model, server, clients = federation(plan)
    before = {k: v.clone() for k, v in server.params.items()}
    record = run_round(server, clients, list(clients), 1, seed=0)
    assert all(c["bytes_up"] == 9 * 4 for c in record["clients"].values())
    assert all(c["bytes_down"] == nbytes(server.params) for c in record["clients"].values())
    assert not torch.equal(server.params["enc.weight"], before["enc.weight"])
    for name in ("emb.weight", "enc.bias", "dec.weight", "dec.bias"):
        assert torch.equal(server.params[name], before[name])  # nobody sent it: unchanged
    record = run_round(server, clients, list(clients), 2, seed=0)
    assert all(c["bytes_up"] == nbytes(server.params) for c in record["clients"].values())


def test_selector_choosing_a_private_tensor_is_an_error():
    register_selector("test-bad")(lambda r, local, ref: ["dec.weight"])
    plan = ExchangePlan(private=("dec.*",), select="test-bad")
    model, server, clients = federation(plan)
    with pytest.raises(ValueError, match="dec.weight"):
        run_round(server, clients, list(clients), 1, seed=0)


def test_rejected_update_is_logged_and_not_aggregated():
    model, server, clients = federation(ExchangePlan())
    before = {k: v.clone() for k, v in server.params.items()}
    fit = clients["c1"].fit

    def poisoned(*a, **kw):
        u = fit(*a, **kw)
        u.tensors["enc.weight"][0, 0] = float("nan")
        return u

    clients["c1"].fit = poisoned
    record = run_round(server, clients, list(clients), 1, seed=0)
    assert "NaN" in record["clients"]["c1"]["rejected"]
    assert record["clients"]["c0"]["weight"] == 1.0
    assert torch.isfinite(server.params["enc.weight"]).all()
    assert not torch.equal(server.params["enc.weight"], before["enc.weight"])


def test_wrong_shape_or_unknown_tensor_is_rejected_with_reason():
    from fedsilo.server import ClientUpdate

    model, server, clients = federation(ExchangePlan())
    server.begin_round()
    bad_shape = ClientUpdate({"enc.weight": torch.zeros(2, 2)}, n_examples=3, delta_loss=1.0, mean_loss=1.0)
    assert "shape" in server.receive("c0", bad_shape)
    unknown = ClientUpdate({"nope": torch.zeros(1)}, n_examples=3, delta_loss=1.0, mean_loss=1.0)
    assert "unknown tensor" in server.receive("c1", unknown)
    record = server.end_round()
    assert record["clients"]["c0"]["rejected"].startswith("tensor 'enc.weight'")
    assert all(c["weight"] is None for c in record["clients"].values())
