"""Per-client exchange (upload selectors, download and overwrite policies), private tensors and byte
accounting, on a toy model with tied weights and in-memory or on-disk client stores."""
import pytest
import torch

from fedsilo.client.silo import SiloClient
from fedsilo.client.store import DiskStore, MemoryStore
from fedsilo.config import ClientConfig
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS, ExchangePlan, register_selector
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import nbytes
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.core.messages import ClientUpdate
from fedsilo.engines.local import run_round
from fedsilo.recipe import silo_recipe
from tests.toy import TiedToy, ToyTask, server_with, toy_data

CFG = ClientConfig(epochs=1, lr=0.1, batch_size=4, optimizer="sgd", max_grad_norm=0)


def federation(plan: ExchangePlan, n_clients: int = 2, store=None, cfg: ClientConfig = CFG):
    torch.manual_seed(0)
    model = TiedToy()
    params = dict(model.named_parameters())
    shared, private = plan.split(params)
    server = server_with({k: params[k].detach() for k in shared}, ServerOptimizer("fedavg"), WEIGHTINGS.resolve("size"),
                         plan)
    store = store if store is not None else MemoryStore()
    clients = {f"c{i}": SiloClient(f"c{i}", ToyTask, toy_data(8 + 4 * i, seed=i), model, store, silo_recipe(cfg, plan, i))
               for i in range(n_clients)}
    return model, server, clients


def test_tied_weights_are_counted_once():
    model = TiedToy(vocab=5, dim=3)
    unique = 5 * 3 + (3 * 3 + 3) * 2  # emb/head shared, enc, dec
    assert nbytes(dict(model.named_parameters())) == unique * 4
    assert nbytes(model.state_dict()) == unique * 4  # state_dict lists the tied weight twice
    assert len(model.state_dict()) == len(dict(model.named_parameters())) + 1


@pytest.mark.parametrize("backend", ["memory", "disk"])
def test_private_tensors_never_leave_and_survive_rounds(backend, tmp_path):
    plan = ExchangePlan(shared=("*",), private=("dec.*",))
    store = MemoryStore() if backend == "memory" else DiskStore(tmp_path)
    model, server, clients = federation(plan, store=store)
    assert set(server.params) == {"emb.weight", "enc.weight", "enc.bias"}
    sent = []
    original_receive = server.receive
    server.receive = lambda c, u: sent.append(set(u.tensors)) or original_receive(c, u)
    run_round(server, clients, list(clients), 1, seed=0)
    run_round(server, clients, list(clients), 2, seed=0)  # a round that starts from kept tensors
    assert len(sent) == 4 and all(not any(n.startswith("dec.") for n in s) for s in sent)
    after_r1 = {c: store.get(c).slot("own") for c in clients}  # (after round 2: the latest)
    assert set(after_r1["c0"]) == {"dec.weight", "dec.bias"}
    assert not torch.equal(after_r1["c0"]["dec.weight"], after_r1["c1"]["dec.weight"])
    # Round 2 starts each client from its own private tensors, not from another client's.
    for name, client in clients.items():
        client.load_for_eval(server.params)
        assert torch.equal(model.dec.weight.detach(), after_r1[name]["dec.weight"])


def test_private_lr_scales_only_the_kept_tensors_steps():
    """One SGD step (batch = all 8 examples): a private tensor moves private_lr/lr times as far; the
    shared ones move exactly as without private_lr."""
    plan = ExchangePlan(shared=("*",), private=("dec.*",))
    moved = {}
    for private_lr in (None, 0.3):
        cfg = CFG.model_copy(update={"batch_size": 8, "private_lr": private_lr})
        model, server, clients = federation(plan, n_clients=1, cfg=cfg)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        update = clients["c0"].fit(1, dict(server.params), seed=0)
        assert update.steps == 1
        after = dict(model.named_parameters())
        moved[private_lr] = {k: after[k].detach() - before[k] for k in before}
    for name in ("dec.weight", "dec.bias"):
        assert moved[None][name].abs().sum() > 0
        torch.testing.assert_close(moved[0.3][name], 3 * moved[None][name])
    for name in ("emb.weight", "enc.weight", "enc.bias"):
        assert torch.equal(moved[0.3][name], moved[None][name])


def test_fixed_subset_exchange_and_bytes():
    plan = ExchangePlan(shared=("enc.*",))
    model, server, clients = federation(plan)
    record = run_round(server, clients, list(clients), 1, seed=0)
    enc_bytes = (3 * 3 + 3) * 4
    for c in record["clients"].values():
        assert c["bytes_up"] == enc_bytes and c["bytes_down"] == enc_bytes
    assert record["bytes_up"] == 2 * enc_bytes and record["bytes_down"] == 2 * enc_bytes


@register_selector("test-enc-weight-on-odd-rounds")
def _odd_round_selector(ctx):
    return ["enc.weight"] if ctx.round % 2 else list(ctx.names)


def test_per_round_selection_uploads_subset_and_server_keeps_the_rest():
    plan = ExchangePlan(upload=SELECTORS.resolve("test-enc-weight-on-odd-rounds"))
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
    register_selector("test-bad")(lambda ctx: ["dec.weight"])
    plan = ExchangePlan(private=("dec.*",), upload=SELECTORS.resolve("test-bad"))
    model, server, clients = federation(plan)
    with pytest.raises(ValueError, match="dec.weight"):
        run_round(server, clients, list(clients), 1, seed=0)


@register_selector("test-enc-only", needs_previous=True)
def _enc_only(ctx):
    # the client's end of its previous round; in round 1, the model it started from
    assert ctx.previous is not None and list(ctx.previous) == list(ctx.names)
    return [n for n in ctx.names if n.startswith("enc.")]


def test_download_only_what_was_uploaded_and_overwrite_only_that():
    """download = uploaded: round 2 sends each client only the tensors it sent in round 1; the client
    keeps its own values for everything else (they were never overwritten)."""
    plan = ExchangePlan(upload=SELECTORS.resolve("test-enc-only"), download=DOWNLOADS.resolve("uploaded"))
    model, server, clients = federation(plan)
    full = nbytes(server.params)
    r1 = run_round(server, clients, list(clients), 1, seed=0)
    assert all(c["bytes_down"] == full for c in r1["clients"].values())  # round 1: everything
    own_after_r1 = {c: clients[c].store.get(c).slot("own") for c in clients}
    assert set(own_after_r1["c0"]) == {n for n, _ in model.named_parameters()}
    payload = server.payload  # what each client receives in round 2
    received = {}
    server.payload = lambda c: received.setdefault(c, payload(c))
    r2 = run_round(server, clients, list(clients), 2, seed=0)
    assert all(set(p) == {"enc.weight", "enc.bias"} for p in received.values())
    assert all(c["bytes_down"] == (9 + 3) * 4 for c in r2["clients"].values())
    # a client's start point in round 2: its own emb/dec, the server's enc
    clients["c0"].store.set_round(1)
    clients["c0"].start_point(received["c0"], clients["c0"].store.get("c0"))
    assert torch.equal(model.emb.weight.detach(), own_after_r1["c0"]["emb.weight"])
    assert torch.equal(model.enc.weight.detach(), received["c0"]["enc.weight"])


def test_overwrite_uploaded_with_full_download_keeps_the_rest_local():
    plan = ExchangePlan(upload=SELECTORS.resolve("test-enc-only"), overwrite=OVERWRITES.resolve("uploaded"))
    model, server, clients = federation(plan)
    run_round(server, clients, list(clients), 1, seed=0)
    own = clients["c1"].store.get("c1").slot("own")
    clients["c1"].load_for_eval(server.params)
    assert torch.equal(model.dec.weight.detach(), own["dec.weight"])      # not taken: its own
    assert torch.equal(model.enc.weight.detach(), server.params["enc.weight"])  # taken: the server's


def test_bytes_down_counted_when_sent_even_without_an_answer():
    model, server, clients = federation(ExchangePlan())
    server.begin_round(1)
    server.payload("c0")
    server.payload("c1")  # c1 never answers
    server.receive("c0", clients["c0"].fit(1, server.params, seed=0))
    record = server.end_round()
    assert set(record["clients"]) == {"c0"}
    assert record["sent"] == {"c0": nbytes(server.params), "c1": nbytes(server.params)}
    assert record["bytes_down"] == 2 * nbytes(server.params)


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
    assert record["clients"]["c1"]["rejected"] == "non-finite values (NaN/Inf) in the update"
    assert record["clients"]["c0"]["weight"] == 1.0
    assert torch.isfinite(server.params["enc.weight"]).all()
    assert not torch.equal(server.params["enc.weight"], before["enc.weight"])


def test_wrong_shape_or_unknown_tensor_is_rejected_with_reason():
    model, server, clients = federation(ExchangePlan())
    server.begin_round(1)
    bad_shape = ClientUpdate({"enc.weight": torch.zeros(2, 2)}, n_examples=3)
    assert server.receive("c0", bad_shape) == "tensor 'enc.weight' has shape (2, 2), expected (3, 3)"
    unknown = ClientUpdate({"nope": torch.zeros(1)}, n_examples=3)
    assert server.receive("c1", unknown) == "unknown tensor 'nope'"
    record = server.end_round()
    assert all(c["weight"] is None for c in record["clients"].values())
