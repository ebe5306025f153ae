"""FedMatch's private patches (fedsilo.models.patches, the surgery "patches") on a tiny BERT."""
import copy
import itertools
import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from fedsilo.models import SURGERIES
from fedsilo.models.patches import Patch, PatchSettings, apply_patches, patch_parameter_count

KINDS = ("lowrank", "pal")
INSERTIONS = ("inner", "outer", "vertical", "vertical_code", "horizontal")
COMBOS = list(itertools.product(KINDS, INSERTIONS))
D, LAYERS, SIZE = 32, 2, 16


def tiny(seed: int = 0) -> BertForSequenceClassification:
    config = BertConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
                        vocab_size=100, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertForSequenceClassification(config).eval()


def batch():
    """Three pairs of 9 tokens, two of them padded (attention_mask 0 at the end)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "token_type_ids": (torch.arange(9) >= 3).long().expand(3, 9).contiguous()}


def patched(kind: str, insertion: str, seed: int = 3, model_seed: int = 0, **kw):
    model = tiny(model_seed)
    apply_patches(model, PatchSettings(kind=kind, insertion=insertion, size=SIZE, **kw), seed)
    return model


def patches_of(model) -> list[Patch]:
    return [m for m in model.modules() if isinstance(m, Patch)]


@torch.no_grad()
def randomize(model, std: float = 0.3, seed: int = 11) -> None:
    """Every patch tensor random (V_D included), large enough to move the logits visibly."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "patch" in name:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def logits(model, enc) -> torch.Tensor:
    return model(**enc).logits


def tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- identity at start, new tensors, gradients --------------------------------------------------

@pytest.mark.parametrize("kind,insertion", COMBOS)
def test_starts_as_the_backbone_then_patches_change_it_and_learn(kind, insertion):
    enc = batch()
    model = tiny()
    before = tensors(model)
    params_before = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        base = logits(model, enc)
    apply_patches(model, PatchSettings(kind=kind, insertion=insertion, size=SIZE), seed=3)

    with torch.no_grad():
        start = logits(model, enc)
    assert start.shape == (3, 1)
    assert torch.allclose(start, base, atol=1e-6, rtol=0)

    names = {n for n, _ in model.named_parameters()}
    new = names - params_before
    assert params_before <= names and new and all("patch" in n for n in new)
    assert not any("patch" in n for n in params_before)
    assert {n for n in tensors(model) if "patch" not in n} == set(before)
    after = tensors(model)
    assert all(torch.equal(after[k], before[k]) for k in before)  # the backbone is untouched
    n_patches = {"vertical": 1, "vertical_code": 1, "horizontal": LAYERS}.get(insertion, 2 * LAYERS)
    assert len(patches_of(model)) == n_patches
    ups = [p for n, p in model.named_parameters() if "patch" in n and ".up." in n]
    assert len(ups) == 2 * n_patches and all(not p.any() for p in ups)  # V_D = 0 (weight, bias)
    per_patch = 2 * D * SIZE + D + SIZE + (3 * (SIZE * SIZE + SIZE) if kind == "pal" else 0)
    assert patch_parameter_count(model) == n_patches * per_patch == sum(p.numel() for n, p in model.named_parameters()
                                                                         if n in new)

    with torch.no_grad():  # a nonzero V_D moves the output
        for p in ups:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
        moved = logits(model, enc)
    assert (moved - base).abs().max() > 1e-4

    model.zero_grad()
    logits(model, enc).pow(2).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "patch" in n}
    assert all(g is not None for g in grads.values())
    downs = [g for n, g in grads.items() if ".down.weight" in n]
    assert len(downs) == n_patches and all(g.abs().sum() > 0 for g in downs)  # V_E learns
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0  # and the backbone


# ---- where the patches sit ----------------------------------------------------------------------

def capture_layers(model, enc):
    """For each BERT layer, (args, kwargs, output) of its call in one forward pass."""
    seen = []
    handles = [layer.register_forward_hook(lambda m, a, k, o: seen.append((a, k, o)), with_kwargs=True)
               for layer in model.bert.encoder.layer]
    with torch.no_grad():
        model(**enc)
    for h in handles:
        h.remove()
    assert len(seen) == LAYERS
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_horizontal_patch_is_parallel_to_each_whole_layer(kind):
    enc = batch()
    plain = tiny()
    model = patched(kind, "horizontal")
    randomize(model)
    for i, (args, kwargs, out) in enumerate(capture_layers(model, enc)):
        h = args[0]
        with torch.no_grad():
            expected = plain.bert.encoder.layer[i](*args, **kwargs) + model.bert.encoder.layer[i].patch(h)
        assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(logits(model, enc), logits(plain, enc), atol=1e-3)


def hand_layer(layer, h, mask, f_att, f_ffn, insertion):
    """A BERT layer computed by hand (eval: dropout is the identity) with patch functions f. The output
    projections are applied as plain functions: the surgery's hooks on the modules must not fire here."""
    att, out = layer.attention.output, layer.output

    def dense(lin, z):
        return torch.nn.functional.linear(z, lin.weight, lin.bias)

    x = dense(att.dense, layer.attention.self(h, attention_mask=mask)[0])
    if insertion == "inner":
        sa = att.LayerNorm(x + f_att(x) + h)
    else:
        sa = att.LayerNorm(x + h + f_att(h))
    y = dense(out.dense, layer.intermediate(sa))
    if insertion == "inner":
        return out.LayerNorm(y + f_ffn(y) + sa)
    return out.LayerNorm(y + sa + f_ffn(sa))


def affine(scale: float, shift: torch.Tensor):
    return lambda z: scale * z + shift


@pytest.mark.parametrize("insertion", ["inner", "outer"])
def test_inner_and_outer_patches_sit_where_they_say(monkeypatch, insertion):
    """The patches are replaced by known input-dependent maps (z ↦ a·z + c, different per patch), so the
    inner and outer placements give different, hand-computable layer outputs."""
    enc = batch()
    model = patched("lowrank", insertion)
    g = torch.Generator().manual_seed(2)
    maps = {}
    for i, layer in enumerate(model.bert.encoder.layer):
        for j, sub in enumerate((layer.attention.output, layer.output)):
            f = affine(0.3 + 0.2 * j + 0.1 * i, torch.randn(D, generator=g))
            monkeypatch.setattr(sub.patch, "forward", f)
            maps[i, j] = f
    for i, (args, kwargs, out) in enumerate(capture_layers(model, enc)):
        h, mask = args[0], args[1]
        layer = model.bert.encoder.layer[i]
        with torch.no_grad():
            expected = hand_layer(layer, h, mask, maps[i, 0], maps[i, 1], insertion)
            other = hand_layer(layer, h, mask, maps[i, 0], maps[i, 1], "outer" if insertion == "inner" else "inner")
            unpatched = hand_layer(layer, h, mask, lambda z: 0 * z, lambda z: 0 * z, insertion)
        assert torch.allclose(out, expected, atol=1e-5, rtol=0)
        assert not torch.allclose(out, other, atol=1e-3)  # the check tells inner from outer
        assert not torch.allclose(out, unpatched, atol=1e-3)


@pytest.mark.parametrize("insertion", ["inner", "outer"])
def test_inner_and_outer_with_real_patches_match_the_hand_computation(insertion):
    enc = batch()
    model = patched("pal", insertion)
    randomize(model)
    for i, (args, kwargs, out) in enumerate(capture_layers(model, enc)):
        layer = model.bert.encoder.layer[i]
        with torch.no_grad():
            expected = hand_layer(layer, args[0], args[1], layer.attention.output.patch, layer.output.patch, insertion)
        assert torch.allclose(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_vertical_code_adds_a_patch_of_the_embeddings_to_the_top_output(kind):
    enc = batch()
    plain = tiny()
    model = patched(kind, "vertical_code")
    randomize(model)
    assert hasattr(model.bert, "patch") and not hasattr(model.bert.encoder, "patch")
    with torch.no_grad():
        top = plain.bert(**enc).last_hidden_state
        e = model.bert.embeddings(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"])
        got = model.bert(**enc)
        expected = top + model.bert.patch(e)
        assert torch.allclose(got.last_hidden_state, expected, atol=1e-6, rtol=0)
        assert torch.allclose(got.pooler_output, plain.bert.pooler(expected), atol=1e-6, rtol=0)
        assert torch.allclose(logits(model, enc), plain.classifier(plain.bert.pooler(expected)), atol=1e-6, rtol=0)
    # every layer is the backbone's own: only the top output moves
    for (a, k, o), (a2, k2, o2) in zip(capture_layers(model, enc), capture_layers(plain, enc), strict=True):
        assert torch.equal(o, o2)


@pytest.mark.parametrize("kind", KINDS)
def test_vertical_follows_the_top_layer_with_a_residual(kind):
    """The paper's form: H = BL_top(h) + Patch(BL_top(h)), BL_top(h) read off the model's own top layer."""
    enc = batch()
    plain = tiny()
    model = patched(kind, "vertical")
    randomize(model)
    assert hasattr(model.bert.encoder, "patch") and not hasattr(model.bert, "patch")
    layer_outputs = capture_layers(model, enc)
    top = layer_outputs[-1][2]
    top = top[0] if isinstance(top, tuple) else top
    with torch.no_grad():
        patch = model.bert.encoder.patch
        expected = top + patch(top)
        got = model.bert(**enc)
        assert torch.allclose(got.last_hidden_state, expected, atol=1e-6, rtol=0)
        assert torch.allclose(got.pooler_output, plain.bert.pooler(expected), atol=1e-6, rtol=0)
        assert torch.allclose(logits(model, enc), plain.classifier(plain.bert.pooler(expected)), atol=1e-6, rtol=0)
        # the check tells the paper's form from the code's and from the unpatched model
        e = model.bert.embeddings(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"])
        assert not torch.allclose(got.last_hidden_state, top + patch(e), atol=1e-3)
        assert not torch.allclose(got.last_hidden_state, top, atol=1e-3)
        assert not torch.allclose(got.last_hidden_state, patch(top), atol=1e-3)  # not a replacement
    for (a, k, o), (a2, k2, o2) in zip(layer_outputs, capture_layers(plain, enc), strict=True):
        assert torch.equal(o, o2)  # the layers are the backbone's own


def test_the_two_vertical_forms_do_not_load_into_each_other():
    """The paper's and the code's patch sit at different paths: a state saved under one does not load
    silently into the other (``vertical`` meant the code form before the split)."""
    code, paper = patched("lowrank", "vertical_code"), patched("lowrank", "vertical")
    with pytest.raises(RuntimeError, match=r"bert\.patch\.up\.weight"):
        paper.load_state_dict(code.state_dict())
    with pytest.raises(RuntimeError, match=r"bert\.encoder\.patch\.up\.weight"):
        code.load_state_dict(paper.state_dict())


# ---- PAL and padding --------------------------------------------------------------------------

@pytest.mark.parametrize("insertion", INSERTIONS)
def test_pal_ignores_padding_tokens(monkeypatch, insertion):
    enc = batch()
    other = dict(enc, input_ids=enc["input_ids"].clone())
    pad = enc["attention_mask"] == 0
    other["input_ids"][pad] = torch.randint(1, 100, (int(pad.sum()),), generator=torch.Generator().manual_seed(4))
    other["token_type_ids"] = enc["token_type_ids"].clone()
    other["token_type_ids"][pad] = 0
    model = patched("pal", insertion)
    randomize(model, std=0.5)
    valid = enc["attention_mask"].bool()

    def outputs():
        with torch.no_grad():
            return ((logits(model, enc), model.bert(**enc).last_hidden_state[valid]),
                    (logits(model, other), model.bert(**other).last_hidden_state[valid]))

    (la, ha), (lb, hb) = outputs()
    assert torch.allclose(la, lb, atol=1e-6, rtol=0)
    assert torch.allclose(ha, hb, atol=1e-6, rtol=0)  # every real token's top state, not only the score's
    # the test can fail: a PAL that attended to every token would see the padding
    monkeypatch.setattr(patches_of(model)[0].recorder, "keep", lambda h: None)
    (la, ha), (lb, hb) = outputs()
    assert (ha - hb).abs().max() > 1e-4 and (la - lb).abs().max() > 1e-6


def test_pal_without_a_mask_attends_everywhere_and_a_wrong_mask_is_refused():
    enc = batch()
    full = {"input_ids": enc["input_ids"][:1], "token_type_ids": enc["token_type_ids"][:1]}
    model = patched("pal", "horizontal")
    randomize(model)
    with torch.no_grad():
        none = logits(model, full)
        ones = logits(model, dict(full, attention_mask=torch.ones(1, 9, dtype=torch.long)))
        assert torch.allclose(none, ones, atol=1e-6, rtol=0)
        patch = model.bert.encoder.layer[0].patch
        with pytest.raises(ValueError, match="attention_mask"):
            patch(torch.zeros(2, 5, D))  # the recorded mask is (1, 9)


# ---- seeds, round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("kind,insertion", [("pal", "inner"), ("lowrank", "horizontal"), ("pal", "vertical"),
                                          ("lowrank", "vertical_code")])
def test_same_seed_same_patches_different_seed_different(kind, insertion):
    state = torch.random.get_rng_state()
    a, b = tensors(patched(kind, insertion, seed=7)), tensors(patched(kind, insertion, seed=7))
    c = tensors(patched(kind, insertion, seed=8))
    assert torch.equal(torch.random.get_rng_state(), state)  # torch's global generator is left alone
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rand = [k for k in a if "patch" in k and k.endswith("weight") and ".up." not in k]
    assert rand and all(not torch.equal(a[k], c[k]) for k in rand)
    assert all(a[k].std() > 0.005 for k in rand)  # drawn, not left at zero
    assert all(torch.equal(a[k], c[k]) for k in a if "patch" not in k)


@pytest.mark.parametrize("kind,insertion", COMBOS)
def test_random_init_draws_v_d_seeded_and_moves_the_output(kind, insertion):
    """``init = "random"`` (the paper, §3.5; the authors' init_weights): V_D ~ N(0, 0.02²), bias 0, from the
    seeded generator; the output moves at start. ``zero`` keeps its draws (V_D draws nothing there)."""
    enc = batch()
    state = torch.random.get_rng_state()
    a = patched(kind, insertion, seed=7, init="random")
    b = patched(kind, insertion, seed=7, init="random")
    c = patched(kind, insertion, seed=8, init="random")
    z = patched(kind, insertion, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    ta, tb, tc, tz = tensors(a), tensors(b), tensors(c), tensors(z)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    ups = [k for k in ta if "patch" in k and ".up." in k]
    up_w = [k for k in ups if k.endswith("weight")]
    assert up_w and all(not torch.equal(ta[k], tc[k]) for k in up_w)
    assert all(0.01 < ta[k].std() < 0.03 for k in up_w)  # initializer_range = 0.02
    assert all(not ta[k].any() for k in ups if k.endswith("bias"))
    assert all(not tz[k].any() for k in ups)
    first = patches_of(a)[0]  # the first patch's V_E is drawn first in both inits
    first_name = next(k for k in ta if k.endswith("patch.down.weight"))
    assert torch.equal(tz[first_name], first.down.weight)
    with torch.no_grad():  # the top states, not the tiny head's near-zero logits
        base = tiny().bert(**enc).last_hidden_state
        assert torch.allclose(z.bert(**enc).last_hidden_state, base, atol=1e-6, rtol=0)
        assert (a.bert(**enc).last_hidden_state - base).abs().max() > 1e-5  # inner+pal moves least: 2e-5


def test_zero_init_draws_are_pinned():
    """The first patch's V_E is the generator's first draw × initializer_range: the ``zero`` init (and
    so every config written before ``init`` existed) gives the same patches it always gave."""
    model = patched("lowrank", "horizontal", seed=7)
    g = torch.Generator().manual_seed(7)
    want = torch.randn(SIZE, D, generator=g) * 0.02
    assert torch.equal(model.bert.encoder.layer[0].patch.down.weight, want)
    want = torch.randn(SIZE, D, generator=g) * 0.02  # no V_D draw in between
    assert torch.equal(model.bert.encoder.layer[1].patch.down.weight, want)


@pytest.mark.parametrize("kind,insertion", COMBOS)
def test_state_dict_round_trip_and_deepcopy(kind, insertion):
    enc = batch()
    source = patched(kind, insertion, seed=1)
    randomize(source)
    target = patched(kind, insertion, seed=2, model_seed=9)
    target.load_state_dict(source.state_dict())
    twin = copy.deepcopy(source)
    with torch.no_grad():
        want = logits(source, enc)
        assert torch.equal(logits(target, enc), want)
        assert torch.equal(logits(twin, enc), want)
        for p in patches_of(twin):  # the copy's hooks use the copy's own patches
            p.up.weight.zero_()
            p.up.bias.zero_()
        assert torch.equal(logits(source, enc), want)
        assert torch.allclose(logits(twin, enc), logits(tiny(), enc), atol=1e-6, rtol=0)


# ---- errors -----------------------------------------------------------------------------------

def test_settings_are_validated():
    s = PatchSettings()
    assert (s.kind, s.insertion, s.size, s.heads, s.init) == ("lowrank", "horizontal", 128, 4, "zero")
    with pytest.raises(ValidationError, match="extra"):
        PatchSettings(sise=16)
    with pytest.raises(ValidationError, match="multiple of heads"):
        PatchSettings(kind="pal", size=10, heads=4)
    assert PatchSettings(kind="lowrank", size=10, heads=4).size == 10  # heads only matter for pal
    for bad in ({"size": 0}, {"heads": 0}, {"kind": "adapter"}, {"insertion": "diagonal"}, {"init": "xavier"}):
        with pytest.raises(ValidationError):
            PatchSettings(**bad)
    entry = SURGERIES.entry("patches")
    assert entry.settings is PatchSettings and entry.value is apply_patches


def test_a_model_that_is_not_bert_shaped_is_refused():
    with pytest.raises(ValueError, match=r"not a BERT-family.*no `bert`"):
        apply_patches(nn.Sequential(nn.Linear(4, 4)), PatchSettings(), 0)
    model = tiny()
    del model.bert.encoder.layer[1].output.LayerNorm
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\[1\]\.output\.LayerNorm"):
        apply_patches(model, PatchSettings(), 0)
    model = tiny()
    model.bert.encoder.layer = nn.ModuleList()
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\[0\]"):
        apply_patches(model, PatchSettings(), 0)


def test_names_already_containing_patch_are_refused():
    model = patched("lowrank", "horizontal")
    with pytest.raises(ValueError, match="already has tensors named like patches"):
        apply_patches(model, PatchSettings(), 0)  # applied twice
    model = tiny()
    model.bert.patchwork = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bert.patchwork.weight"):
        apply_patches(model, PatchSettings(), 0)


# ---- through fedsilo's config -------------------------------------------------------------------

def run_config(options: dict, **sections) -> dict:
    cfg = {
        "plugins": ["tests.toytask"], "name": "patches", "seed": 5,
        "task": {"name": "toyrank", "n_train": 4, "n_eval": 2, "silos": ["alpha", "beta"]},
        "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 2,
                  "num_heads": 4, "device": "cpu", "surgery": {"name": "patches", "options": options}},
        "client": {"epochs": 1, "lr": 1e-3, "batch_size": 4, "optimizer": "adamw", "logging_steps": 1},
        "federation": {"rounds": 1, "weighting": "equal"},
    }
    cfg.update(sections)
    from fedsilo.config import validate
    return validate(cfg)


def test_config_builds_a_patched_model_whose_patches_a_glob_keeps_private():
    from fedsilo.client.silo import federated_parameters
    from fedsilo.config import ConfigError
    from fedsilo.core.exchange import ExchangePlan
    from fedsilo.recipe import build_model

    cfg = run_config({"kind": "pal", "insertion": "inner", "size": 16})
    a, tokenizer = build_model(cfg)
    b, _ = build_model(cfg)
    names = list(federated_parameters(a))
    shared, private = ExchangePlan(private=("*patch*",)).split(names)
    assert private == [n for n in names if "patch" in n]
    assert len(private) == 2 * 2 * 10  # 2 layers × 2 patches × (V_E, Q, K, V, V_D) × (weight, bias)
    assert "bert.encoder.layer.1.output.patch.query.weight" in private
    assert all("patch" not in n for n in shared) and "classifier.weight" in shared
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in names)  # seeded by the run's seed
    enc = tokenizer(["red cat", "blue dog sun"], ["red bird", "fish"], padding=True, return_tensors="pt")
    assert a(**enc).logits.shape == (2, 1)

    with pytest.raises(ConfigError, match="model.surgery"):
        run_config({"kind": "pal", "size": 10, "heads": 4})
    with pytest.raises(ConfigError, match="model.surgery"):
        run_config({"sise": 16})


def test_a_federated_run_keeps_the_patches_private(tmp_path):
    from fedsilo.runs.runner import run_experiment

    cfg = run_config({"kind": "lowrank", "insertion": "horizontal", "size": 8},
                     exchange={"private": ["*patch*"]}, federation={"rounds": 2, "weighting": "equal"})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    server = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert server and not any("patch" in n for n in server)  # the server never holds a patch
    assert "bert.encoder.layer.0.attention.self.query.weight" in server


def test_minilm_with_patches_starts_as_minilm():
    from fedsilo.config import ModelConfig
    from fedsilo.models.encoder import build_encoder

    model, tokenizer = build_encoder(ModelConfig(kind="encoder", name="minilm", device="cpu"), seed=0)
    enc = tokenizer(["what is a cat", "who wrote it"], ["a cat is an animal", "nobody"], padding=True,
                    return_tensors="pt")
    with torch.no_grad():
        base = model(**enc).logits
        apply_patches(model, PatchSettings(kind="pal", insertion="outer"), seed=0)
        assert torch.allclose(model(**enc).logits, base, atol=1e-6, rtol=0)
    assert patch_parameter_count(model) == 6 * 2 * (2 * 384 * 128 + 384 + 128 + 3 * (128 * 128 + 128))
