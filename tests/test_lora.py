"""LoRA (fedsilo.models.lora, fedsilo.core.lora): the surgery on every model fedsilo builds, the three
aggregation policies against Σ pᵢ·BᵢAᵢ (heterogeneous ranks too), its combinations, and the export
peft loads."""
import math
from pathlib import Path

import pytest
import torch

from fedsilo.client.silo import federated_parameters, load_tensors
from fedsilo.config import ConfigError
from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.lora import LORA_AGGREGATIONS, limit_rank, merged_delta, pairs, product_sum
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.errors import SurgeryError
from fedsilo.models import MODEL_KINDS, SURGERIES
from fedsilo.models.lora import LoraSettings
from fedsilo.models.settings import ModelConfig
from fedsilo.recipe import build_model, build_task
from fedsilo.runs.runner import run_experiment
from fedsilo.server import Server
from tests.toy import server_with
from tests.test_plugins import rounds_of, toy_config

SMALL = {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2, "dropout": 0.0}


def lora_config(aggregation="fedit", rounds=2, **options):
    return toy_config(model={**SMALL, "surgery": {"name": "lora", "options": {"rank": 4, "aggregation": aggregation,
                                                                              **options}}},
                      federation={"rounds": rounds, "weighting": "size"})


def _build(kind, name, seed=0):
    cfg = ModelConfig(kind=kind, name=name, **SMALL)
    return MODEL_KINDS.get(kind)(cfg, seed, None)


def _inputs(model, tokenizer):
    enc = tokenizer(["a short question", "another longer question here"], ["an answer", "a second answer"],
                    return_tensors="pt", padding=True)
    if getattr(model.config, "is_encoder_decoder", False):
        labels = tokenizer(["the target", "another target text"], return_tensors="pt", padding=True)["input_ids"]
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    return dict(enc)


def _output(model, batch):
    out = model(**batch)
    return out.loss if getattr(model.config, "is_encoder_decoder", False) else out.logits


def _local_bert(tmp_path) -> str:
    model, tokenizer = _build("encoder", "tiny-bert", seed=3)
    model.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    return str(tmp_path / "bert")


@pytest.mark.parametrize("kind, name", [("encoder", "tiny-bert"), ("encoder", "minilm"), ("seq2seq", "tiny-t5"),
                                        ("seq2seq", "transformer"), ("seq2seq", "minilm2bert"), ("encoder", "local")])
def test_the_surgery_adapts_every_model_fedsilo_builds_and_trains_only_the_adapters(kind, name, tmp_path):
    if name == "local":
        name = _local_bert(tmp_path)
    model, tokenizer = _build(kind, name)
    batch = _inputs(model, tokenizer)
    model.eval()
    with torch.no_grad():
        before = _output(model, batch)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = torch.get_rng_state()
    SURGERIES.get("lora")(model, LoraSettings(rank=4), seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the seeded draw leaves torch's generator alone
    trainable = federated_parameters(model)
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    assert any(".lora_A." in n for n in trainable) and len(pairs(trainable)) >= 2
    heads = [n for n in trainable if ".modules_to_save." in n]
    assert bool(heads) == (kind == "encoder")  # a new classifier trains; a tied LM head stays frozen
    with torch.no_grad():  # B = 0: the adapted model computes what the base computed
        torch.testing.assert_close(_output(model, batch), before, rtol=0, atol=1e-6)
    model.train()
    opt = torch.optim.SGD(trainable.values(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        _output(model, batch).sum().backward()
        opt.step()
    base = {n: p for n, p in model.named_parameters() if n not in trainable}
    changed = [n for n, p in trainable.items() if ".lora_B." in n and p.abs().sum() > 0]
    assert changed, "no adapter moved"
    for n, p in base.items():  # the base never moves
        original = n.replace(".base_layer.", ".").replace(".original_module.", ".")
        assert torch.equal(p, frozen_before[original]), n


def test_adapters_are_drawn_from_the_run_seed():
    a, _ = _build("encoder", "tiny-bert")
    b, _ = _build("encoder", "tiny-bert")
    c, _ = _build("encoder", "tiny-bert")
    for model, seed in ((a, 1), (b, 1), (c, 2)):
        SURGERIES.get("lora")(model, LoraSettings(rank=4), seed=seed)
    pa, pb, pc = (federated_parameters(m) for m in (a, b, c))
    name = next(n for n in pa if ".lora_A." in n)
    assert torch.equal(pa[name], pb[name]) and not torch.equal(pa[name], pc[name])
    bound = 1 / math.sqrt(pa[name].shape[1])
    largest = float(pa[name].detach().abs().max())
    assert bound / 2 < largest <= bound
    assert all(float(t.detach().abs().sum()) == 0 for n, t in pa.items() if ".lora_B." in n)


def _random_adapters(names_like: dict, rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in names_like.items()}
    return limit_rank(out, rank)


@pytest.mark.parametrize("ranks", [(4, 4, 4), (4, 2, 1)])
def test_exact_aggregation_equals_the_weighted_sum_of_the_silos_products(ranks):
    """Three silos (heterogeneous ranks: 4, 2, 1 of the layer's 4) start from A₀, B₀ = 0; the server's
    new base weight is W₀ + s·Σ pᵢBᵢAᵢ to 1e-6 relative, p by size; the adapters stay at their start."""
    g = torch.Generator().manual_seed(0)
    names = {"m.lora_A.default.weight": torch.randn(4, 6, generator=g, dtype=torch.float64),
             "m.lora_B.default.weight": torch.zeros(5, 4, dtype=torch.float64),
             "n.lora_A.default.weight": torch.randn(4, 3, generator=g, dtype=torch.float64),
             "n.lora_B.default.weight": torch.zeros(7, 4, dtype=torch.float64)}
    start = {**names, "m.base_layer.weight": torch.randn(5, 6, generator=g, dtype=torch.float64),
             "n.base_layer.weight": torch.randn(7, 3, generator=g, dtype=torch.float64),
             "head.weight": torch.randn(2, generator=g, dtype=torch.float64)}
    scaling = 2.0
    server = server_with(start, ServerOptimizer("fedavg", 1.0), WEIGHTINGS.resolve("size"), ExchangePlan(),
                         lora_merge=scaling)
    server.begin_round(1)
    uploads, sizes = [], [10, 30, 60]
    for i, (rank, n) in enumerate(zip(ranks, sizes)):
        adapters = _random_adapters(names, rank, seed=10 + i)
        up = {**adapters, "head.weight": start["head.weight"] + i}
        uploads.append(adapters)
        assert server.receive(f"s{i}", ClientUpdate({k: v.clone() for k, v in up.items()}, n)) is None
    record = server.end_round()
    assert record["applied"]
    expected = product_sum(uploads, sizes, scaling)
    for module in ("m", "n"):
        got = server.params[f"{module}.base_layer.weight"] - start[f"{module}.base_layer.weight"]
        rel = float((got - expected[module]).norm() / expected[module].norm())
        assert rel < 1e-6, (module, rel)
        # the silos' products really have their ranks (the padding rows stayed zero)
    for name in names:
        assert torch.equal(server.params[name], start[name])  # the adapters restart from the same place
    torch.testing.assert_close(server.params["head.weight"], start["head.weight"] + (0 * 10 + 1 * 30 + 2 * 60) / 100)
    low = uploads[2]
    assert torch.linalg.matrix_rank(low["m.lora_B.default.weight"] @ low["m.lora_A.default.weight"]) == ranks[2]


def test_merged_delta_takes_a_half_not_sent_as_unchanged():
    g = torch.Generator().manual_seed(1)
    ref = {"m.lora_A.x.weight": torch.randn(2, 3, generator=g), "m.lora_B.x.weight": torch.randn(4, 2, generator=g),
           "m.base_layer.weight": torch.zeros(4, 3)}
    d_b = torch.randn(4, 2, generator=g)
    out = merged_delta({"m.lora_B.x.weight": d_b}, ref, 0.5)
    torch.testing.assert_close(out["m.base_layer.weight"], 0.5 * d_b @ ref["m.lora_A.x.weight"])
    assert set(out) == {"m.base_layer.weight"}


class _Capture:
    """Each silo's upload and the server's global tensors before the round, from a real run."""

    def __init__(self, monkeypatch):
        self.uploads, self.before = {}, {}
        capture = self
        receive, begin = Server.receive, Server.begin_round

        def spy_receive(server, client, update):
            capture.uploads.setdefault(server.round, {})[client] = (
                {k: v.detach().double().clone() for k, v in update.tensors.items()}, update.n_examples)
            return receive(server, client, update)

        def spy_begin(server, round_idx, sampled=None):
            capture.before[round_idx] = {k: v.detach().double().clone() for k, v in server.params.items()}
            return begin(server, round_idx, sampled)
        monkeypatch.setattr(Server, "receive", spy_receive)
        monkeypatch.setattr(Server, "begin_round", spy_begin)


def _effective(tensors: dict, base: dict, scaling: float) -> dict:
    """Each adapted layer's effective weight W + s·B·A."""
    return {p.module: base[p.base] + scaling * tensors[p.b] @ tensors[p.a] for p in pairs(tensors)}


def test_a_real_round_exact_merges_the_silos_updates_and_fedit_does_not(tmp_path, monkeypatch, capsys):
    """The toy federation (3 silos, ranks 4, 2, 1), one real round each way. Exact: the new global effective
    weights are Σ pᵢ·(W + s·BᵢAᵢ) to 1e-6. FedIT's product of averaged factors is off that; its error is
    reported."""
    errors = {}
    for aggregation in ("exact", "fedit"):
        spy = _Capture(monkeypatch)
        cfg = lora_config(aggregation, rounds=1, ranks={"beta": 2, "gamma": 1})
        run_experiment(cfg, tmp_path / aggregation, show_progress=False)
        after = {k: v.double() for k, v in torch.load(tmp_path / aggregation / "checkpoint.pt",
                                                      weights_only=True)["server"]["params"].items()}
        before, uploads = spy.before[1], spy.uploads[1]
        weights = {c: e["weight"] for c, e in rounds_of(tmp_path / aggregation)[0]["clients"].items()}
        scaling = 16.0 / 4
        model, _ = build_model(cfg)
        base = {k: v.detach().double() for k, v in model.named_parameters()}
        base.update(before)
        target = {}
        for client, (tensors, _) in uploads.items():
            for module, w in _effective({**before, **tensors}, base, scaling).items():
                target[module] = target.get(module, 0) + weights[client] * w
        got = _effective(after, {**base, **after}, scaling)
        update = {m: target[m] - _effective(before, base, scaling)[m] for m in target}
        errors[aggregation] = max(float((got[m] - target[m]).norm() / update[m].norm()) for m in target)
        # the server keeps W in float32: the merged W carries its rounding, 2⁻²⁴·|W| per entry
        rounding = max(float(2.0 ** -24 * after_base.norm() / update[m].norm())
                       for m, after_base in ((p.module, after[p.base]) for p in pairs(after) if p.base in after)) \
            if aggregation == "exact" else 0.0
        if aggregation == "exact":
            lows = uploads["gamma"][0]
            assert all(float(t[1:].abs().sum()) == 0 for k, t in lows.items() if ".lora_A." in k)  # rank 1
        if aggregation == "exact":
            exact_bound = 4 * rounding
    with capsys.disabled():
        print(f"\nrelative error of the round's update against Σ pᵢ·BᵢAᵢ: exact {errors['exact']:.2e} (float32 "
              f"rounding of W: {exact_bound / 4:.2e}), FedIT {errors['fedit']:.2e}")
    assert errors["exact"] < exact_bound
    assert errors["fedit"] > 100 * exact_bound


def test_ffa_keeps_a_at_its_seeded_start_and_sends_only_b(tmp_path):
    cfg = lora_config("ffa")
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    model, _ = build_model(cfg)
    start = {n: p.detach() for n, p in model.named_parameters() if ".lora_A." in n}
    after = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert not any(".lora_A." in k for k in after)  # not federated at all
    names = [n for n in federated_parameters(model)]
    assert names and all(".lora_A." not in n for n in names)
    for n, p in model.named_parameters():  # the model's A is the seeded draw every silo makes
        if ".lora_A." in n:
            assert torch.equal(p, start[n])
    assert any(float(t.abs().sum()) > 0 for k, t in after.items() if ".lora_B." in k)


def test_bytes_up_are_the_adapters_and_the_head_only(tmp_path):
    full = run_experiment(toy_config(model=SMALL, federation={"rounds": 1}), tmp_path / "full", show_progress=False)
    assert full
    run_experiment(lora_config(rounds=1), tmp_path / "lora", show_progress=False)
    model, _ = build_model(lora_config())
    adapters = sum(p.numel() for p in federated_parameters(model).values())
    plain, _ = build_model(toy_config(model=SMALL))
    everything = sum(p.numel() for p in federated_parameters(plain).values())
    up_full = rounds_of(tmp_path / "full")[0]["bytes_up"]
    up_lora = rounds_of(tmp_path / "lora")[0]["bytes_up"]
    assert up_lora == 3 * 4 * adapters and up_full == 3 * 4 * everything
    assert up_lora / up_full < 0.05


def test_a_private_head_stays_with_each_silo(tmp_path):
    cfg = lora_config(head="private")
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    first = rounds_of(tmp_path / "run")[0]
    assert first["params_up"] == 3 * sum(p.numel() for n, p in federated_parameters(build_model(cfg)[0]).items()
                                         if ".lora_" in n)
    from fedsilo.client.store import DiskStore
    store = DiskStore(tmp_path / "run" / "clients")
    store.set_round(2)
    heads = [store.get(s).slot("own") for s in ("alpha", "beta", "gamma")]
    assert all(set(h) == {"classifier.modules_to_save.default.weight", "classifier.modules_to_save.default.bias"}
               for h in heads)
    assert not torch.equal(heads[0]["classifier.modules_to_save.default.weight"],
                           heads[1]["classifier.modules_to_save.default.weight"])


def test_lora_with_fedmatch_patches_shares_the_adapters_and_keeps_the_patches(tmp_path):
    cfg = toy_config(model={**SMALL, "surgery": [{"name": "lora", "options": {"rank": 4}},
                                                {"name": "patches", "options": {"size": 8}}]},
                     exchange={"private": ["*patch*"]}, federation={"rounds": 1})
    model, _ = build_model(cfg)
    trainable = federated_parameters(model)
    assert any("patch" in n for n in trainable) and any(".lora_" in n for n in trainable)
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    params = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert any(".lora_B." in k for k in params) and not any("patch" in k for k in params)


def test_lora_trains_under_dp_sgd_with_only_the_adapters_clipped_and_sent(tmp_path):
    cfg = toy_config(model={**SMALL, "surgery": {"name": "lora", "options": {"rank": 4}}},
                     client={"dp": {"noise_multiplier": 0.8, "noise": "seeded"}}, federation={"rounds": 1})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    entry = rounds_of(tmp_path / "run")[0]["clients"]["alpha"]
    assert entry["privacy"]["epsilon"] > 0
    model, _ = build_model(cfg)
    assert entry["params_up"] == sum(p.numel() for p in federated_parameters(model).values())


@pytest.mark.parametrize("model, fix, message", [
    ({"surgery": [{"name": "patches"}, {"name": "lora"}]}, {}, "list lora first"),
    ({"surgery": {"name": "lora", "options": {"rank": 4, "ranks": {"beta": 8}}}}, {},
     r"ranks.beta = 8 is not between 1 and rank = 4"),
    ({"surgery": {"name": "lora", "options": {"ranks": {"delta": 2}}}}, {}, "'delta' is not a silo of this run"),
    ({"surgery": {"name": "lora", "options": {"aggregation": "exact"}}},
     {"federation": {"secure_aggregation": {}}}, "cannot run with federation.secure_aggregation"),
    ({"surgery": {"name": "lora", "options": {"ranks": {"beta": 2}}}},
     {"client": {"dp": {"noise_multiplier": 1.0}}}, "ranks with DP-SGD"),
    ({"surgery": {"name": "lora", "options": {"aggregation": "mean"}}}, {}, "'mean' is not"),
    ({"surgery": {"name": "lora", "options": {"aggregation": "exact"}}}, {"exchange": {"overwrite": "uploaded"}},
     "exchange.overwrite = 'uploaded' cannot run with model.surgery.options.aggregation"),
])
def test_lora_combinations_that_cannot_hold_are_refused_by_name(model, fix, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(model={**SMALL, **model}, **fix)


def test_an_unknown_target_layer_is_one_line_naming_it():
    model, _ = _build("encoder", "tiny-bert")
    with pytest.raises(SurgeryError, match=r"lora: .*q_proj"):
        SURGERIES.get("lora")(model, LoraSettings(target_modules=["q_proj"]), seed=0)


def test_registered_policies():
    assert set(LORA_AGGREGATIONS) >= {"fedit", "ffa", "exact"}
    assert LORA_AGGREGATIONS.get("ffa").freeze_a and LORA_AGGREGATIONS.get("exact").merge


def _scores_match(run: Path, out: Path, silo: str | None = None):
    from peft import PeftModel

    from fedsilo.config import load_config
    from fedsilo.runs.export import _without_lora
    from fedsilo.client.store import DiskStore

    cfg = load_config(run / "config.toml")
    model, tokenizer = build_model(cfg)
    state = torch.load(run / "best.pt", weights_only=True)
    load_tensors(model, state["server"]["params"])
    if silo:
        store = DiskStore(run / "clients")
        store.set_round(state["round"])
        load_tensors(model, store.get(silo).slot("own"))
    base, _ = build_model(_without_lora(cfg))
    task = build_task(cfg, tokenizer)
    batch = task.collate(task.examples("beta", "test"))
    with torch.no_grad():
        plain = task.scores(base, batch)
        peft_model = PeftModel.from_pretrained(base, str(out)).eval()
        return task.scores(model, batch), task.scores(peft_model, batch), plain


@pytest.mark.parametrize("aggregation, head", [("fedit", None), ("exact", None), ("fedit", "private")])
def test_the_exported_adapters_load_with_peft_and_score_as_fedsilo(tmp_path, aggregation, head, capsys):
    from fedsilo.cli import main

    options = {"head": head} if head else {}
    run_experiment(lora_config(aggregation, **options), tmp_path / "run", show_progress=False)
    silo = "beta" if head == "private" else None
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"),
                 *(["--silo", silo] if silo else [])]) == 0
    assert "adapters:" in capsys.readouterr().out
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    ours, theirs, plain = _scores_match(tmp_path / "run", tmp_path / "adapter", silo)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert float((ours - plain).abs().max()) > 1e-4  # the adapters change the scores: the check can fail


def test_export_of_a_run_without_lora_is_its_whole_model_and_no_adapters(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from fedsilo.cli import main
    from fedsilo.runs.export import export_adapters

    run_experiment(toy_config(model=SMALL, federation={"rounds": 1}), tmp_path / "run", show_progress=False)
    with pytest.raises(ConfigError, match="has no lora surgery"):
        export_adapters(tmp_path / "run", tmp_path / "adapter")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 0  # --merged implied
    assert "whole model" in capsys.readouterr().out
    exported = dict(AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "x")).named_parameters())
    for name, t in torch.load(tmp_path / "run" / "best.pt", weights_only=True)["server"]["params"].items():
        assert torch.equal(exported[name], t), name


def test_lora_on_flower_simulation_equals_in_process(tmp_path, monkeypatch):
    import os

    from tests.parity import local_and_simulation

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(model={**SMALL, "surgery": {"name": "lora", "options": {"rank": 4, "aggregation": "exact",
                                                                             "ranks": {"gamma": 2}}}},
                     federation={"rounds": 2, "weighting": "size"}, engine={"workers": 1})
    local, sim = local_and_simulation(cfg, tmp_path)
    pa = torch.load(local / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(sim / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert set(pa) == set(pb)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
    for a, b in zip(rounds_of(local), rounds_of(sim), strict=True):
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]


@pytest.mark.parametrize("name, sections", [
    ("lorar", {"federation": {"rounds": 2, "weighting": "lorar"}, "task": {"n_train": 24}}),  # ΔL needs steps
    ("fedopt", {"server": {"optimizer": "adam", "lr": 0.01}}),
    ("fedprox", {"client": {"regularizers": {"prox": 0.5}}}),
    ("dynamic pulling", {"exchange": {"upload": "dp_g", "overwrite": "uploaded",
                                      "upload_options": {"share": 0.5, "threshold": "count"}}}),
])
def test_lora_combines_with_each_federation_method(tmp_path, name, sections):
    """Each method on the adapters alone: the rounds apply, only adapters (and the head) travel, and the
    method's mark is in the record (Lorar's weights from ΔL, FedOPT's step, FedProx's term, a partial upload)."""
    # dropout as the toy's default: without it this tiny model's losses log as 1.0000 and ΔL is 0
    model = {**SMALL, "dropout": 0.1, "surgery": {"name": "lora", "options": {"rank": 4}}}
    cfg = toy_config(model=model, **{"federation": {"rounds": 2, "weighting": "size"}, **sections})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    trainable = federated_parameters(build_model(cfg)[0])
    full = sum(p.numel() for p in trainable.values())
    records = rounds_of(tmp_path / "run")
    assert all(r["applied"] for r in records)
    entries = [e for r in records for e in r["clients"].values()]
    assert all(0 < e["params_up"] <= full for e in entries)
    if name == "lorar":
        assert records[0]["weighting"] == "lorar" and all(e["delta_loss"] is not None for e in entries)
        weights = [e["weight"] for e in records[0]["clients"].values()]
        assert len(set(round(w, 9) for w in weights)) > 1  # not the equal sizes' weights
    if name == "fedprox":
        assert all("prox" in e["terms"] for e in entries)
    if name == "dynamic pulling":
        assert any(e["params_up"] < full for e in entries)
    if name == "fedopt":
        after = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]
        assert after["optimizer"]  # Adam's moments over the adapters


def test_a_lower_rank_silo_sends_adapters_of_its_rank_under_ffa_too(tmp_path, monkeypatch):
    """FFA's A is frozen, not federated: the silo zeroes its rows all the same, so B's padded columns get no
    gradient and its upload is rank 2."""
    spy = _Capture(monkeypatch)
    run_experiment(lora_config("ffa", rounds=1, ranks={"gamma": 2}), tmp_path / "run", show_progress=False)
    uploads = spy.uploads[1]
    b_names = [k for k in uploads["gamma"][0] if ".lora_B." in k]
    assert b_names
    for name in b_names:
        assert float(uploads["gamma"][0][name][:, 2:].abs().sum()) == 0
        assert float(uploads["alpha"][0][name][:, 2:].abs().sum()) > 0
