"""A silo's own instruction data, as a new user brings it (issue 42): a folder with an Alpaca-style
JSONL, a CSV with its own column names and chat `messages` JSONL files → `fedsilo init --task
instruct` → `fedsilo data check` (counts, duplicates, train/test overlap, malformed chat rows by
file:line, token lengths against task.max_length) → `fedsilo run`, whose truncation is said per silo
and split. With the built-in tokenizer the only benchmark data read is the public news text it is
fitted on (copied here from ../shared/data; skipped without it); with a local checkpoint whose
tokenizer has a chat template, records are rendered through that template.
"""
import csv
import json
import os
import random
import re
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest

from fedsilo.cli import main
from fedsilo.config import load_config

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
NEWS = "nmt/wmt_news/opennmt_py_wmt_sample"
needs_news = pytest.mark.skipif(not (SHARED / NEWS / "src-train.txt").is_file(),
                                reason="../shared/data holds no news text (the built-in tokenizer is fitted on it)")

# A tiny model and run (the init config's defaults are the real ones).
TINY = ["task.vocab_size=400", "task.max_new_tokens=4", "task.eval_batch_size=16", "model.d_model=32",
        "model.d_ff=64", "model.num_layers=1", "model.num_heads=4", "client.batch_size=8", "client.steps=2",
        "federation.rounds=1"]
WORDS = "apple river stone cloud green quick seven table light music garden paper silver window".split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def chat(user: str, answer: str, system: str = "") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def write_silos(root: Path, n: int = 30) -> Path:
    """helpdesk.jsonl: Alpaca rows (every other one with an input, the odd ones a long output);
    clinic.csv: prompt,completion columns; ward.jsonl: chat messages with a system turn."""
    rnd = random.Random(0)
    root.mkdir(parents=True)
    write_jsonl(root / "helpdesk.jsonl", [
        {"instruction": f"Task {i}: {words(rnd, 5)}", "input": words(rnd, 4) if i % 2 else "",
         "output": words(rnd, 60 if i % 2 else 6)} for i in range(n)])
    with open(root / "clinic.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        w.writerows([f"Q{i} {words(rnd, 3)}", words(rnd, 3)] for i in range(n))
    write_jsonl(root / "ward.jsonl", [{"messages": chat(f"Hi {i} {words(rnd, 4)}", words(rnd, 5), "Be brief.")}
                                      for i in range(n)])
    return root


@pytest.fixture(scope="module")
def news_root(tmp_path_factory):
    """A data cache of its own, filled from ../shared/data (the news text alone is copied)."""
    if not (SHARED / NEWS / "src-train.txt").is_file():
        pytest.skip("../shared/data holds no news text (the built-in tokenizer is fitted on it)")
    root = tmp_path_factory.mktemp("instruct-own-data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(root))
        mp.setenv("FEDSILO_DATA_MIRROR", str(SHARED))
        yield root


def test_init_drafts_alpaca_csv_and_chat_silos_that_validate(tmp_path, capsys):
    data = write_silos(tmp_path / "silos")
    write_jsonl(data / "desk.jsonl", [{"conversation": chat(f"q {i}", f"a {i}")} for i in range(10)])
    config = tmp_path / "mine.toml"
    assert main(["init", str(data), "--task", "instruct", "--out", str(config)]) == 0
    out = capsys.readouterr().out
    assert "DECIDE" not in out and "clinic, desk, helpdesk, ward" in out
    cfg = load_config(str(config))  # as a run loads it
    sources = cfg.task.sources
    assert cfg.task.silos == ["clinic", "desk", "helpdesk", "ward"]
    assert dict(sources["clinic"].fields) == {"instruction": "prompt", "response": "completion"}
    assert sources["clinic"].format_name == "csv" and not sources["clinic"].chat
    assert dict(sources["helpdesk"].fields) == {"response": "output"}  # instruction and input: their own names
    assert sources["ward"].chat and not sources["ward"].fields  # the key is `messages`
    assert sources["desk"].chat and dict(sources["desk"].fields) == {"messages": "conversation"}
    assert cfg.model.kind == "causal" and cfg.model.name is None  # the built-in tiny-llama
    text = config.read_text()
    assert "chat = true" in text and "grouped by conversation" in text


def test_init_check_and_run_read_no_benchmark_file_but_the_news_text(tmp_path, capsys, news_root):
    data = write_silos(tmp_path / "silos")
    config = tmp_path / "mine.toml"
    assert main(["init", str(data), "--task", "instruct", "--out", str(config)]) == 0
    tiny = [*TINY, "task.max_length=128"]
    report = tmp_path / "check.json"
    assert main(["data", "check", str(config), *sets(tiny), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "3 silo(s) checked: ready to run" in out
    checks = {c["name"]: c for c in json.loads(report.read_text())}
    assert {name: c["counts"] for name, c in checks.items()} == {
        name: {"train": 24, "dev": 3, "test": 3} for name in ("clinic", "helpdesk", "ward")}
    assert checks["ward"]["kind"] == "jsonl, chat"
    lengths = {name: c["lengths"][0] for name, c in checks.items()}
    assert all(x["n"] == 30 and x["setting"] == "task.max_length" for x in lengths.values())
    assert lengths["clinic"]["fit"] == 30 and lengths["ward"]["fit"] == 30  # short records
    too_long = 30 - lengths["helpdesk"]["fit"]
    assert too_long > 0 and f"{too_long} longer would be cut to it" in out

    run = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run), "--no-progress", *sets(tiny)]) == 0
    err = capsys.readouterr().err
    said = re.findall(r"instruct: (\w+) (\w+): (\d+) of (\d+) records are longer than task.max_length = 128", err)
    assert {silo for silo, *_ in said} == {"helpdesk"}  # the short silos are never cut
    counted = {split: int(cut) for _, split, cut, _ in said}
    assert set(counted) == {"train", "dev", "test"} and sum(counted.values()) == too_long  # as data check said
    assert (run / "results.json").is_file() or (run / "report.md").is_file()
    fetched = sorted(str(p.relative_to(news_root / "instruct")) for p in (news_root / "instruct").rglob("*")
                     if p.is_file())
    assert fetched and all(f.startswith(NEWS) for f in fetched)  # no GSM8K, PubMedQA or Code Alpaca file


def write_ward(root: Path) -> Path:
    """A chat silo with its own train/dev/test files: a repeated row, a conversation in train and
    test, and three malformed rows in train (lines 4, 5 and 6)."""
    root.mkdir(parents=True)
    good = [{"messages": chat(f"how do I reset device {i}?", f"hold button {i} for ten seconds")} for i in range(12)]
    write_jsonl(root / "train.jsonl", [good[0], good[1], good[0],  # line 3 repeats line 1
                                       {"messages": chat("a", "b")[:1]},                    # 4: ends with the user
                                       {"messages": [{"role": "bot", "content": "hi"}]},   # 5: unknown role
                                       {"messages": [{"role": "user", "content": "x"},     # 6: content not text
                                                     {"role": "assistant", "content": 3}]},
                                       *good[2:8]])
    write_jsonl(root / "dev.jsonl", good[8:10])
    write_jsonl(root / "test.jsonl", [good[10], good[11], good[5]])  # good[5] is train's line 10 too
    return root


def ward_config(tmp_path: Path, extra: str = "", model: str = "") -> Path:
    write_ward(tmp_path / "ward")
    config = tmp_path / "ward.toml"
    config.write_text(f"""
[task]
name = "instruct"
[task.sources.ward]
path = "ward"
files = {{train = "train.jsonl", dev = "dev.jsonl", test = "test.jsonl"}}
chat = true
{extra}
[model]
kind = "causal"
{model}
""")
    return config


def test_data_check_names_malformed_chat_rows_duplicates_and_overlap(tmp_path, capsys, news_root):
    config = ward_config(tmp_path)
    assert main(["data", "check", str(config), *sets(TINY)]) == 1  # malformed rows stop a run
    out = capsys.readouterr().out
    train = tmp_path / "ward" / "train.jsonl"
    assert "silo ward (jsonl, chat): 9 train, 2 dev, 3 test records" in out
    assert "3 malformed row(s), which stop a run:" in out
    assert f"{train}:4: the last message is the user's" in out
    assert f"{train}:5: message 1: role 'bot' is not one of system, user, assistant" in out
    assert f"{train}:6: message 2 (assistant): content is a int; expected text" in out
    assert "1 exact duplicate(s) in train" in out and f"{train}:3 repeats {train}:1" in out
    assert "1 prompt(s) in both train/test" in out and f"{tmp_path / 'ward' / 'test.jsonl'}:3 and {train}:10" in out
    assert "1 cannot be run (ward)" in out

    config = ward_config(tmp_path / "skip", extra='bad_rows = "skip"')
    report = tmp_path / "check.json"
    for limit, fit in ((4096, 14), (8, 0)):  # every record fits; none does (the template alone is longer)
        code = main(["data", "check", str(config), *sets(TINY), "--set", f"task.max_length={limit}",
                     "--json", str(report)])
        out = capsys.readouterr().out
        assert code == 0
        (lengths,) = json.loads(report.read_text())[0]["lengths"]
        assert (lengths["n"], lengths["fit"], lengths["limit"]) == (14, fit, limit)
        assert ("14 longer would be cut to it" in out) == (fit == 0)


def save_chat_checkpoint(folder: Path) -> Path:
    """A tiny random Llama and a byte-level tokenizer with a ChatML template, as a user's checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedsilo.tasks.instruct.tokenizer import fit_tokenizer

    tok = fit_tokenizer([f"hold button {i} for ten seconds to reset device {i}" for i in range(50)], 300)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def ids_of(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


@pytest.mark.filterwarnings("ignore:silo ward")
def test_a_local_checkpoints_chat_template_renders_and_measures_the_records(tmp_path, capsys, news_root):
    from transformers import AutoTokenizer

    from fedsilo.recipe import build_model, build_task

    ckpt = save_chat_checkpoint(tmp_path / "ckpt")
    config = ward_config(tmp_path, extra='bad_rows = "skip"', model=f'name = "{ckpt}"')
    report = tmp_path / "check.json"
    assert main(["data", "check", str(config), "--set", "task.max_length=4096", "--json", str(report)]) == 0
    capsys.readouterr()
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    good = [chat(f"how do I reset device {i}?", f"hold button {i} for ten seconds") for i in range(12)]
    full = [len(ids_of(tokenizer.apply_chat_template(m, tokenize=True))) for m in good]
    (lengths,) = json.loads(report.read_text())[0]["lengths"]
    assert lengths["max"] == max(full)  # measured through the checkpoint's chat template, not the plain one

    cfg = load_config(str(config))
    _, tok = build_model(cfg)
    task = build_task(cfg, tok)
    assert task.chat  # task.template = "auto": the tokenizer has a chat template
    record = task.examples("ward", "dev")[0]
    messages = [{"role": r, "content": c} for r, c in (*record.turns, ("assistant", record.response))]
    (row,) = task.tokenize([record])
    assert row["input_ids"].tolist() == ids_of(tokenizer.apply_chat_template(messages, tokenize=True))
    prompt = ids_of(tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True))
    labels = row["labels"].tolist()
    assert all(x == -100 for x in labels[:len(prompt)]) and all(x != -100 for x in labels[len(prompt):])


def test_a_missing_news_text_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "empty"))
    monkeypatch.setattr("fedsilo.datafetch.find_mirror", lambda: None)

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    data = write_silos(tmp_path / "silos")
    config = tmp_path / "mine.toml"
    assert main(["init", str(data), "--task", "instruct", "--out", str(config)]) == 0
    capsys.readouterr()
    assert main(["data", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedsilo: error: cannot download nmt/wmt_news/opennmt_py_wmt_sample/")
    assert "FEDSILO_DATA_MIRROR" in line and "silo(s) news" in line and "tokenizer" in line
    assert not any(p.name.endswith(".json") for p in (tmp_path / "empty").rglob("*"))  # no GSM8K etc. fetched
