"""FewFedWeight on the engine's plug-in points (pseudo labels from the global model, energy token
weights, personal models in the store, loss-proportional aggregation), its baselines (Data Silo DA,
Ditto, Meta Weighting) and its ablations, end to end on four tiny tasks with a tiny T5."""
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedsilo.client.meta import meta_weights
from fedsilo.client.store import DiskStore
from fedsilo.config import ConfigError, validate
from fedsilo.recipe import build_model, build_task
from fedsilo.runs.runner import run_experiment
from tests import mtoy


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("cache")))
        yield mtoy.write_data(tmp_path_factory.mktemp("data"))


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def run(data, out, **sections):
    return run_experiment(validate(mtoy.config(data, **sections)), out, show_progress=False)


def fewfedweight(**changes) -> dict:
    sections = {k: dict(v) for k, v in mtoy.FEWFEDWEIGHT.items()}
    for key, value in changes.items():
        sections[key] = {**sections.get(key, {}), **value}
    return sections


@pytest.fixture(scope="module")
def ffw(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ffw") / "run"
    return out, run(data, out, **fewfedweight(federation={"rounds": 3}))


def test_aggregation_weights_are_the_clients_losses_share(ffw):
    out, _ = ffw
    for record in rounds_of(out):
        clients = record["clients"]
        total = sum(c["mean_loss"] for c in clients.values())
        for c in clients.values():
            # δ_i = L_i / Σ L_j, with L_i = L_pseudo + L_annotated: the personal regulariser left out
            assert c["weight"] == pytest.approx(c["mean_loss"] / total, rel=1e-9)
            assert c["mean_loss"] == pytest.approx(c["terms"]["annotated"] + c["terms"]["pseudo"], rel=1e-6)
            assert c["terms"]["personal"] > 0 if record["round"] > 1 else True
        assert len({round(c["weight"], 9) for c in clients.values()}) == len(clients)  # not size weights


def test_personal_models_stay_in_the_store_and_differ_from_the_global(ffw, data):
    out, results = ffw
    store = DiskStore(out / "clients")
    store.set_round(3)
    own = {c: store.get(c).slot("own") for c in ("client_1", "client_2")}
    server = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    for c, tensors in own.items():
        assert tensors.keys() == server.keys()  # the whole personal model
        assert any(not torch.equal(tensors[k], server[k]) for k in server)
    assert any(not torch.equal(own["client_1"][k], own["client_2"][k]) for k in server)
    assert {(r["client"], r["task"]) for r in results["test"]["rows"]} == {
        (c, t) for c, ts in validate(mtoy.config(data)).task.assignment_map().items() for t in ts}


def test_resume_equals_an_uninterrupted_run(ffw, data, tmp_path):
    full, _ = ffw
    out = tmp_path / "resumed"
    run(data, out, **fewfedweight(federation={"rounds": 2}))
    run_experiment(validate(mtoy.config(data, **fewfedweight(federation={"rounds": 3}))), out, resume=True,
                   show_progress=False)
    a = torch.load(full / "checkpoint.pt", weights_only=True)["server"]["params"]
    b = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = DiskStore(full / "clients"), DiskStore(out / "clients")
    for s in (sa, sb):
        s.set_round(3)
    for c in ("client_1", "client_2"):
        x, y = sa.get(c).slot("own"), sb.get(c).slot("own")
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert rounds_of(full)[-1]["clients"]["client_1"]["mean_loss"] == rounds_of(out)[-1]["clients"]["client_1"]["mean_loss"]


def test_pseudo_labels_come_from_the_labelling_model_with_energy_weights(data):
    from fedsilo.client.hooks import PSEUDO_SOURCES, HookContext, ROUND_HOOKS
    from fedsilo.client.pseudo import PseudoSettings, token_weights

    cfg = validate(mtoy.config(data))
    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    examples = task.examples("client_1", "train")[:5]
    received = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx = HookContext("client_1", 1, 0, model, examples, received, {}, PSEUDO_SOURCES.resolve("global"), task,
                      PseudoSettings(top_k=3))
    out = ROUND_HOOKS.get("pseudo_labels").run(ctx)
    assert [e.source for e in out] == [e.source for e in examples] and all(e.pseudo for e in out)
    for e in out:
        enc = tokenizer([e.source], return_tensors="pt", return_token_type_ids=False)
        ids = model.generate(**enc, max_new_tokens=cfg.task.max_target_length, num_beams=1, do_sample=False)
        gen = ids[0, 1:].tolist()
        assert list(e.pseudo) == gen[:len(e.pseudo)]  # the greedy output, cut after EOS
        logits = model(**enc, labels=torch.tensor([list(e.pseudo)])).logits[0]
        want = token_weights(logits.topk(3, dim=-1).values)
        assert list(e.pseudo_weights) == pytest.approx(want.tolist(), rel=1e-4)
        assert sum(e.pseudo_weights) == pytest.approx(1.0)


def test_pseudo_loss_is_the_weighted_token_nll_and_its_gradient(data):
    from fedsilo.tasks.multitask.task import Example

    cfg = validate(mtoy.config(data))
    _, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    a = Example("toy-parity", "toy-parity: good bad", ("even",), pseudo=(5, 6, 102), pseudo_weights=(0.5, 0.3, 0.2))
    b = Example("toy-parity", "toy-parity: good", ("odd",))
    batch = task.collate([a, b])
    assert batch["labels"].shape[0] == 3 and int(batch["annotated_rows"]) == 2  # 2 annotated + 1 pseudo row
    vocab = len(tokenizer)
    logits = torch.randn(3, batch["labels"].shape[1], vocab, requires_grad=True)
    terms = task.loss(lambda **kw: type("Out", (), {"logits": logits})(), batch)
    nll = [F.cross_entropy(logits[2, i], torch.tensor(t)) for i, t in enumerate((5, 6, 102))]
    want = sum(w * n for w, n in zip((0.5, 0.3, 0.2), nll)) / 2  # averaged over the batch's 2 examples
    assert terms["pseudo"].item() == pytest.approx(want.item(), rel=1e-6)
    terms["pseudo"].backward()
    # d/dlogits of w_a·NLL_a / b = w_a/b · (softmax − one-hot) at each pseudo position, 0 elsewhere
    for i, (t, w) in enumerate(zip((5, 6, 102), (0.5, 0.3, 0.2))):
        expect = torch.softmax(logits[2, i].detach(), -1)
        expect[t] -= 1
        torch.testing.assert_close(logits.grad[2, i], w / 2 * expect, rtol=1e-5, atol=1e-7)
    assert logits.grad[:2].abs().sum() == 0


def test_meta_weights_by_hand_on_a_linear_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    xs, ys = torch.randn(4, 3), torch.randn(4)       # pseudo-labelled examples
    xa, ya = torch.randn(5, 3), torch.randn(5)       # annotated examples
    pseudo = (model(xs).squeeze(1) - ys) ** 2
    alpha = 0.1
    w = meta_weights(model, pseudo, lambda fwd: ((fwd(input=xa).squeeze(1) - ya) ** 2).mean(), alpha)
    theta = model.weight.detach()[0]
    g = [2 * (theta @ x - y) * x for x, y in zip(xs, ys)]
    ahead = theta - alpha * sum(g)
    outer = (2 * (xa @ ahead - ya)[:, None] * xa).mean(0)
    raw = torch.clamp(torch.stack([alpha * outer @ gj for gj in g]), min=0)
    assert raw.sum() > 0
    torch.testing.assert_close(w, (raw / raw.sum()).float(), rtol=1e-5, atol=1e-7)
    assert torch.equal(model.weight.detach()[0], theta)  # the model itself is not moved


def test_meta_weights_equal_one_backward_pass_per_pseudo_example_through_attention():
    """The double-backward dot products against b separate backward passes, on a small BERT
    encoder-decoder (scaled-dot-product attention, eval mode: the fused kernel unless the math one is
    asked for), with mixed signs so the clamp matters."""
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

    from fedsilo.client.meta import math_attention

    torch.manual_seed(0)
    small = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = EncoderDecoderModel(encoder=BertModel(BertConfig(**small), add_pooling_layer=False),
                                decoder=BertLMHeadModel(BertConfig(**small, is_decoder=True, add_cross_attention=True)))
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    model.eval()
    src, tgt = torch.randint(2, 50, (6, 7)), torch.randint(2, 50, (6, 4))

    def rows(forward, s, t):
        logits = forward(input_ids=s, labels=t).logits
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), t, reduction="none").mean(1)

    alpha = 0.5
    with math_attention():
        pseudo = rows(model, src[:4], tgt[:4])
        w = meta_weights(model, pseudo, lambda fwd: rows(fwd, src[4:], tgt[4:]).mean(), alpha)
    params = [p for p in model.parameters() if p.requires_grad]
    pseudo = rows(model, src[:4], tgt[:4])
    step = torch.autograd.grad(pseudo.sum(), params, retain_graph=True)
    ahead = {n: (p.detach() - alpha * g).requires_grad_() for (n, p), g in zip(model.named_parameters(), step)}
    at_ahead = rows(lambda **inputs: torch.func.functional_call(model, ahead, (), inputs), src[4:], tgt[4:]).mean()
    outer = torch.autograd.grad(at_ahead, list(ahead.values()))
    dots = torch.stack([sum((a * b).sum() for a, b in zip(outer, torch.autograd.grad(pseudo[j], params, retain_graph=True)))
                        for j in range(4)])
    raw = torch.clamp(alpha * dots, min=0)
    assert (dots > 0).any() and (dots < 0).any()
    torch.testing.assert_close(w, raw / raw.sum(), rtol=1e-4, atol=1e-6)


def test_meta_weighting_baseline_runs_and_logs_its_pseudo_term(data, tmp_path):
    run(data, tmp_path / "meta", **fewfedweight(client={"objective": "meta_weighting",
                                                          "hook_options": {"weighting": "uniform"}}))
    c = rounds_of(tmp_path / "meta")[-1]["clients"]["client_1"]
    assert c["terms"]["pseudo"] >= 0 and c["mean_loss"] == pytest.approx(
        c["terms"]["annotated"] + c["terms"]["pseudo"], rel=1e-6)


def test_ditto_uploads_the_global_update_and_evaluates_the_personal_model(data, tmp_path):
    from fedsilo.server import Server
    uploads = {}
    original = Server.receive

    def spy(self, name, update):
        uploads[(self.round, name)] = {k: v.clone() for k, v in update.tensors.items()}
        return original(self, name, update)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "receive", spy)
        run(data, tmp_path / "ditto", client={"personal": {"coef": 0.1, "epochs": 1}})
    store = DiskStore(tmp_path / "ditto" / "clients")
    store.set_round(2)
    personal = store.get("client_1").slot("personal")
    sent = uploads[(2, "client_1")]
    assert personal.keys() >= sent.keys()
    assert any(not torch.equal(personal[k], sent[k]) for k in sent)  # v is not what went up
    record = rounds_of(tmp_path / "ditto")[-1]["clients"]["client_1"]
    assert record["personal_terms"]["personal"] > 0 and record["personal_terms"]["annotated"] > 0


def test_data_silo_da_labels_with_its_own_model(data, tmp_path):
    results = run(data, tmp_path / "silo-da", paradigm="finetune",
                  client={"before_training": "pseudo_labels", "pseudo_source": "own"})
    assert results["paradigm"] == "finetune" and len(results["test"]["rows"]) == 4
    sub = rounds_of(tmp_path / "silo-da" / "silos" / "client_1")
    assert all(r["clients"]["client_1"]["terms"]["pseudo"] > 0 for r in sub)


def test_ablation_uniform_token_weights_change_the_pseudo_term(data, tmp_path):
    run(data, tmp_path / "uniform", **fewfedweight(client={"hook_options": {"weighting": "uniform"}}))
    run(data, tmp_path / "energy", **fewfedweight())
    a = rounds_of(tmp_path / "uniform")[0]["clients"]["client_1"]["terms"]["pseudo"]
    b = rounds_of(tmp_path / "energy")[0]["clients"]["client_1"]["terms"]["pseudo"]
    assert a != b and math.isfinite(a) and math.isfinite(b)


@pytest.mark.parametrize("client, message", [
    ({"hook_options": {"top_k": 3}}, "hook_options: set, but there is no before_training hook"),
    ({"before_training": "pseudo_labels", "hook_options": {"weighting": "nope"}}, "'nope' is not a known"),
    ({"before_training": "pseudo_labels", "hook_options": {"top_k": 0}}, "greater than 0"),
    ({"objective": "nope"}, "'nope' is not a known client objective"),
])
def test_bad_fewfedweight_settings_are_named(data, client, message):
    with pytest.raises(ConfigError, match=message):
        validate(mtoy.config(data, client=client))


def test_a_task_without_pseudo_labels_is_refused_before_round_one(tmp_path):
    from tests.test_plugins import toy_config

    for client, what in (({"before_training": "pseudo_labels"}, "before_training"),
                         ({"objective": "meta_weighting"}, "objective")):
        cfg = toy_config(client=client)
        with pytest.raises(ConfigError, match=f"client.{what}"):
            run_experiment(cfg, tmp_path / what, show_progress=False)
        assert not (tmp_path / what / "checkpoint.pt").exists()


def test_fewfedweight_on_flower_simulation_matches_in_process(data, tmp_path, monkeypatch):
    from tests.parity import local_and_simulation

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    local, sim = local_and_simulation(validate(mtoy.config(data, **fewfedweight())), tmp_path)
    for x, y in zip(rounds_of(local), rounds_of(sim)):
        for c in x["clients"]:
            assert y["clients"][c]["weight"] == pytest.approx(x["clients"][c]["weight"], rel=1e-5)
            assert y["clients"][c]["terms"]["pseudo"] == pytest.approx(x["clients"][c]["terms"]["pseudo"], rel=1e-5)
    pa = torch.load(local / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(sim / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-5, atol=1e-6)
    ra = json.loads((local / "results.json").read_text())["test"]["rows"]
    rb = json.loads((sim / "results.json").read_text())["test"]["rows"]
    assert [(r["client"], r["task"]) for r in ra] == [(r["client"], r["task"]) for r in rb]
    # the personal models live in each silo's own store (the SuperNode's state folder), not in the
    # server's run directory, and equal the in-process run's
    assert list(local.glob("clients/client_1/round-*.safetensors"))
    assert not list(sim.glob("clients/**/*.safetensors"))
    import tempfile
    run_key = (sim / "run_id").read_text().strip()
    rounds = mtoy.config(data)["federation"]["rounds"]
    for silo in ("client_1", "client_2"):
        kept = DiskStore(local / "clients")
        kept.set_round(rounds)
        remote = DiskStore(Path(tempfile.gettempdir()) / "fedsilo-flower-state" / silo / run_key)
        remote.set_round(rounds)
        mine, theirs = kept.get(silo).slot("own"), remote.get(silo).slot("own")
        assert mine.keys() == theirs.keys() and mine
        for k in mine:
            torch.testing.assert_close(theirs[k], mine[k], rtol=1e-5, atol=1e-6)
