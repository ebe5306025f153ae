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
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS, ExchangePlan, SelectionContext
from fedsilo.core.pulling import PullingSettings, change, groups, leading_share, quantile
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.engines.local import run_round
from fedsilo.recipe import silo_recipe
from tests.toy import server_with

ENC = [f"model.encoder.layers.{i}.w" for i in range(6)]
DEC = [f"model.decoder.layers.{i}.w" for i in range(4)]
NAMES = ["model.shared.weight", *ENC, *DEC]
# change of each tensor between the client's previous round and now
CHANGE = {"model.shared.weight": 50.0, **dict(zip(ENC, [1.0, 6.0, 2.0, 5.0, 3.0, 4.0])),
          **dict(zip(DEC, [40.0, 10.0, 30.0, 20.0]))}


def context(changes=CHANGE, previous=True, round_idx=2, sizes=None, **options):
    """‖now − prev‖ = c for every measure: one entry of each tensor moved by c (tensors of 4 entries, or
    `sizes[name]`)."""
    sizes = sizes or {}
    prev = {n: torch.zeros(sizes.get(n, 4)) for n in changes}
    now = {n: torch.zeros(sizes.get(n, 4)) for n in changes}
    for n, c in changes.items():
        now[n][0] = c
    return SelectionContext(round_idx, "c0", list(changes), now, prev if previous else None, seed=7,
                            options=PullingSettings(**options))


def choose(selector, ctx):
    return ExchangePlan(upload=SELECTORS.resolve(selector, ctx.options)).choose_upload(ctx)


def test_groups_put_embeddings_where_the_setting_says():
    s = PullingSettings()
    assert groups(NAMES, s) == ([ENC, ["model.shared.weight", *DEC]], [])
    assert groups(NAMES, PullingSettings(other="encoder"))[0][0] == ["model.shared.weight", *ENC]
    assert groups(NAMES, PullingSettings(other="own"))[0] == [ENC, DEC, ["model.shared.weight"]]
    assert groups(NAMES, PullingSettings(other="always")) == ([ENC, DEC], ["model.shared.weight"])
    assert groups(NAMES, PullingSettings(other="never")) == ([ENC, DEC], [])


def test_count_threshold_splits_each_group_at_its_own_median():
    enc_median = statistics.median(CHANGE[n] for n in ENC)                                   # 3.5
    dec_median = statistics.median(CHANGE[n] for n in ["model.shared.weight", *DEC])         # 30
    g, l_ = choose("dp_g", context(threshold="count")), choose("dp_l", context(threshold="count"))
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
    assert choose("dp_g", context(changes, threshold="count")) == ["encoder.b", "encoder.c", "encoder.d"]  # c ≥ θ = 2
    assert choose("dp_l", context(changes, threshold="count")) == ["encoder.a"]                            # c < θ


def test_without_a_reference_a_selector_sends_everything():
    for selector in ("dp_g", "dp_l", "random"):
        assert choose(selector, context(previous=False)) == NAMES


# sizes vary 1000×, as a Transformer's biases and matrices do; changes are ranked as the names' order
SIZED = {"encoder.bias0": 1, "encoder.bias1": 1, "encoder.w0": 1000, "encoder.w1": 1000, "encoder.w2": 1000,
         "encoder.w3": 1000, "decoder.bias": 1, "decoder.w0": 500, "decoder.w1": 500}
SIZED_CHANGE = {"encoder.bias0": 1.0, "encoder.bias1": 2.0, "encoder.w0": 3.0, "encoder.w1": 4.0,
                "encoder.w2": 5.0, "encoder.w3": 6.0, "decoder.bias": 1.0, "decoder.w0": 2.0, "decoder.w1": 3.0}


def params(names):
    return sum(SIZED[n] for n in names)


def test_parameter_threshold_takes_half_of_each_groups_parameters():
    ctx = context(SIZED_CHANGE, sizes=SIZED)
    l_, g = choose("dp_l", ctx), choose("dp_g", ctx)
    # least changed first until half of each group's parameters: 2 biases + w0 + w1 (2002 of 4002), bias + w0
    assert l_ == ["encoder.bias0", "encoder.bias1", "encoder.w0", "encoder.w1", "decoder.bias", "decoder.w0"]
    assert g == ["encoder.w2", "encoder.w3", "decoder.w1"]
    assert set(l_) | set(g) == set(SIZED) and not set(l_) & set(g)  # at half, complements
    # the count median would have sent DP_l the biases and one matrix only
    counted = choose("dp_l", context(SIZED_CHANGE, sizes=SIZED, threshold="count"))
    assert params(counted) < params(l_) / 2


def test_the_cut_is_the_one_nearest_the_share():
    ranked = ["a", "b", "c"]
    assert leading_share(ranked, {"a": 10, "b": 80, "c": 10}, 0.5) == ["a"]           # 10 is nearer 50 than 90
    assert leading_share(ranked, {"a": 40, "b": 20, "c": 40}, 0.5) == ["a"]           # 40 vs 60: a tie, the shorter
    assert leading_share(ranked, {"a": 30, "b": 30, "c": 40}, 0.5) == ["a", "b"]      # 60 is nearer than 30
    assert leading_share(ranked, {"a": 1, "b": 1, "c": 1}, 1 / 3) == ["a"]


def test_a_third_of_the_parameters():
    ctx = context(SIZED_CHANGE, sizes=SIZED, share=1 / 3)
    l_, g = choose("dp_l", ctx), choose("dp_g", ctx)
    assert params([n for n in l_ if n.startswith("encoder")]) == 1002   # nearest 1334 of 4002
    assert params([n for n in g if n.startswith("encoder")]) == 1000
    assert [n for n in g if n.startswith("decoder")] == ["decoder.w1"]   # 500 of 1001


def test_random_holds_as_many_parameters_as_dp_l_and_is_seeded():
    sizes = {f"encoder.{i}": 10 * (i + 1) for i in range(20)}
    changes = {n: float(i) for i, n in enumerate(sizes)}
    lower = params_of = sum(sizes[n] for n in choose("dp_l", context(changes, sizes=sizes)))
    for r in range(2, 12):
        picked = choose("random", context(changes, sizes=sizes, round_idx=r))
        assert abs(sum(sizes[n] for n in picked) - lower) <= 0.05 * lower
    assert params_of == pytest.approx(sum(sizes.values()) / 2, abs=10)
    assert len({tuple(choose("random", context(changes, sizes=sizes, round_idx=r))) for r in range(2, 12)}) > 1


def test_random_takes_as_many_tensors_per_group_as_dp_l_by_count_and_is_seeded():
    ctx = context(threshold="count")
    picked = choose("random", ctx)
    lower = choose("dp_l", ctx)
    for group in (ENC, ["model.shared.weight", *DEC]):
        assert len([n for n in picked if n in group]) == len([n for n in lower if n in group])
    assert choose("random", context(threshold="count")) == picked       # same seed, round, client
    other_rounds = {tuple(choose("random", context(round_idx=r, threshold="count"))) for r in range(2, 12)}
    assert len(other_rounds) > 1                                       # not a fixed subset


def test_a_third_of_each_groups_tensors_by_count():
    enc = {f"encoder.{i}": float(i) for i in range(12)}
    dec = {f"decoder.{i}": float(10 * i) for i in range(12)}
    g = choose("dp_g", context({**enc, **dec}, share=1 / 3, threshold="count"))
    l_ = choose("dp_l", context({**enc, **dec}, share=1 / 3, threshold="count"))
    assert g == [f"encoder.{i}" for i in range(8, 12)] + [f"decoder.{i}" for i in range(8, 12)]
    assert l_ == [f"encoder.{i}" for i in range(4)] + [f"decoder.{i}" for i in range(4)]


def test_quantile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0.0, 0.2, 1 / 3, 0.5, 0.9, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_measures_rank_by_l2_l1_or_change_per_entry():
    prev = {"encoder.big": torch.zeros(100), "encoder.small": torch.zeros(4)}
    # big: l2 2.0, l1 20, mean 0.2; small: l2 1.5, l1 3, mean 0.75
    now = {"encoder.big": torch.full((100,), 0.2), "encoder.small": torch.tensor([1.5, 0.0, 0.0, 0.0])}
    expected = {"l2": 1.5 < 2.0, "norm": True, "l1": 3 < 20, "mean_abs": 0.75 < 0.2}  # small changed least?
    for measure, small_least in expected.items():
        ctx = SelectionContext(2, "c", list(prev), now, prev,
                               options=PullingSettings(measure=measure, threshold="count"))
        assert choose("dp_l", ctx) == (["encoder.small"] if small_least else ["encoder.big"]), measure
    assert PullingSettings(measure="norm").measure == "l2"
    assert change(now["encoder.big"], prev["encoder.big"], "l1") == pytest.approx(20.0)


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
    plan = ExchangePlan(upload=SELECTORS.resolve(upload, PullingSettings(**(options or {}))),
                        download=DOWNLOADS.resolve(download), overwrite=OVERWRITES.resolve(overwrite))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    server = server_with({k: p.detach() for k, p in params.items()}, ServerOptimizer("fedavg"), WEIGHTINGS.resolve("size"),
                         plan)
    store = MemoryStore()
    cfg = ClientConfig(epochs=1, lr=0.5, batch_size=4, optimizer="sgd", max_grad_norm=0)
    clients = {f"c{i}": SiloClient(f"c{i}", VectorTask, vector_data(8, seed=i), model, store, silo_recipe(cfg, plan, i))
               for i in range(n_clients)}
    return model, server, clients


def test_every_dp_l_round_uploads_half_the_bytes_the_first_too():
    _, server, clients = dp_federation()
    first = run_round(server, clients, list(clients), 1, seed=0)
    second = run_round(server, clients, list(clients), 2, seed=0)
    assert "positions" not in server.params  # frozen: never federated
    full = 16 * 6 * 6 * 4
    for record in (first, second):
        for c in clients:
            assert record["clients"][c]["bytes_up"] == pytest.approx(full / 2, rel=0.05)
            assert record["clients"][c]["params_up"] == 16 * 36 / 2
            assert record["clients"][c]["bytes_down"] == full  # upload only: everything comes down


def test_round_one_ranks_against_the_start_model():
    model, server, clients = dp_federation(n_clients=1)
    start = {k: v.clone() for k, v in server.params.items()}
    sent = {}
    receive = server.receive
    server.receive = lambda c, u: sent.setdefault(c, u) and receive(c, u)
    run_round(server, clients, list(clients), 1, seed=0)
    now = clients["c0"].store.get("c0").slot("own")
    for group in ("encoder", "decoder"):
        names = [n for n in start if n.startswith(group)]
        moved = sorted(names, key=lambda n: float((now[n] - start[n]).norm()))
        assert [n for n in names if n in sent["c0"].tensors] == sorted(moved[:4], key=names.index)


def test_download_selection_too_halves_the_bytes_down():
    _, server, clients = dp_federation(download="uploaded")
    first = run_round(server, clients, list(clients), 1, seed=0)
    second = run_round(server, clients, list(clients), 2, seed=0)
    third = run_round(server, clients, list(clients), 3, seed=0)
    assert first["clients"]["c0"]["bytes_down"] == 16 * 36 * 4  # nothing uploaded yet: everything
    assert second["clients"]["c0"]["bytes_down"] == first["clients"]["c0"]["bytes_up"] == 16 * 36 * 4 / 2
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


# ---- Controllers 8E8D: fresh layers inserted and exchanged alone ----------------------------------

def tiny_marian(seed=0):
    from fedsilo.config import ModelConfig
    from fedsilo.models.seq2seq import build_seq2seq
    cfg = ModelConfig(name="transformer", d_model=16, d_ff=32, num_layers=3, num_decoder_layers=3,
                      num_heads=2, dropout=0.0)
    return build_seq2seq(cfg, seed=seed)


def test_controllers_are_fresh_layers_after_the_named_base_layers(tmp_path):
    from fedsilo.client.silo import federated_parameters
    from fedsilo.models.controllers import ControllerSettings, apply_controllers
    from fedsilo.rundir.layout import init_tensors
    model, tok = tiny_marian()
    base = {k: v.detach().clone() for k, v in federated_parameters(model).items()}
    torch.save(base, tmp_path / "base.pt")
    apply_controllers(model, ControllerSettings(after=[2, 0]), seed=3)
    for stack in (model.model.encoder.layers, model.model.decoder.layers):
        assert list(dict(stack.named_children())) == ["0", "controller0", "1", "2", "controller1"]
        assert stack[1] is stack.controller0 and len(stack) == 5
    assert model.config.encoder_layers == model.config.decoder_layers == 5
    assert [stack.self_attn.layer_idx for stack in model.model.decoder.layers] == list(range(5))
    params = federated_parameters(model)
    assert all(torch.equal(params[k], v) for k, v in base.items())  # the base layers keep their names and values
    # a base checkpoint (the generic engine) loads by name; only the controllers have no values in it
    fresh = {n for n in params if ".controller" in n}
    assert len(fresh) == 2 * 16 + 2 * 26  # encoder layer: 16 tensors; decoder layer: 26 (cross-attention)
    with pytest.warns(UserWarning, match=f"no values for {len(fresh)} of"):
        loaded = init_tensors(tmp_path / "base.pt", params)
    assert set(params) - set(loaded) == fresh
    # seeded: the same seed gives the same controllers, another seed others
    again, _ = tiny_marian()
    apply_controllers(again, ControllerSettings(after=[0, 2]), seed=3)
    other, _ = tiny_marian()
    apply_controllers(other, ControllerSettings(after=[0, 2]), seed=4)
    name = "model.decoder.layers.controller1.fc1.weight"
    assert torch.equal(dict(again.named_parameters())[name], params[name])
    assert not torch.equal(dict(other.named_parameters())[name], params[name])
    # the controllers are exchanged, everything else stays on the client
    shared, private = ExchangePlan(("*.controller*",)).split(params)
    assert set(shared) == fresh and len(private) == len(base)


def test_controllers_change_the_output_and_generation_uses_the_cache_correctly():
    from fedsilo.models.controllers import ControllerSettings, apply_controllers
    model, tok = tiny_marian()
    enc = tok(["hello world", "a b c d e"], return_tensors="pt", padding=True)
    enc.pop("token_type_ids", None)
    labels = tok(["x y", "z"], return_tensors="pt", padding=True)["input_ids"]
    before = model(**enc, labels=labels).logits
    apply_controllers(model, ControllerSettings(after=[0, 2]), seed=0)
    model.eval()
    after = model(**enc, labels=labels).logits
    assert not torch.allclose(before, after)
    cached = model.generate(**enc, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = model.generate(**enc, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_controllers_refuse_what_they_cannot_do():
    from fedsilo.models.controllers import ControllerSettings, apply_controllers
    model, _ = tiny_marian()
    with pytest.raises(ValueError, match="after = 3, but the encoder has 3 layers"):
        apply_controllers(model, ControllerSettings(after=[0, 3]), seed=0)
    with pytest.raises(ValueError, match="distinct"):
        ControllerSettings(after=[1, 1])
    apply_controllers(model, ControllerSettings(after=[0]), seed=0)
    with pytest.raises(ValueError, match="applied twice"):
        apply_controllers(model, ControllerSettings(after=[0]), seed=0)
    with pytest.raises(ValueError, match="no encoder.layers"):
        apply_controllers(EvenSeq2Seq(), ControllerSettings(after=[0]), seed=0)
    with pytest.raises(Exception, match="after"):
        validate({"model": {"surgery": {"name": "controllers", "options": {"after": []}}}})
