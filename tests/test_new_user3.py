"""What a new user bringing a sixth translation domain met (issue 41, third hardening round): a
repeated row the check did not report (OD11), German "Sie"/"sie" reported as seen in training and
printed folded (item 2), own text not normalised as the built-in domains (3), which model a study
cell is (5), an alone matrix without the own silo (6), a bare checkpoint's embeddings put onto
another tokenizer's pieces (7), deploy's round lines and names (8), threads on a busy machine (9)
and a study repeating each data warning per run (10). Every file is written here (tmp_path).
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fedsilo.config import validate
from fedsilo.rundir.datacheck import warnings_of
from fedsilo.runs.datareport import inspect_silos

SPLITS = ("train", "dev", "test")


def write_csv(path: Path, rows, header) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def per_split_files(folder: Path, rows: dict, header) -> dict:
    for split in SPLITS:
        write_csv(folder / f"{split}.csv", rows[split], header)
    return {"path": str(folder), "files": {s: f"{s}.csv" for s in SPLITS}}


# ---- OD11: a repeated row is reported ----------------------------------------------------------

def test_a_repeated_row_of_a_matching_question_is_reported_by_file_and_line(tmp_path):
    """Rows of one question are gathered into it, so a repeated (question, answer, label) row used
    to vanish there: the check said nothing, though docs/your-data.md says it reports duplicates."""
    ask, other = "How do I reset my password?", "Where is my parcel?"
    train = [(ask, "Use the reset link.", 1), (ask, "Call us.", 0), (other, "Track it online.", 1),
             (ask, "Use the reset link.", 1), (other, "No idea.", 0)]
    folder = tmp_path / "shop"
    source = per_split_files(folder, {"train": train, "dev": [("q dev", "a", 1), ("q dev", "b", 0)],
                                      "test": [("q test", "a", 1), ("q test", "b", 0)]},
                             ("question", "candidate", "label"))
    cfg = validate({"task": {"name": "matching", "sources": {"shop": source}}})
    (check,) = inspect_silos(cfg)
    where = f"{folder / 'train.csv'}"
    assert check.duplicates == {"train": [(f"{where}:5", f"{where}:2")]}
    assert f"    {where}:5 repeats {where}:2" in check.lines()
    assert warnings_of(check) == [f"silo shop: 1 exact duplicate example(s) in train, first {where}:5 "
                                  f"(repeats {where}:2)"]


# ---- item 2: overlap is exact; case-only matches apart, as written ----------------------------

def translation_silo(tmp_path: Path, rows: dict, name: str = "chat") -> dict:
    source = per_split_files(tmp_path / name, rows, ("source", "target"))
    return {"task": {"name": "translation", "sources": {name: source}, "tokenizer_domain": name, "matrix": []}}


def test_overlap_is_exact_and_a_case_only_match_is_listed_apart_as_written_with_file_and_line(tmp_path):
    """"Sie kommen." (formal you) and "sie kommen." (they) are different sentences: the check used
    to count them as seen in training and print them case-folded, ß as ss ('strasse')."""
    rows = {"train": [("Sie kommen morgen.", "You are coming tomorrow."), ("Die Straße ist lang.", "The road is long."),
                      ("Guten Tag.", "Good day.")],
            "dev": [("Gute Nacht.", "Good night.")],
            "test": [("Wir essen.", "We eat."), ("sie kommen morgen.", "They are coming tomorrow."),
                     ("Die Straße ist lang.", "The street is long.")]}
    cfg = validate(translation_silo(tmp_path, rows))
    (check,) = inspect_silos(cfg)
    train, test = tmp_path / "chat" / "train.csv", tmp_path / "chat" / "test.csv"
    assert [(k.text, k.where, k.first) for k in check.overlap["train/test"]] == [
        ("Die Straße ist lang.", f"{test}:4", f"{train}:3")]
    assert [(k.text, k.where, k.first) for k in check.folded["train/test"]] == [
        ("sie kommen morgen.", f"{test}:3", f"{train}:2")]
    text = "\n".join(check.lines())
    assert f"1 source(s) in both train/test (evaluation sees them in training): 'Die Straße ist lang.' ({test}:4 and " \
           f"{train}:3)" in text
    assert "1 source(s) of test equal to a train one only up to case or spacing" in text
    assert "'sie kommen morgen.'" in text and "strasse" not in text
    assert warnings_of(check) == [f"silo chat: 1 source(s) in both train/test, e.g. 'Die Straße ist lang.' "
                                  f"({test}:4 and {train}:3): evaluation sees them in training"]
    assert check.to_json()["overlap"] == {"train/test": 1} and check.to_json()["overlap_up_to_case"] == {
        "train/test": 1}


# ---- item 3: own text normalised as the built-in domains ---------------------------------------

def test_own_translation_text_is_punctuation_normalised_for_the_run_and_shown_as_written_by_the_check(tmp_path):
    """German „ “ – became unknown pieces: the built-in domains are Moses-normalised, own ones were not."""
    from fedsilo.tasks.translation.data import load_silo

    rows = {"train": [("„Sie“ kommen – morgen.", "“You” are coming – tomorrow."), ("Guten Tag.", "Good day.")],
            "dev": [("Gute Nacht.", "Good night.")], "test": [("Wir essen.", "We eat.")]}
    cfg = validate(translation_silo(tmp_path, rows))
    pairs = load_silo(cfg.task, "chat", None)
    assert [(p.source, p.target) for p in pairs["train"]] == [('"Sie" kommen - morgen.', '"You" are coming - tomorrow.'),
                                                               ("Guten Tag.", "Good day.")]
    (check,) = inspect_silos(cfg)
    assert any(note.startswith("1 pair(s) punctuation-normalised for the run") and
               note.endswith(f"first {tmp_path / 'chat' / 'train.csv'}:2") for note in check.notes)


# ---- item 6: the alone matrix has the own silo -------------------------------------------------

def test_each_silo_trained_alone_is_tested_on_the_whole_runs_matrix_own_silos_included(tmp_path):
    rows = {"train": [("Hallo.", "Hello.")], "dev": [("Ja.", "Yes.")], "test": [("Nein.", "No.")]}
    raw = translation_silo(tmp_path, rows, "legal")
    raw["task"].update(silos=["ted", "legal"], tokenizer_domain="ted")
    del raw["task"]["matrix"]
    task = validate(raw).task
    whole = task.matrix_domains()
    assert "legal" in whole and "news" in whole
    for silo in task.silos:
        alone = task.alone(silo)
        assert alone.silos == [silo] and alone.matrix_domains() == whole
    benchmark_only = validate({"task": {"name": "translation", "silos": ["ted", "news"]}}).task
    assert benchmark_only.alone("ted") == benchmark_only.model_copy(update={"silos": ["ted"]})  # unchanged


# ---- item 7: a checkpoint's tokenizer is recorded and checked ----------------------------------

class Vocab:
    def __init__(self, pieces):
        self.pieces = pieces

    def get_vocab(self):
        return {p: i for i, p in enumerate(self.pieces)}


def test_init_from_refuses_a_checkpoint_of_another_tokenizer_of_the_same_size_and_warns_on_a_bare_one(tmp_path):
    import torch

    from fedsilo.config import ConfigError
    from fedsilo.rundir.layout import init_tensors, tokenizer_identity

    fitted, refitted = Vocab(["<pad>", "▁Haus", "▁house"]), Vocab(["<pad>", "▁house", "▁Haus"])
    assert tokenizer_identity(fitted) != tokenizer_identity(refitted) and tokenizer_identity(object()) is None
    like = {"emb": torch.zeros(3, 2)}
    saved = tmp_path / "best.pt"
    torch.save({"round": 1, "tokenizer": tokenizer_identity(fitted), "server": {"params": {"emb": torch.ones(3, 2)}}},
               saved)
    with pytest.raises(ConfigError, match=rf"model.init_from: {saved} was trained with another tokenizer \(vocabulary "
                                          rf"{tokenizer_identity(fitted)}, this run's {tokenizer_identity(refitted)}\)"):
        init_tensors(saved, like, tokenizer_identity(refitted))
    assert torch.equal(init_tensors(saved, like, tokenizer_identity(fitted))["emb"], torch.ones(3, 2))
    bare = tmp_path / "bare.pt"
    torch.save({"emb": torch.ones(3, 2)}, bare)
    with pytest.warns(UserWarning, match="does not record the tokenizer it was trained with"):
        init_tensors(bare, like, tokenizer_identity(refitted))


# ---- item 8: deploy's table shows display names ------------------------------------------------

def test_a_flower_servers_results_carry_the_silos_display_names(tmp_path):
    from fedsilo.runs import flower

    rows = {"train": [("Hallo.", "Hello.")], "dev": [("Ja.", "Yes.")], "test": [("Nein.", "No.")]}
    raw = translation_silo(tmp_path, rows, "legal")
    raw["task"]["sources"]["legal"]["display"] = "Legal texts"
    raw["task"].update(silos=["ted", "legal"], tokenizer_domain="ted", matrix=[])
    cfg = validate(raw)
    assert flower.server_display(cfg) == {"ted": "TED", "legal": "Legal texts"}


# ---- item 9: a busy machine with auto threads is warned about ----------------------------------

def test_auto_threads_on_a_busy_machine_name_engine_threads_1(monkeypatch):
    from fedsilo.runs import runner

    monkeypatch.setattr(runner, "usable_cores", lambda: 2)
    monkeypatch.setattr(runner, "others_running", lambda: 5.0)
    line = runner.busy_machine("auto", 2, "cpu")
    assert "other work takes cores of its 2" in line and "--set engine.threads=1" in line
    assert runner.busy_machine(1, 1, "cpu") is None and runner.busy_machine("auto", 2, "cuda") is None
    monkeypatch.setattr(runner, "others_running", lambda: 0.0)
    assert runner.busy_machine("auto", 2, "cpu") is None
    assert runner.others_running() is None or runner.others_running() >= 0


def test_a_run_with_auto_threads_on_a_busy_machine_warns_and_the_machine_is_read(tmp_path, monkeypatch, capsys):
    """The warning reaches a real run's output (the suite runs one torch thread per worker, where auto
    threads never warn, so the run sets two), and the real readings behind it: the usable cores and the
    runnable tasks of /proc/stat besides this process."""
    import torch

    from fedsilo.runs import runner
    from fedsilo.runs.runner import run_experiment
    from tests.test_plugins import toy_config

    assert runner.usable_cores() >= 1
    others = runner.others_running()
    assert others is not None and others >= 0  # Linux: read from /proc/stat
    monkeypatch.setattr(runner, "others_running", lambda: 5.0)
    torch.set_num_threads(2)
    run_experiment(toy_config(federation={"rounds": 1}), tmp_path / "run", show_progress=False)
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert "fedsilo: warning: this machine is busy" in out and "--set engine.threads=1" in out


# ---- item 10: a study shows each data warning once ---------------------------------------------

STUDY = '''
[study]
name = "toy-study"
metrics = ["map"]

[base]
plugins = ["tests.toytask"]
seed = 5
[base.task]
name = "toyrank"
n_train = 8
n_eval = 4
[base.model]
d_model = 16
d_ff = 32
num_layers = 1
num_heads = 2
[base.client]
batch_size = 4
[base.federation]
rounds = 1

[variants.fedavg]
[variants.equal]
federation = {weighting = "equal"}
[variants.alone]
paradigm = "finetune"
'''


def test_a_study_shows_each_data_warning_once_and_how_many_runs_gave_it(tmp_path, monkeypatch, capsys):
    from fedsilo.runs import runner
    from fedsilo.runs.study import run_study

    real = runner.check_at_start

    def with_a_data_warning(cfg, run_dir, resume, warn, silos=None):
        warn("silo alpha: 2 exact duplicate example(s) in train, first a.csv:3 (repeats a.csv:2)")
        return real(cfg, run_dir, resume, warn, silos)
    monkeypatch.setattr(runner, "check_at_start", with_a_data_warning)
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    run_study(path, tmp_path / "study", show_progress=False)
    captured = capsys.readouterr()
    both = captured.out + captured.err
    assert both.count("warning: silo alpha: 2 exact duplicate example(s) in train") == 1
    assert "fedsilo: the warning 'silo alpha: 2 exact duplicate example(s) in train, first a.csv:3 (rep…' " \
           "above concerned 3 of the study's 3 runs (shown once)" in captured.out
    # item 5: the table says which model a cell is
    assert "the global model under federated training" in (tmp_path / "study" / "report.md").read_text()
