"""Issue 50 (hardening, fourth round): the instruct task's truncation and generation, and `fedsilo generate`.

- `generate --max-new-tokens` past what the model's positions hold is refused in one line naming the
  limit; a value above task.max_length no longer leaves the prompt one token.
- Generation reads `task.max_prompt_length` prompt tokens (not max_length less the answer's room); every
  prompt generation or multiple-choice scoring cuts is counted per silo and split, said in the run's
  output and recorded in results.json; `generate` says its own cut by the same rule.
- A token-cache hit says the same train-split truncation lines as the miss before it.
- The truncation line speaks of what each split does with a cut record (train: trains nothing).
- A stopped `generate` says generation stopped and nothing was written.
- `generate --prompt-file` on a FIFO or a folder is refused before anything opens it.

The data: a synthetic GSM8K (short training questions, two long test questions) and PubMedQA (long
abstracts, so every record is cut and loses its answer at task.max_length = 64) in the benchmark files'
own formats, written here. One tiny run is made twice (the second a token-cache hit) for the module.
"""
import contextlib
import io
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedsilo.cli import Terminated, main
from fedsilo.config import to_toml, validate
from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.recipe import build_model, build_task
from fedsilo.runs.export import load_trained
from fedsilo.tasks.instruct.records import alpaca
from fedsilo.tasks.instruct.scoring import greedy_generate
from fedsilo.tasks.instruct.template import prompt_ids, use_chat
from tests.fifos import fed_fifo

MAX_LENGTH = 64
NEW_TOKENS = 48      # before issue 50 generation read max_length − max_new_tokens = 16 prompt tokens
PROMPT_BUDGET = 512  # task.max_prompt_length's default: the short test questions fit, the long ones do not
LONG = 4 * ("A farmer keeps {n} sheep in the northern meadow and twice as many goats beside the old stone barn; "
            "every evening the shepherd counts them again. ") + "How many animals are there?"


def write_data(root: Path) -> Path:
    """GSM8K and PubMedQA files as the benchmark publishes them, small (their held-out draws need
    474 GSM8K training questions and 51 PubMedQA questions outside the test ids)."""
    gsm8k = root / "gsm8k"
    gsm8k.mkdir(parents=True)
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
            for i in range(480)]
    (gsm8k / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = [{"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"} for i in (3, 5)] + \
           [{"question": LONG.format(n=n), "answer": f"#### {3 * n}"} for n in (4, 7)]
    (gsm8k / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    pubmedqa = root / "pubmedqa"
    pubmedqa.mkdir()
    decisions = ("yes", "no", "maybe")
    docs = {str(1000 + i): {"QUESTION": f"Does treatment {i} help?", "final_decision": decisions[i % 3],
                            "CONTEXTS": [f"We studied {i} patients over {i + 2} years in a randomised trial.",
                                         "Outcomes were measured by independent reviewers at every visit."]}
            for i in range(60)}
    (pubmedqa / "ori_pqal.json").write_text(json.dumps(docs))
    (pubmedqa / "test_ground_truth.json").write_text(json.dumps({p: docs[p]["final_decision"]
                                                                 for p in list(docs)[:4]}))
    return root


def config_dict(data: Path, **task) -> dict:
    return {"name": "h4-generation", "seed": 1,
            "task": {"name": "instruct", "silos": ["gsm8k", "pubmedqa"], "data_dir": str(data),
                     "tokenizer_silo": "gsm8k", "vocab_size": 300, "max_train": 8, "max_eval": 4,
                     "max_length": MAX_LENGTH, "max_new_tokens": NEW_TOKENS,
                     "truncation": "end", **task},
            "model": {"kind": "causal", "d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4},
            "client": {"optimizer": "adamw", "lr": 1e-2, "batch_size": 4, "steps": 1},
            "federation": {"rounds": 1}}


def _said(err: str, start: str = "fedsilo: ") -> list[str]:
    """fedsilo's own lines (a library's warning may come between them)."""
    return [line for line in err.splitlines() if line.startswith(start)]


def _run(config: Path, out: Path) -> list[str]:
    """`fedsilo run`'s warning lines about the instruct task, as a user sees them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("always")  # as a fresh process shows each warning (this one ran the same before)
        assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0, err.getvalue()
    return _said(err.getvalue(), "fedsilo: warning: instruct:")


def _token_files(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (cache / "tokens").glob("instruct-*.safetensors")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny run twice: the first tokenises every silo's training split, the second reads it
    from the token cache. FEDSILO_DATA (the tokenizer's cache) and the token cache under the module's folder."""
    root = tmp_path_factory.mktemp("h4-generation")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(root / "data-root"))
        mp.setenv("FEDSILO_CACHE_DIR", str(root / "cache"))
        data = write_data(root / "benchmark")
        config = root / "h4.toml"
        config.write_text(to_toml(validate(config_dict(data))))
        first = _run(config, root / "first")
        written = _token_files(root / "cache")
        second = _run(config, root / "second")
        yield SimpleNamespace(data=data, run=root / "first", first=first, second=second, written=written,
                              after=_token_files(root / "cache"))


@pytest.fixture(scope="module")
def best(runs):
    """The first run's best model, its tokenizer and whether it renders with a chat template."""
    trained = load_trained(runs.run)
    return trained, trained.tokenizer, use_chat(trained.tokenizer, trained.cfg.task.template)


def _greedy(trained, ids: list[int], new: int) -> str:
    tok = trained.tokenizer
    return tok.decode(greedy_generate(trained.model, [ids], new, tok.eos_token_id, tok.pad_token_id)[0],
                      skip_special_tokens=True)


# ---- 1: --max-new-tokens past what the model holds ------------------------------------------------

def test_generate_past_the_models_positions_is_refused_in_one_line(runs, best, capsys):
    prompt = "What is 2 + 1?"
    _, tok, chat = best
    n = len(prompt_ids(alpaca(prompt), tok, chat))
    for new, said in ((3000, f"--max-new-tokens 3000: the prompt's {n} tokens and 3000 new ones need {n + 3000} "
                             "positions, more than the model's 2048 (max_position_embeddings): give at most "
                             f"{2048 - n}"),
                      (9000, "--max-new-tokens 9000: give at most 8192 (task.max_new_tokens' limit)")):
        assert main(["generate", str(runs.run), "--prompt", prompt, "--max-new-tokens", str(new)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and _said(err) == [f"fedsilo: error: {said}"]


def test_generate_with_more_new_tokens_than_max_length_reads_the_whole_prompt(runs, best, capsys):
    """Before, max_length − max_new_tokens < 1 left the prompt its last token."""
    prompt = "What is 3 + 2?"
    assert main(["generate", str(runs.run), "--prompt", prompt, "--max-new-tokens", str(MAX_LENGTH + 36)]) == 0
    out, err = capsys.readouterr()
    assert _said(err) == [], err
    trained, tok, chat = best
    ids = prompt_ids(alpaca(prompt), tok, chat)
    assert len(ids) > 1 and out == _greedy(trained, ids, MAX_LENGTH + 36) + "\n"


# ---- 2: generation's own prompt budget, every cut counted and said ------------------------------

def test_every_prompt_cut_is_counted_said_and_recorded(runs, best):
    trained, tok, chat = best
    gsm8k = [len(prompt_ids(alpaca(LONG.format(n=n)), tok, chat)) - PROMPT_BUDGET for n in (4, 7)]
    room = MAX_LENGTH - max(len(tok(o, add_special_tokens=False)["input_ids"]) for o in ("yes", "no", "maybe"))
    task = build_task(trained.cfg, tok)
    pubmedqa = [len(prompt_ids(r, tok, chat)) - room for r in task.examples("pubmedqa", "test")]
    assert min(gsm8k) > 0 and min(pubmedqa) > 0  # the data is what the test means it to be

    def span(lost):
        return f"{min(lost)}" if min(lost) == max(lost) else f"{min(lost)}–{max(lost)}"
    assert (f"fedsilo: warning: instruct: gsm8k test: 2 of 4 prompts are longer than task.max_prompt_length = "
            f"{PROMPT_BUDGET} tokens: generation read them without their first {span(gsm8k)} tokens "
            f"({sum(gsm8k)} in all)") in runs.first
    assert (f"fedsilo: warning: instruct: pubmedqa test: 4 of 4 prompts are longer than task.max_length = "
            f"{MAX_LENGTH} less the longest option: multiple-choice scoring read them without their first "
            f"{span(pubmedqa)} tokens ({sum(pubmedqa)} in all)") in runs.first
    rows = {r["client"]: r["stats"] for r in json.loads((runs.run / "results.json").read_text())["test"]["rows"]}
    assert (rows["gsm8k"]["prompt_cut"], rows["gsm8k"]["prompt_lost"]) == (2, sum(gsm8k))
    assert (rows["pubmedqa"]["prompt_cut"], rows["pubmedqa"]["prompt_lost"]) == (4, sum(pubmedqa))


def test_generate_says_its_prompt_cut_by_the_tasks_rule(runs, best, capsys):
    prompt = LONG.format(n=9)
    assert main(["generate", str(runs.run), "--prompt", prompt]) == 0
    out, err = capsys.readouterr()
    trained, tok, chat = best
    ids = prompt_ids(alpaca(prompt), tok, chat)
    assert _said(err) == [f"fedsilo: warning: generate: the prompt is {len(ids)} tokens, longer than the run's "
                    f"task.max_prompt_length = {PROMPT_BUDGET}: as the run's evaluation does, generation reads it "
                    f"without its first {len(ids) - PROMPT_BUDGET} tokens"]
    assert out == _greedy(trained, ids[-PROMPT_BUDGET:], NEW_TOKENS) + "\n"


def test_a_prompt_budget_past_the_models_positions_is_refused(runs):
    cfg = validate(config_dict(runs.data, max_prompt_length=2000, max_new_tokens=100))
    model, tokenizer = build_model(cfg)  # tiny-llama: 2048 positions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        task = build_task(cfg, tokenizer)
    task.evaluate(model, "pubmedqa", "dev")  # nothing is generated there
    with pytest.raises(ConfigError, match=r"^task.max_prompt_length = 2000 \+ task.max_new_tokens = 100 = 2100 "
                                          r"positions, more than the model's 2048 \(max_position_embeddings\)"):
        task.evaluate(model, "gsm8k", "dev")  # refused at the first evaluation, not after the last round


# ---- 3 and 4: truncation said on a cache hit, and per split ----------------------------------------

def test_a_token_cache_hit_says_the_same_truncation_lines_as_the_miss(runs):
    assert runs.written and runs.after == runs.written  # the second run read every silo's rows, wrote none
    train = [line for line in runs.first if " train: " in line]
    assert any("pubmedqa train" in line and "lost their whole response" in line for line in train), runs.first
    assert runs.second == runs.first


def test_the_truncation_line_says_what_each_split_does_with_a_cut_record(runs):
    lines = {re.match(r"fedsilo: warning: instruct: (\w+ \w+):", line).group(1): line for line in runs.first
             if "records are longer than task.max_length" in line}
    head = "fedsilo: warning: instruct: pubmedqa {split}: {n} of {n} records are longer than task.max_length = 64 " \
           "tokens and were cut at the end (task.truncation)"
    train = re.match(r".* train: (\d+) of", lines["pubmedqa train"]).group(1)
    assert lines["pubmedqa train"] == head.format(split="train", n=train) + \
        f"; {train} lost their whole response and train nothing"
    for split in ("dev", "test"):
        assert lines[f"pubmedqa {split}"] == head.format(split=split, n=4) + \
            f": the {split} loss reads what is left; 4 lost their whole response and add nothing to the {split} loss"


# ---- 5: a stopped generate ----------------------------------------------------------------------

@pytest.mark.parametrize("stop, code, said", [
    ("ctrl-c", 130, "fedsilo: interrupted; generation stopped, nothing was written"),
    ("sigterm", 143, "fedsilo: terminated (SIGTERM); generation stopped, nothing was written")])
def test_a_stopped_generate_says_generation_stopped_and_nothing_was_written(runs, monkeypatch, capsys, stop, code,
                                                                            said):
    import fedsilo.runs.generate as generate

    def stopped(*args, **kwargs):  # stopped while decoding: what Ctrl-C, or fedsilo's SIGTERM handler, raises
        raise KeyboardInterrupt if stop == "ctrl-c" else Terminated
    monkeypatch.setattr(generate, "greedy_generate", stopped)
    assert main(["generate", str(runs.run), "--prompt", "What is 1 + 1?"]) == code
    out, err = capsys.readouterr()
    assert out == "" and _said(err) == [said]


# ---- 6: --prompt-file on a FIFO or a folder -------------------------------------------------------

@pytest.fixture
def fifo_with_a_writer(tmp_path):
    """A FIFO that feeds every reader a prompt (so code that opens it generates, and the test fails
    rather than hangs)."""
    with fed_fifo(tmp_path / "prompt.txt", "What is 1 + 1?") as fifo:
        yield fifo


def test_a_prompt_file_that_is_a_fifo_or_a_folder_is_refused_before_it_is_opened(runs, fifo_with_a_writer, tmp_path,
                                                                                 capsys):
    for path, what in ((fifo_with_a_writer, "a FIFO (named pipe), not a regular file: refused before opening it"),
                       (tmp_path, "a folder, not a file")):
        assert main(["generate", str(runs.run), "--prompt-file", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and _said(err) == [f"fedsilo: error: --prompt-file: {path} is {what}"]
