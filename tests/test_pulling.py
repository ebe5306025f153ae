"""Dynamic Pulling selectors (dp_g, dp_l, random) and Controllers-style fixed exchange, on toy tensors
whose per-tensor changes are known, and on a toy encoder-decoder whose tensors are sized evenly."""
import statistics
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from fedsilo.client.silo import SiloClient
from fedsilo.client.store import MemoryStore
from fedsilo.config import ClientConfig, validate
from fedsilo.core.exchange import SELECTORS, ExchangePlan, SelectionContext
from fedsilo.core.pulling import PullingSettings, groups, quantile
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.engines.local import run_round
from fedsilo.server import Server

ENC = [f"model.encoder.layers.{i}.w" for i in range(6)]
DEC = [f"model.decoder.layers.{i}.w" for i in range(4)]
NAMES = ["model.shared.weight", *ENC, *DEC]
# change of each tensor between the client's previous round and now
CHANGE = {"model.shared.weight": 50.0, **dict(zip(ENC, [1.0, 6.0, 2.0, 5.0, 3.0, 4.0])),
          **dict(zip(DEC, [40.0, 10.0, 30.0, 20.0]))}


def context(changes=CHANGE, previous=True, round_idx=2, **options):
    prev = {n: torch.zeros(4) for n in changes}
    now = {n: torch.tensor([c, 0.0, 0.0, 0.0]) for n, c in changes.items()}  # ‖now − prev‖ = c
    return SelectionContext(round_idx, "c0", list(changes), now, prev if previous else None, seed=7,
                            options=PullingSettings(**options))


def choose(selector, ctx):
    return ExchangePlan(upload=selector, upload_options=ctx.options).choose_upload(ctx)


def test_groups_put_embeddings_where_the_setting_says():
    s = PullingSettings()
    assert groups(NAMES, s) == ([ENC, ["model.shared.weight", *DEC]], [])
    assert groups(NAMES, PullingSettings(other="encoder"))[0][0] == ["model.shared.weight", *ENC]
    assert groups(NAMES, PullingSettings(other="own"))[0] == [ENC, DEC, ["model.shared.weight"]]
    assert groups(NAMES, PullingSettings(other="always")) == ([ENC, DEC], ["model.shared.weight"])
    assert groups(NAMES, PullingSettings(other="never")) == ([ENC, DEC], [])


def test_dp_g_and_dp_l_split_each_group_at_its_own_median():
    enc_median = statistics.median(CHANGE[n] for n in ENC)                                   # 3.5
    dec_median = statistics.median(CHANGE[n] for n in ["model.shared.weight", *DEC])         # 30
    g, l_ = choose("dp_g", context()), choose("dp_l", context())
    assert set(g) == {n for n in ENC if CHANGE[n] >= enc_median} | {
        n for n in ["model.shared.weight", *DEC] if CHANGE[n] >= dec_median}
    assert set(l_) == {n for n in ENC if CHANGE[n] < enc_median} | {
        n for n in ["model.shared.weight", *DEC] if CHANGE[n] < dec_median}
    # one threshold over all tensors would have sent no encoder tensor with dp_g
    assert {n for n in g if n in ENC} == {ENC[1], ENC[3], ENC[5]}
    assert set(g) | set(l_) == set(NAMES) and not set(g) & set(l_)
    assert g == [n for n in NAMES if n in set(g)]  # model order


def test_equal_changes_at_the_threshold_go_to_dp_g():
    changes = {"encoder.a": 1.0, "encoder.b": 2.0, "encoder.c": 2.0, "encoder.d": 3.0}
    assert choose("dp_g", context(changes)) == ["encoder.b", "encoder.c", "encoder.d"]  # c ≥ θ = 2
    assert choose("dp_l", context(changes)) == ["encoder.a"]                            # c < θ


def test_a_clients_first_round_sends_everything():
    for selector in ("dp_g", "dp_l", "random"):
        assert choose(selector, context(previous=False)) == NAMES


def test_random_takes_as_many_per_group_as_dp_l_and_is_seeded():
    ctx = context()
    picked = choose("random", ctx)
    lower = choose("dp_l", ctx)
    for group in (ENC, ["model.shared.weight", *DEC]):
        assert len([n for n in picked if n in group]) == len([n for n in lower if n in group])
    assert choose("random", context()) == picked                      # same seed, round, client
    other_rounds = {tuple(choose("random", context(round_idx=r))) for r in range(2, 12)}
    assert len(other_rounds) > 1                                       # not a fixed subset


def test_a_third_of_each_group():
    enc = {f"encoder.{i}": float(i) for i in range(12)}
    dec = {f"decoder.{i}": float(10 * i) for i in range(12)}
    g = choose("dp_g", context({**enc, **dec}, share=1 / 3))
    l_ = choose("dp_l", context({**enc, **dec}, share=1 / 3))
    assert g == [f"encoder.{i}" for i in range(8, 12)] + [f"decoder.{i}" for i in range(8, 12)]
    assert l_ == [f"encoder.{i}" for i in range(4)] + [f"decoder.{i}" for i in range(4)]


def test_quantile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0.0, 0.2, 1 / 3, 0.5, 0.9, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_rms_measure_ranks_by_change_per_entry():
    prev = {"encoder.big": torch.zeros(100), "encoder.small": torch.zeros(1)}
    now = {"encoder.big": torch.full((100,), 0.2), "encoder.small": torch.tensor([1.0])}  # norms 2 vs 1
    for measure, expected in (("norm", ["encoder.small"]), ("rms", ["encoder.big"])):
        ctx = SelectionContext(2, "c", list(prev), now, prev, options=PullingSettings(measure=measure))
        assert choose("dp_l", ctx) == expected


def test_settings_are_validated_in_the_config():
    with pytest.raises(Exception, match="share"):
        validate({"exchange": {"upload": "dp_l", "upload_options": {"share": 1.5}}})
    with pytest.raises(Exception, match="other"):
        validate({"exchange": {"upload": "dp_g", "upload_options": {"other": "elsewhere"}}})
    with pytest.raises(ValidationError):
        PullingSettings(shares=0.3)
    assert SELECTORS.get("dp_l").needs_previous


# ---- in a federation: bytes, download and overwrite ------------------------------------------

class EvenSeq2Seq(nn.Module):
    """8 encoder and 8 decoder tensors of the same size, and a frozen position table."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(8))
        self.decoder = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(8))
        self.positions = nn.Parameter(torch.randn(dim), requires_grad=False)

    def forward(self, x, y):
        h = x + self.positions
        for layer in [*self.encoder, *self.decoder]:
            h = torch.tanh(layer(h))
        return SimpleNamespace(loss=((h - y) ** 2).mean())


class VectorTask:
    name = "vectors"

    @staticmethod
    def collate(batch):
        return {"x": torch.stack([b[0] for b in batch]), "y": torch.stack([b[1] for b in batch])}

    @staticmethod
    def loss(model, batch):
        return {"task": model(**batch).loss}


def vector_data(n, seed, dim=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(dim, generator=g), torch.randn(dim, generator=g)) for _ in range(n)]


def dp_federation(upload="dp_l", download="all", overwrite="uploaded", n_clients=3, options=None):
    torch.manual_seed(0)
    model = EvenSeq2Seq()
    plan = ExchangePlan(upload=upload, upload_options=PullingSettings(**(options or {})),
                        download=download, overwrite=overwrite)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    server = Server({k: p.detach() for k, p in params.items()}, ServerOptimizer("fedavg"), "size", plan)
    store = MemoryStore()
    cfg = ClientConfig(epochs=1, lr=0.5, batch_size=4, optimizer="sgd", max_grad_norm=0)
    clients = {f"c{i}": SiloClient(f"c{i}", i, vector_data(8, seed=i), VectorTask, cfg, model, plan, store, {})
               for i in range(n_clients)}
    return model, server, clients


def test_a_dp_l_round_uploads_half_the_bytes_of_a_full_round():
    _, server, clients = dp_federation()
    first = run_round(server, clients, list(clients), 1, seed=0)
    second = run_round(server, clients, list(clients), 2, seed=0)
    assert "positions" not in server.params  # frozen: never federated
    full = first["clients"]["c0"]["bytes_up"]
    assert full == 16 * 6 * 6 * 4
    for c in clients:
        assert second["clients"][c]["bytes_up"] == pytest.approx(full / 2, rel=0.05)
        assert second["clients"][c]["params_up"] == 16 * 36 / 2
        assert second["clients"][c]["bytes_down"] == full  # upload only: everything comes down
    assert second["bytes_up"] == pytest.approx(first["bytes_up"] / 2, rel=0.05)


def test_download_selection_too_halves_the_bytes_down():
    _, server, clients = dp_federation(download="uploaded")
    run_round(server, clients, list(clients), 1, seed=0)
    second = run_round(server, clients, list(clients), 2, seed=0)
    third = run_round(server, clients, list(clients), 3, seed=0)
    assert second["clients"]["c0"]["bytes_down"] == 16 * 36 * 4  # it sent everything in round 1
    assert third["clients"]["c0"]["bytes_down"] == second["clients"]["c0"]["bytes_up"]


def test_a_client_overwrites_only_what_it_uploaded_and_the_server_averages_senders_only():
    model, server, clients = dp_federation(n_clients=2)
    run_round(server, clients, list(clients), 1, seed=0)
    before = dict(server.params)
    sent = {}
    receive = server.receive
    server.receive = lambda c, u: sent.setdefault(c, u) and receive(c, u)
    run_round(server, clients, list(clients), 2, seed=0)
    a, b = set(sent["c0"].tensors), set(sent["c1"].tensors)
    for name in server.params:
        senders = [u for u in sent.values() if name in u.tensors]
        if not senders:
            assert torch.equal(server.params[name], before[name])  # nobody sent it: unchanged
        else:
            expected = sum(u.tensors[name] for u in senders) / len(senders)  # equal sizes: plain mean
            assert torch.allclose(server.params[name], expected, atol=1e-6)
    # c0's next start: the global value of what it uploaded, its own value of the rest
    own = clients["c0"].store.get("c0").slot("own")
    clients["c0"].load_for_eval(server.params)
    params = dict(model.named_parameters())
    for name in server.params:
        want = server.params[name] if name in a else own[name]
        assert torch.equal(params[name].detach(), want), name
    assert a != b or a  # the selection is per client (usually different); never empty here


def test_controllers_exchange_fixed_layers_only():
    cfg = validate({"exchange": {"shared": ["encoder.0.*", "encoder.3.*", "decoder.0.*", "decoder.3.*"]}})
    plan = ExchangePlan(tuple(cfg.exchange.shared))
    model = EvenSeq2Seq()
    shared, private = plan.split(n for n, p in model.named_parameters() if p.requires_grad)
    assert shared == ["encoder.0.weight", "encoder.3.weight", "decoder.0.weight", "decoder.3.weight"]
    assert len(private) == 12
