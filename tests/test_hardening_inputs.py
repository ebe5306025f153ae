"""Issue 23, "one line, never a traceback": malformed multitask sources, impossible or misplaced
FedMatch patches, asymmetric T5 depths, malformed results under `fedsilo compare`, and a matching
silo whose test questions have no correct answer. Each case is what a user can cause; each gives
one `fedsilo: error:` line naming the culprit, exit 2 (or, for asymmetric T5 depths, just works)."""
import csv
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.config import ConfigError, to_toml, validate
from fedsilo.datafetch import DataError
from fedsilo.errors import FedsiloError, SurgeryError
from fedsilo.tasks.multitask.data import load_fewshot
from tests import mtoy
from tests.test_bad_input import fails


@pytest.fixture(autouse=True)
def own_data_root(tmp_path, monkeypatch):
    """Prepared splits go to this test's folder, never the user's cache."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))


def write(root: Path, rel: str, data: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def config_file(tmp_path: Path, cfg) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(to_toml(cfg))
    return path


# ---- 1. multitask sources: DataError naming file:line (or file and record) and the reason ----------

POEM = "poem-sentiment/data"
HSO = "ethos/hs_data/hate-speech-and-offensive-language.csv"
HATE = "tweeteval/datasets/hate"
AESLC = "AESLC/enron_subject_line_dev_test.tar.gz"


def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


GOOD_POEM = "0\tone\t1\n1\ttwo\t0\n"
HSO_HEAD = ",count,hate_speech,offensive_language,neither,class,tweet\n"
MALFORMED = {  # kind: (task, {file: content}, what the message must hold)
    "undecodable": ("poem_sentiment", {f"{POEM}/train.tsv": b"0\tone\t1\n1\tb\xffd\t0\n", f"{POEM}/dev.tsv": GOOD_POEM},
                    f"{POEM}/train.tsv:2: not utf-8 text (byte 0xff"),
    "unknown label (KeyError '7')": ("poem_sentiment", {f"{POEM}/train.tsv": GOOD_POEM + "2\tthree\t7\n",
                                                       f"{POEM}/dev.tsv": GOOD_POEM},
                                     f"{POEM}/train.tsv:3: malformed record: unknown label '7'; expected one of"),
    "too few fields (unpacking)": ("poem_sentiment", {f"{POEM}/train.tsv": GOOD_POEM, f"{POEM}/dev.tsv": "0\tfive\n"},
                                   f"{POEM}/dev.tsv:1: malformed record: not enough values to unpack "
                                   "(expected 3, got 2)"),
    "too few columns (IndexError)": ("hate_speech_offensive", {HSO: HSO_HEAD + "0,3,0,0,3,2,a\n1,3,3,0\n"},
                                     f"{HSO}:3: malformed record: list index out of range (the record has 4 fields)"),
    "label id out of range": ("tweet_eval-hate", {f"{HATE}/train_text.txt": "a\nb\n",
                                                  f"{HATE}/train_labels.txt": "0\n7\n",
                                                  f"{HATE}/val_text.txt": "c\n", f"{HATE}/val_labels.txt": "1\n"},
                              f"{HATE}/train_labels.txt:2: malformed record: unknown label 7; expected one of 0, 1"),
    "texts and labels disagree": ("tweet_eval-hate", {f"{HATE}/train_text.txt": "a\nb\n",
                                                      f"{HATE}/train_labels.txt": "0\n",
                                                      f"{HATE}/val_text.txt": "c\n", f"{HATE}/val_labels.txt": "1\n"},
                                  f"{HATE}/train_text.txt: 2 tweets but 1 labels"),
    "invalid JSON line": ("climate_fever", {"climate-fever-dataset/dataset/climate-fever.jsonl":
                                            '{"claim": "a", "claim_label": "SUPPORTS"}\n{"claim": "b",\n'},
                          "climate-fever.jsonl:2: invalid JSON"),
    "JSON record without a field": ("superglue-cb", {
        f"P-tuning/FewGLUE_32dev/CB/{s}.jsonl": '{"premise": "p", "hypothesis": "h", "label": "neutral"}\n'
        + ('{"hypothesis": "h", "label": "neutral"}\n' if s == "val" else "") for s in ("train", "dev32", "val")},
        "CB/val.jsonl:2: malformed record: no field 'premise'"),
    "csv without a column": ("e2e_nlg_cleaned", {f"e2e-cleaning/cleaned-data/{f}": "mr,text\n\"name[A]\",A.\n"
                                                  for f in ("test-fixed.csv", "devel-fixed.no-ol.csv")},
                             "test-fixed.csv:2: malformed record: no field 'ref'"),
    "answer index out of range": ("codah", {f"CODAH/data/cv_split/fold_0/{s}.tsv": "o\tA dog\ta\tb\tc\td\t9\n"
                                            for s in ("train", "dev")},
                                  "fold_0/train.tsv:1: malformed record: answer 9 is not one of the 4 choices"),
    "malformed record in an archive": ("aeslc", {AESLC: _tar({"enron_subject_line/test/b.subject": "b\n\n@subject\nB",
                                                              "enron_subject_line/dev/a.subject": "no blank line"})},
                                       f"{AESLC}: enron_subject_line/dev/a.subject: malformed record: "
                                       "not enough values"),
    "not an archive": ("aeslc", {AESLC: b"plain text, not a tar"}, f"{AESLC}: not a readable tar archive"),
    "a plug-in's converter": ("toy-copy", {f"toy/toy-copy-{s}.tsv": "no tab here\n" for s in ("train", "test")},
                              "multitask task toy-copy: cannot convert"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_multitask_source_is_a_data_error_naming_file_and_line(tmp_path, kind):
    task, files, message = MALFORMED[kind]
    for rel, content in files.items():
        write(tmp_path, rel, content)
    with pytest.raises(DataError) as caught:
        load_fewshot(tmp_path, task, [100], 4, 6)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("kind", ["undecodable", "unknown label (KeyError '7')", "too few fields (unpacking)"])
def test_malformed_multitask_source_through_the_cli(tmp_path, capsys, kind):
    task, files, message = MALFORMED[kind]
    for rel, content in files.items():
        write(tmp_path / "data", rel, content)
    cfg = validate(mtoy.config(tmp_path / "data", task={"tasks": [task], "clients": 1}))
    fails(capsys, "run", str(config_file(tmp_path, cfg)), "--out", str(tmp_path / "run"), "--no-progress",
          culprit=message)


# ---- 2, 3. FedMatch patches: a size that cannot be allocated, a model they cannot go into -----------

def test_an_impossible_patch_size_is_refused_by_the_config_with_the_options_name(tmp_path, capsys):
    from tests.test_patches import run_config
    path = config_file(tmp_path, run_config({"kind": "lowrank", "size": 8}))
    fails(capsys, "run", str(path), "--out", str(tmp_path / "run"), "--set", f"model.surgery.options.size={10**12}",
          culprit="model.surgery.options.size: Input should be less than or equal to 16384")
    assert not (tmp_path / "run").exists()


def test_a_patch_wider_than_the_model_is_refused_when_the_surgery_runs(tmp_path, capsys):
    from fedsilo.models.patches import PatchSettings, apply_patches
    from tests.test_patches import D, run_config, tiny
    with pytest.raises(SurgeryError, match=rf"model.surgery.options.size = {2 * D} is larger than the model's "
                                           rf"hidden size d = {D}"):
        apply_patches(tiny(), PatchSettings(size=2 * D), 0)
    path = config_file(tmp_path, run_config({"kind": "lowrank", "size": 8}))  # tiny-bert, d_model 32
    fails(capsys, "run", str(path), "--out", str(tmp_path / "run"), "--set", "model.surgery.options.size=64",
          culprit="model.surgery.options.size = 64 is larger than the model's hidden size d = 32")


def test_patches_on_a_t5_are_refused_by_name(tmp_path, capsys):
    patches = {"surgery": {"name": "patches", "options": {"size": 8}}}
    raw = mtoy.config(mtoy.write_data(tmp_path / "data"), model=patches)
    with pytest.raises(ConfigError, match=r"model.surgery: patches need a BERT-family cross-encoder \(model.kind = "
                                          r"\"encoder\": minilm, tiny-bert or a local BERT checkpoint\), not a "
                                          r"seq2seq model \(model.name = 'tiny-t5'\)"):
        validate(raw)
    path = tmp_path / "exp.toml"
    path.write_text(to_toml(validate(mtoy.config(tmp_path / "data"))) + '\n[model.surgery]\nname = "patches"\n')
    fails(capsys, "run", str(path), "--out", str(tmp_path / "run"), culprit="model.surgery: patches need a BERT-family")


def test_patches_on_an_unnamed_seq2seq_model_fail_in_one_line_when_the_surgery_runs():
    """A local checkpoint folder or the task's default model is only known once built."""
    from transformers import T5Config, T5ForConditionalGeneration

    from fedsilo.models import seq2seq
    from fedsilo.models.patches import SEQ2SEQ_NAMES, PatchSettings, apply_patches
    assert SEQ2SEQ_NAMES == seq2seq.BUILTIN
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    with pytest.raises(FedsiloError, match=r"patches need a BERT-family.*T5ForConditionalGeneration.*no `bert`"):
        apply_patches(t5, PatchSettings(size=4), 0)


# ---- 4. T5 with fewer encoder than decoder layers (or more) generates ------------------------------

@pytest.mark.parametrize("encoder, decoder", [(1, 2), (1, 3), (3, 1)])
def test_tiny_t5_with_asymmetric_depths_generates(encoder, decoder):
    from fedsilo.config import ModelConfig
    from fedsilo.models.seq2seq import build_seq2seq, greedy_with_topk, token_losses_and_greedy
    cfg = ModelConfig(kind="seq2seq", name="tiny-t5", d_model=16, d_ff=32, num_layers=encoder,
                      num_decoder_layers=decoder, num_heads=2, device="cpu")
    model, tokenizer = build_seq2seq(cfg, seed=0)
    assert (len(model.encoder.block), len(model.decoder.block)) == (encoder, decoder)
    enc = tokenizer(["a cat sat", "on the mat today"], padding=True, return_tensors="pt",
                    return_token_type_ids=False)
    labels = tokenizer(["the cat", "a mat"], padding=True, return_tensors="pt")["input_ids"]
    loss, ids = token_losses_and_greedy(model, enc, labels.masked_fill(labels == tokenizer.pad_token_id, -100), 5)
    assert bool(torch.isfinite(loss).all()) and loss.shape == labels.shape and ids.shape[0] == 2
    outs = greedy_with_topk(model, enc, 5, k=3)
    assert len(outs) == 2 and all(logits.shape == (len(out), 3) for out, logits in outs)


def test_a_multitask_run_on_a_t5_with_one_encoder_layer_finishes(tmp_path, capsys):
    raw = mtoy.config(mtoy.write_data(tmp_path / "data"), model={"num_layers": 1, "num_decoder_layers": 2},
                      federation={"rounds": 1})
    path = config_file(tmp_path, validate(raw))
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test"]["rows"]


# ---- 5. fedsilo compare on malformed results, and impossible tie margins ---------------------------

def _results(rows=None) -> dict:
    rows = rows if rows is not None else [{"client": "c1", "task": "a", "metrics": {"acc": 50.0}}]
    return {"metric_spec": {"primary": "acc", "higher_is_better": True}, "test": {"rows": rows}}


BAD_RESULTS = {
    "a top-level list": ([_results()], "expected a JSON object at the top level, got a list"),
    "a string metric": (_results([{"client": "c1", "task": "a", "metrics": {"acc": "50"}}]),
                        "test.rows[0]: metrics.acc is a string ('50'), expected a number"),
    "a row without task": (_results([{"client": "c1", "metrics": {"acc": 5.0}}]), "test.rows[0]: no 'task'"),
    "rows not a list": (_results({"c1": 1}), "test.rows is an object, expected a list"),
    "a row that is not an object": (_results([7]), "test.rows[0] is a number, expected an object"),
    "metrics not an object": (_results([{"client": "c1", "task": "a", "metrics": [1]}]),
                              "test.rows[0]: metrics is a list, expected an object"),
    "test not an object": ({"metric_spec": {"primary": "acc"}, "test": [1]}, "'test' is a list, expected an object"),
    "a repeated row": (_results(_results()["test"]["rows"] * 2),
                       "test.rows[1]: a second row for client 'c1', task 'a'"),
}


@pytest.mark.parametrize("kind", list(BAD_RESULTS))
def test_compare_names_the_file_and_what_is_wrong(tmp_path, capsys, kind):
    content, message = BAD_RESULTS[kind]
    write(tmp_path, "new/results.json", json.dumps(content))
    write(tmp_path, "base/results.json", json.dumps(_results()))
    fails(capsys, "compare", str(tmp_path / "new"), "--baseline", str(tmp_path / "base"),
          culprit=f"{tmp_path / 'new' / 'results.json'}: {message}")


@pytest.mark.parametrize("tie", ["nan", "-1", "inf"])
def test_compare_refuses_a_tie_margin_that_is_not_a_finite_number_at_least_0(tmp_path, capsys, tie):
    for name in ("new", "base"):
        write(tmp_path, f"{name}/results.json", json.dumps(_results()))
    fails(capsys, "compare", str(tmp_path / "new"), "--baseline", str(tmp_path / "base"), "--tie", tie,
          culprit=f"--tie {float(tie)!r}: the tie margin must be a finite number ≥ 0")
    assert main(["compare", str(tmp_path / "new"), "--baseline", str(tmp_path / "base"), "--tie", "0.5"]) == 0


# ---- 6. a matching silo whose test questions have no correct answer ----------------------------------

def _trecqa(root: Path, labels: dict[str, str]) -> None:
    """Two questions per split, each with a relevant and an irrelevant answer, but `labels[split]` for all."""
    for split in ("train", "dev", "test"):
        out = io.StringIO()
        rows = [(f"{split} question {q} ?", labels.get(split, str(1 - a)), f"answer {q}{a} .")
                for q in range(2) for a in range(2)]
        csv.writer(out).writerows([("qtext", "label", "atext"), *rows])
        write(root, f"trecqa/{split}.csv", out.getvalue())


@pytest.mark.parametrize("split", ["test", "dev"])
def test_a_matching_split_without_a_correct_answer_is_refused_before_training(tmp_path, capsys, split):
    _trecqa(tmp_path / "data", {split: "0"})
    cfg = validate({
        "name": "qa", "task": {"name": "matching", "data_dir": str(tmp_path / "data"), "silos": ["trecqa"],
                               "max_length": 32},
        "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 4},
        "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 4}, "federation": {"rounds": 1},
    })
    fails(capsys, "run", str(config_file(tmp_path, cfg)), "--out", str(tmp_path / "run"), "--no-progress",
          culprit=f"silo trecqa, {split} split: no question has both a relevant and an irrelevant candidate "
                  f"(every {split} label is 0: no question has a correct answer)")
    assert not (tmp_path / "run" / "results.json").exists()
