"""Everything the engine has, on the instruct task with the built-in decoder (tiny-llama): FedAvg,
FedProx and FedOPT train; Lorar weights, client sampling and private LoRA heads do what they say;
DP-SGD reports ε; secure aggregation gives the plaintext aggregate; codecs run; a resumed run equals
an uninterrupted one; a study over seeds has a spread; and what cannot go into a decoder is refused
in one line naming it. Three own silos written here (and a public one the tokenizer is fitted on);
nothing of ../shared/data is read.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.client.silo import federated_parameters
from fedsilo.config import to_toml, validate
from fedsilo.errors import ConfigError, FedsiloError
from fedsilo.recipe import build_model
from fedsilo.runs.runner import run_experiment

SILOS = ("maths", "clinic", "code")


def records(silo: str, seed: int, n: int) -> list[dict]:
    """Alpaca rows a tiny model learns a little from in a few steps (short, repetitive answers)."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rnd.randint(1, 30), rnd.randint(1, 30)
        rows.append({
            "maths": {"instruction": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}. #### {a + b}"},
            "clinic": {"instruction": f"Patient {i} has a fever of {37 + a % 4} degrees. Is it high?",
                       "response": "yes" if a % 4 > 1 else "no"},
            "code": {"instruction": f"Return {a}.", "input": f"f{i}", "response": f"def f{i}():\n    return {a}"},
            "public": {"instruction": f"Say something about {a}.", "response": f"{a} is a number near {b}."},
        }[silo])
    return rows


def write_silos(root: Path) -> dict:
    """[task.sources] of three silos and the public text (train 12, dev 4, test 4 records each)."""
    sources = {}
    for k, silo in enumerate((*SILOS, "public")):
        folder = root / silo
        folder.mkdir(parents=True)
        rows = records(silo, k, 20)
        for split, part in (("train", rows[:12]), ("dev", rows[12:16]), ("test", rows[16:])):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        sources[silo] = {"path": str(folder), "files": {s: f"{s}.jsonl" for s in ("train", "dev", "test")}}
    return sources


LORA = {"name": "lora", "options": {"rank": 4, "alpha": 8}}


def instruct_config(sources: dict, **sections) -> dict:
    """A raw config: 3 silos, a 1-layer tiny-llama, 2 rounds of 3 steps (one process, one thread)."""
    cfg = {
        "name": "instruct-engine", "seed": 1,
        "task": {"name": "instruct", "silos": list(SILOS), "sources": sources, "tokenizer_silo": "public",
                 "max_length": 96, "max_new_tokens": 4, "vocab_size": 400, "eval_batch_size": 8},
        "model": {"kind": "causal", "d_model": 16, "d_ff": 32, "num_layers": 1, "num_heads": 2},
        "client": {"optimizer": "adamw", "lr": 1e-2, "batch_size": 4, "steps": 3, "logging_steps": 1},
        "federation": {"rounds": 2},
        "engine": {"workers": 1, "threads": 1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    return cfg


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The silos, and the fitted tokenizer cached in a data root of this module's own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("instruct-data-root")))
        yield write_silos(tmp_path_factory.mktemp("instruct-silos"))


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def final_params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]


def initial_params(cfg) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in federated_parameters(build_model(cfg)[0]).items()}


def assert_trained(cfg, run: Path, results: dict) -> None:
    """The global model moved, every logged loss is finite, and results.json has a finite loss and
    its perplexity for every silo."""
    start, end = initial_params(cfg), final_params(run)
    assert end and end.keys() <= start.keys()  # the shared tensors (a private one stays on its silo)
    assert any(not torch.equal(start[k], end[k]) for k in end)
    for r in rounds_of(run):
        assert r["applied"] and set(r["clients"]) == set(r["sampled"])
        for entry in r["clients"].values():
            assert entry["losses"] and all(math.isfinite(v) for _, v in entry["losses"])
    rows = results["test"]["rows"]
    assert [row["client"] for row in rows] == list(SILOS)
    for row in rows:
        loss, ppl = row["metrics"]["loss"], row["metrics"]["ppl"]
        assert math.isfinite(loss) and loss > 0 and ppl == pytest.approx(math.exp(loss))


@pytest.fixture(scope="module")
def fedavg(sources, tmp_path_factory):
    """The reference run: FedAvg (size weights) over LoRA adapters, 2 rounds."""
    cfg = validate(instruct_config(sources, model={"surgery": LORA}))
    out = tmp_path_factory.mktemp("fedavg") / "run"
    return cfg, out, run_experiment(cfg, out, show_progress=False)


def like_fedavg(sources, **sections):
    """The reference run's config with `sections` merged in."""
    cfg = instruct_config(sources, model={"surgery": LORA})
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return validate(cfg)


# ---- FedAvg, FedProx, FedOPT -----------------------------------------------------------------

def test_fedavg_over_lora_trains(fedavg):
    cfg, out, results = fedavg
    assert_trained(cfg, out, results)
    assert all(".lora_" in k for k in final_params(out))  # only the adapters travel
    assert all(r["weighting"] == "size" for r in rounds_of(out))


@pytest.mark.parametrize("name, sections", [
    ("full", {}),                                                              # FedAvg, full fine-tuning
    ("fedprox", {"model": {"surgery": LORA}, "client": {"regularizers": {"prox": 0.01}}}),
    ("fedopt-adam", {"model": {"surgery": LORA}, "server": {"optimizer": "adam"}}),
])
def test_fedavg_fedprox_and_fedopt_train(sources, tmp_path, name, sections):
    cfg = validate(instruct_config(sources, **sections))
    results = run_experiment(cfg, tmp_path / name, show_progress=False)
    assert_trained(cfg, tmp_path / name, results)
    first = rounds_of(tmp_path / name)[0]["clients"]
    if name == "fedprox":  # the proximal term is a named loss term: 0 at a round's first step, then > 0
        assert all(0 < e["terms"]["prox"] < math.inf for e in first.values())
    if name == "full":  # every weight of the decoder travels (tied embeddings and head once)
        assert set(final_params(tmp_path / name)) == set(initial_params(cfg))
        assert not any(".lora_" in k for k in final_params(tmp_path / name))
    if name == "fedopt-adam":  # the server optimiser's moments are in the checkpoint, one per tensor
        optimizer = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["server"]["optimizer"]
        moments = [t for t in _tensors(optimizer) if t.numel() > 1]
        assert moments and all(torch.isfinite(t).all() for t in moments) and any(t.abs().sum() > 0 for t in moments)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return [t for v in state for t in _tensors(v)] if isinstance(state, (list, tuple)) else []


# ---- weights, sampling, private heads --------------------------------------------------------

def test_lorar_weights_follow_size_times_delta_loss_with_fedavgm(sources, tmp_path):
    """Lorar's weights p_i ∝ n_i · ΔL_i (ΔL = max − min of the losses each silo logged this round),
    with the authors' FedOPT server (FedAvgM)."""
    cfg = validate(instruct_config(sources, model={"surgery": LORA}, server={"optimizer": "sgdm"},
                                   federation={"weighting": "lorar", "max_weight_ratio": "off"}))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert_trained(cfg, tmp_path / "run", results)
    for r in rounds_of(tmp_path / "run"):
        assert r["weighting"] == "lorar" and not r["fallback"]
        clients = r["clients"]
        deltas = {c: max(v for _, v in e["losses"]) - min(v for _, v in e["losses"]) for c, e in clients.items()}
        assert all(d > 0 for d in deltas.values()), deltas  # a real ΔL each, so the weights are not the fallback
        scores = {c: clients[c]["n_examples"] * deltas[c] for c in clients}
        for c, e in clients.items():
            assert e["weight"] == pytest.approx(scores[c] / sum(scores.values()), abs=1e-3)  # ΔL logged to 4 decimals


def test_two_of_three_silos_sampled_per_round_and_only_they_train(sources, tmp_path, monkeypatch):
    from fedsilo.client.silo import SiloClient

    trained, fit = [], SiloClient.fit

    def recorded(self, round_idx, *a, **kw):
        trained.append((round_idx, self.name))
        return fit(self, round_idx, *a, **kw)

    monkeypatch.setattr(SiloClient, "fit", recorded)
    cfg = validate(instruct_config(sources, model={"surgery": LORA}, federation={"rounds": 3, "sample_count": 2}))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    for r in rounds:
        assert len(r["sampled"]) == 2 and set(r["sampled"]) <= set(SILOS)
        assert set(r["clients"]) == set(r["sampled"]) == set(r["sent"])
    assert sorted(trained) == sorted((r["round"], c) for r in rounds for c in r["sampled"])
    assert [row["client"] for row in results["test"]["rows"]] == list(SILOS)  # every silo is evaluated


def test_a_private_lora_head_stays_on_its_silo(sources, tmp_path):
    """head = "private": each silo trains its own copy of lm_head, kept in its store; the server never
    holds one and no upload carries one."""
    from safetensors.torch import load_file

    lora = {"name": "lora", "options": {**LORA["options"], "head": "private"}}
    cfg = validate(instruct_config(sources, model={"surgery": lora}))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert_trained(cfg, tmp_path / "run", results)
    server = final_params(tmp_path / "run")
    assert server and not any("lm_head" in k for k in server)
    heads = {}
    for silo in SILOS:
        stored = load_file(sorted((tmp_path / "run" / "clients" / silo).glob("round-*.safetensors"))[-1])
        head = [k for k in stored if "lm_head.modules_to_save" in k]
        assert head, f"{silo} keeps no head"
        heads[silo] = stored[head[0]]
    assert not torch.equal(heads["maths"], heads["clinic"])  # each silo trained its own
    lora_numel = sum(v.numel() for v in server.values())
    assert all(e["params_up"] == lora_numel for r in rounds_of(tmp_path / "run") for e in r["clients"].values())


# ---- privacy and codecs ----------------------------------------------------------------------

def test_dp_sgd_trains_on_the_unpacked_task_and_reports_epsilon(sources, tmp_path):
    """σ given (a target ε would search σ for seconds per silo); ε is the accountant's over the steps done."""
    from fedsilo.privacy.accountant import Budget

    cfg = validate(instruct_config(sources, model={"surgery": LORA},
                                   client={"dp": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}))
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert any(not torch.equal(a, b) for a, b in zip(initial_params(cfg).values(),
                                                      final_params(tmp_path / "run").values()))
    rounds = rounds_of(tmp_path / "run")
    for silo in SILOS:
        eps = [r["clients"][silo]["privacy"]["epsilon"] for r in rounds]
        assert 0 < eps[0] < eps[1]
        last = rounds[-1]["clients"][silo]["privacy"]
        assert last["noise_multiplier"] == 1.0 and last["steps"] == 6  # 3 DP-SGD steps a round
        budget = Budget(1.0, last["sample_rate"], last["delta"])
        budget.spend(int(last["steps"]))
        assert eps[1] == pytest.approx(budget.epsilon(), rel=1e-12)
        assert results["privacy"][silo]["epsilon"] == eps[1]
        assert all(r["clients"][silo]["losses"] == [] for r in rounds)  # no loss on its records leaves it
    assert all(math.isfinite(row["metrics"]["loss"]) for row in results["test"]["rows"])


def test_dp_sgd_on_the_packed_task_is_refused_naming_packing(sources, tmp_path):
    cfg = validate(instruct_config(sources, task={"packing": True}, client={"dp": {"target_epsilon": 8.0}}))
    with pytest.raises(ConfigError, match=r"^client\.dp: .*task\.packing = true") as err:
        run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert "\n" not in str(err.value)


def test_secure_aggregation_gives_the_plaintext_aggregate(sources, fedavg, tmp_path):
    _, out, _ = fedavg
    run_experiment(like_fedavg(sources, federation={"secure_aggregation": {}}), tmp_path / "secure",
                   show_progress=False)
    a, b = final_params(out), final_params(tmp_path / "secure")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # float32 sums against the exact secure sum
    for record in rounds_of(tmp_path / "secure"):
        assert record["secure"]["survivors"] == list(SILOS) and record["applied"]
        assert all(e["secure"] and e["weight"] is None for e in record["clients"].values())


@pytest.mark.parametrize("codec", [{"name": "int8"}, {"name": "topk", "fraction": 0.25}])
def test_codecs_code_the_lora_upload(sources, fedavg, tmp_path, codec):
    _, out, _ = fedavg
    coded = like_fedavg(sources, exchange={"upload_transforms": [codec]})
    results = run_experiment(coded, tmp_path / "run", show_progress=False)
    plain_bytes = rounds_of(out)[0]["clients"]["maths"]["bytes_up"]
    for r in rounds_of(tmp_path / "run"):
        for e in r["clients"].values():
            assert e["transforms"][0]["name"] == codec["name"] and e["bytes_up"] < plain_bytes
    assert any(not torch.equal(a, b) for a, b in zip(initial_params(coded).values(),
                                                      final_params(tmp_path / "run").values()))
    assert all(math.isfinite(row["metrics"]["loss"]) for row in results["test"]["rows"])


# ---- resume ----------------------------------------------------------------------------------

def test_a_run_stopped_in_round_two_resumes_to_the_uninterrupted_run(fedavg, tmp_path, monkeypatch, capsys):
    from tests.killed_run import interrupted_in_round_two

    cfg, out, results = fedavg
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "cut")
    assert len(rounds_of(tmp_path / "cut")) == 1
    capsys.readouterr()
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    # the token cache the first runs wrote is read back as it is (a completion-only loss's -100 labels
    # are not ids outside the vocabulary, which would have it re-made with a warning on every run)
    assert "token cache" not in capsys.readouterr().err
    a, b = final_params(out), final_params(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["clients"]["code"]["weight"] for r in rounds_of(tmp_path / "cut")] == \
        [r["clients"]["code"]["weight"] for r in rounds_of(out)]
    assert resumed["test"]["rows"] == results["test"]["rows"]


# ---- a study with seeds ----------------------------------------------------------------------

def test_a_study_over_two_seeds_shows_a_spread(sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fedsilo.runs.report._write_plots", lambda *a: [])  # drawing is most of the time; not checked
    base = instruct_config(sources, model={"surgery": LORA}, federation={"rounds": 1})
    study = {"study": {"name": "instruct-study", "metrics": ["loss"]}, "base": base,
             "variants": {"alone": {"paradigm": "finetune"}, "fedavg": {}}}
    path = tmp_path / "study.toml"
    path.write_text(_toml(study))
    out = tmp_path / "study"
    assert main(["study", str(path), "--out", str(out), "--seeds", "0,1", "--no-progress"]) == 0
    capsys.readouterr()
    summary = json.loads((out / "study.json").read_text())
    assert summary["seeds"] == [0, 1]
    assert [row[0] for row in summary["table"][1:]] == ["alone", "fedavg"]
    assert summary["table"][0][0].endswith("mean ± sd (n=2)")
    losses = {s: json.loads((out / "fedavg" / f"seed-{s}" / "results.json").read_text())["test"]["macro"]["loss"]
              for s in (0, 1)}
    assert losses[0] != losses[1]  # the seed reached the run, so the spread is a real one
    assert all(" ± " in row[-1] for row in summary["table"][1:])


def _toml(study: dict) -> str:
    """The study file: [study], then [base] as a run config's TOML, then one table per variant."""
    lines = ["[study]", f'name = "{study["study"]["name"]}"', f'metrics = {json.dumps(study["study"]["metrics"])}']
    base = to_toml(validate(study["base"]))
    for line in base.splitlines():
        if line.startswith("["):
            line = "[base." + line[1:]
        lines.append(line)
    lines.insert(3, "[base]")
    for name, variant in study["variants"].items():
        lines.append(f"[variants.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in variant.items()]
    return "\n".join(lines) + "\n"


# ---- refusals by name ------------------------------------------------------------------------

@pytest.mark.parametrize("model, words", [
    ({"surgery": {"name": "patches"}}, ("patches", "LlamaForCausalLM")),
    ({"surgery": {"name": "controllers", "options": {"after": [0]}}}, ("controllers", "LlamaForCausalLM")),
    ({"surgery": LORA, "quantization": "4bit"}, ('model.quantization = "4bit"', "tiny-llama")),
])
def test_what_cannot_go_into_the_decoder_is_one_line(sources, tmp_path, capsys, model, words):
    config = tmp_path / "run.toml"
    config.write_text(to_toml(validate(instruct_config(sources, federation={"rounds": 1}))))
    sets = [f"model.{k}={_value(v)}" for k, v in model.items()]
    code = main(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress",
                 *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedsilo: error: ") and "Traceback" not in err
    assert all(w in line for w in words), line


def _value(v) -> str:
    """A --set value in TOML's inline syntax."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def test_4bit_on_a_local_checkpoint_needs_cuda(sources, fedavg, tmp_path):
    """A local causal checkpoint with LoRA passes validation; 4-bit weights are refused on this CPU."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _, out, _ = fedavg
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    raw = instruct_config(sources)
    raw["model"] = {"kind": "causal", "name": str(tmp_path / "ckpt"), "quantization": "4bit", "surgery": LORA}
    with pytest.raises(ConfigError, match=r'^model\.quantization = "4bit" needs a CUDA GPU .*this machine has none'):
        build_model(validate(raw))


def test_a_chat_template_the_built_in_tokenizer_lacks_is_refused(sources, tmp_path):
    cfg = validate(instruct_config(sources, task={"template": "chat"}))
    with pytest.raises(FedsiloError, match=r'task\.template = "chat".* has no chat template') as err:
        run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("client, culprit", [
    ({"before_training": "pseudo_labels"}, "client.before_training = 'pseudo_labels': the instruct task does not"),
    ({"objective": "meta_weighting"}, "client.objective = 'meta_weighting'"),
])
def test_client_policies_the_task_cannot_serve_are_refused_by_name(sources, tmp_path, client, culprit):
    cfg = validate(instruct_config(sources, client=client))
    with pytest.raises(FedsiloError, match=culprit):
        run_experiment(cfg, tmp_path / "run", show_progress=False)
