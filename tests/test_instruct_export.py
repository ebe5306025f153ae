"""Using an instruct run's result outside fedsilo: the exported adapters load in peft's
AutoPeftModelForCausalLM alone, a merged or fully fine-tuned model in transformers alone, and each
scores the test records' responses as fedsilo's own model does; `fedsilo generate` answers as greedy
decoding of that model does, and refuses what it cannot answer with in one line.

The silos are own Alpaca-style files written here (short arithmetic and word records), the tokenizer
is fitted on one of them into a cache under the test's folder; each kind of run (a LoRA with a frozen
head, a LoRA with private heads, full fine-tuning) trains once for the module.
"""
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.config import validate
from fedsilo.errors import ConfigWarning
from fedsilo.recipe import build_model, build_task
from fedsilo.runs.export import load_trained
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.instruct.records import alpaca
from fedsilo.tasks.instruct.scoring import greedy_generate
from fedsilo.tasks.instruct.template import prompt_ids, use_chat

SILOS = ("maths", "words", "facts")
ROOT = Path(__file__).resolve().parents[1]


def _rows(silo: str, n: int = 40) -> list[dict]:
    """Small records of three kinds, distinct per silo (a private head has something of its own to learn)."""
    if silo == "maths":
        return [{"instruction": f"Add {i} and {i + 3}.", "response": f"{i} + {i + 3} = {2 * i + 3}"} for i in range(n)]
    if silo == "words":
        words = ["apple", "river", "stone", "cloud", "garden", "window", "silver", "forest"]
        return [{"instruction": f"Spell {words[i % 8]}{i} backwards.", "response": f"{words[i % 8]}{i}"[::-1]}
                for i in range(n)]
    return [{"instruction": f"Which number comes after {i}?", "response": f"The number after {i} is {i + 1}."}
            for i in range(n)]


def _config(data: Path, surgery: dict | None, checkpoint: Path | None = None) -> dict:
    sources = {}
    for silo in SILOS:
        path = data / f"{silo}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _rows(silo)))
        sources[silo] = {"path": str(path), "split": {"dev": 0.2, "test": 0.2}}
    model = {"name": str(checkpoint)} if checkpoint else {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4}
    if surgery is not None:
        model["surgery"] = surgery
    return validate({
        "name": "instruct-export", "seed": 3,
        "task": {"name": "instruct", "silos": list(SILOS), "sources": sources, "tokenizer_silo": "maths",
                 "max_train": 16, "max_eval": 4, "max_length": 128, "max_new_tokens": 12, "vocab_size": 300},
        "model": model,
        "client": {"optimizer": "adamw", "lr": 1e-2, "batch_size": 8, "steps": 2},
        "federation": {"rounds": 1},
    })


LORA = {"name": "lora", "options": {"rank": 4, "alpha": 8}}
RUNS = {"fedit": LORA, "private": {"name": "lora", "options": {"rank": 4, "alpha": 8, "head": "private"}},
        "full": None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One finished run of each kind; FEDSILO_DATA (the tokenizer's cache) under the module's folder."""
    root = tmp_path_factory.mktemp("instruct-export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(root / "cache"))
        done = {}
        for name, surgery in RUNS.items():
            data = root / f"data-{name}"
            data.mkdir()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConfigWarning)
                run_experiment(_config(data, surgery), root / name, show_progress=False)
            done[name] = root / name
        yield done


def _nll(model, run: Path) -> torch.Tensor:
    """Each test record's mean response-token NLL (the task's example_losses), every silo in turn."""
    trained = load_trained(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        task = build_task(trained.cfg, trained.tokenizer)
    out = []
    with torch.no_grad():
        for silo in task.clients:
            out.append(task.example_losses(model.eval(), task.collate(task.examples(silo, "test"))))
    return torch.cat(out).double()


def _base_nll(run: Path) -> torch.Tensor:
    """The same records under the run's untrained model (the exported one must differ from it)."""
    cfg = load_trained(run).cfg
    return _nll(build_model(cfg)[0], run)


@pytest.mark.parametrize("kind, silo", [("fedit", None), ("private", "words")])
def test_exported_adapters_load_in_auto_peft_and_score_as_fedsilo(runs, tmp_path, kind, silo, capsys, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "adapters"
    assert main(["export", str(runs[kind]), "--out", str(out), "--with-base", *(["--silo", silo] if silo else [])]) == 0
    assert "adapters:" in capsys.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == "base"  # relative: it can move
    assert (config["modules_to_save"] == ["lm_head"]) == (kind == "private")
    assert (out / "tokenizer.json").is_file()
    monkeypatch.chdir(out)  # peft resolves the relative base from the current folder
    theirs = _nll(AutoPeftModelForCausalLM.from_pretrained("."), runs[kind])
    ours = _nll(load_trained(runs[kind], silo).model, runs[kind])
    assert float((theirs - ours).abs().max()) <= 1e-5
    assert float((ours - _base_nll(runs[kind])).abs().max()) > 1e-3  # training moved it: the check can fail


@pytest.mark.parametrize("kind, silo", [("fedit", None), ("private", "words")])
def test_the_merged_model_loads_in_transformers_alone_and_scores_as_fedsilo(runs, tmp_path, kind, silo, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    assert main(["export", str(runs[kind]), "--out", str(out), "--merged", *(["--silo", silo] if silo else [])]) == 0
    assert "merged into the base" in capsys.readouterr().out
    assert not (out / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in n or "modules_to_save" in n for n, _ in model.named_parameters())
    trained = load_trained(runs[kind], silo)
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == trained.tokenizer.get_vocab()
    theirs, ours = _nll(model, runs[kind]), _nll(trained.model, runs[kind])
    assert float((theirs - ours).abs().max()) <= 1e-5  # merging W + s·BA rounds once in float32


def test_a_full_fine_tuning_run_exports_its_whole_model(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    assert main(["export", str(runs["full"]), "--out", str(out)]) == 0  # --merged implied
    assert "whole model" in capsys.readouterr().out
    assert json.loads((out / "fedsilo_export.json").read_text())["form"] == "full"
    theirs = _nll(AutoModelForCausalLM.from_pretrained(str(out)), runs["full"])
    ours = _nll(load_trained(runs["full"]).model, runs["full"])
    assert float((theirs - ours).abs().max()) <= 1e-5
    assert float((ours - _base_nll(runs["full"])).abs().max()) > 1e-3
    assert main(["export", str(runs["full"]), "--out", str(tmp_path / "x"), "--with-base"]) == 2
    assert "--with-base" in capsys.readouterr().err and not (tmp_path / "x").exists()


def _greedy(run: Path, prompt: str, silo: str | None, new: int) -> str:
    trained = load_trained(run, silo)
    tok = trained.tokenizer
    ids = prompt_ids(alpaca(prompt), tok, use_chat(tok, trained.cfg.task.template))
    answer = greedy_generate(trained.model, [ids], new, tok.eos_token_id, tok.pad_token_id)[0]
    assert answer  # some tokens before EOS: the comparison below compares something
    return tok.decode(answer, skip_special_tokens=True)


def test_generate_prints_the_greedy_answer_of_the_runs_model(runs, monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    prompt = "Add 4 and 7."
    done = subprocess.run([sys.executable, "-m", "fedsilo", "generate", str(runs["fedit"]), "--prompt", prompt,
                           "--max-new-tokens", "6"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _greedy(runs["fedit"], prompt, None, 6) + "\n"


def test_generate_with_a_silo_uses_its_own_head(runs, capsys):
    prompt = "Spell river3 backwards."
    assert main(["generate", str(runs["private"]), "--prompt", prompt, "--silo", "words"]) == 0
    assert capsys.readouterr().out == _greedy(runs["private"], prompt, "words", 12) + "\n"


def test_generate_refuses_in_one_line(runs, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.toml").write_text('name = "m"\n[task]\nname = "matching"\n')
    foreign = tmp_path / "foreign"
    shutil.copytree(runs["fedit"], foreign)
    shutil.copy(runs["full"] / "best.pt", foreign / "best.pt")
    for run, said in ((other, 'generate needs model.kind = "causal"'), (tmp_path / "missing", "no config.toml"),
                      (foreign, "belongs to another run")):
        assert main(["generate", str(run), "--prompt", "Add 1 and 2."]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedsilo: error:") and said in err and err.count("\n") == 1, err


def test_adapters_of_a_local_checkpoint_point_at_its_folder(runs, tmp_path, capsys):
    """Without --with-base the base is the checkpoint as it is on disk, named as the config names it (here by
    its absolute path): AutoPeft finds it there."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(runs["fedit"] / "tokenizer"))
    checkpoint = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, eos_token_id=tokenizer.eos_token_id,
                                 bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
                     ).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    (tmp_path / "data").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        run_experiment(_config(tmp_path / "data", LORA, checkpoint), tmp_path / "run", show_progress=False)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapters")]) == 0
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint.resolve()) and not (tmp_path / "adapters" / "base").exists()
    theirs = _nll(AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapters")), tmp_path / "run")
    ours = _nll(load_trained(tmp_path / "run").model, tmp_path / "run")
    assert float((theirs - ours).abs().max()) <= 1e-5
