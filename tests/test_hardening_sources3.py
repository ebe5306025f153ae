"""A silo's own files and `fedsilo init`, third hardening round (issue 41): ids that do not depend
on where a folder lives (OD-path), files that are not regular files (OD28: a FIFO), symlink loops
(OD13, IN05), two files sharing a name (IN06), an out-of-range column index (OD29), a test file of
an unknown name (new-user item 1), gzip-compressed files (item 4) and a silo's own folder given to
`init` (item 11). Every file is written here; nothing of ../shared/data is read.
"""
import csv
import gzip
import json
import os
import tomllib
from pathlib import Path

import pytest

from fedsilo.cli import main
from fedsilo.config import load_config, validate
from fedsilo.errors import DataError
from fedsilo.sources.fingerprint import fingerprints
from fedsilo.sources.load import load_rows
from fedsilo.tasks.matching.data import own_questions
from fedsilo.tasks.matching.task import triples
from tests.fifos import fed_fifo

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

TOPICS = ["loan", "card", "account", "fee", "deposit", "transfer", "branch", "pension", "saving", "tax", "rent",
          "bond"]


def write_csv(path: Path, rows, header=("question", "candidate", "label")) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if header:
            w.writerow(header)
        w.writerows(rows)
    return path


def qa_rows(tag: str) -> list[tuple[str, str, int]]:
    """Per question one right answer and seven wrong ones: seven pairs, more than a draw of two."""
    rows = []
    for i, t in enumerate(TOPICS):
        q = f"how do i change the {t} limit ({tag} {i})?"
        rows.append((q, f"open settings and pick {t} ({tag} {i}).", 1))
        rows += [(q, f"our {o} page lists every {o} offer.", 0) for o in TOPICS if o != t][:7]
    return rows


def qa_folder(folder: Path) -> Path:
    write_csv(folder / "train.csv", qa_rows("train"))
    write_csv(folder / "dev.csv", qa_rows("dev")[:16])
    write_csv(folder / "test.csv", qa_rows("test")[:16])
    return folder


def matching_task(path: Path, **task):
    source = {"path": str(path), "files": {s: f"{s}.csv" for s in ("train", "dev", "test")}}
    return validate({"task": {"name": "matching", "sources": {"bank": source}, **task}}).task


def lines_folder(folder: Path, names=("train", "val"), n=12, gz=()) -> Path:
    """Line-aligned German/English files per name; the names in `gz` gzip-compressed."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        for lang, word in (("de", "satz"), ("en", "sentence")):
            text = "".join(f"{word} {name} {i}\n" for i in range(n)).encode()
            if name in gz:
                Path(folder / f"{name}.{lang}.gz").write_bytes(gzip.compress(text))
            else:
                Path(folder / f"{name}.{lang}").write_bytes(text)
    return folder


def one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("fedsilo: error: "), err
    return lines[-1]


# ---- OD-path: ids and pair draws do not depend on the folder's absolute path -------------------

def test_own_question_ids_and_pair_draws_are_the_same_wherever_the_folder_lives(tmp_path):
    here = qa_folder(tmp_path / "a" / "bank")
    there = qa_folder(tmp_path / "elsewhere" / "deeper" / "bank")
    loaded = {}
    for where in (here, there):
        task = matching_task(where)
        questions, problems = own_questions(load_rows("bank", task.sources["bank"]), task.negatives)
        assert not problems
        loaded[where] = questions
    a, b = loaded[here], loaded[there]
    assert [q.qid for q in a["train"]] == [q.qid for q in b["train"]]
    assert all(str(tmp_path) not in q.qid for qs in a.values() for q in qs)  # nothing of where it lives
    assert a == b
    assert triples(a["train"], 2, "bank/pairs") == triples(b["train"], 2, "bank/pairs")


def test_a_tiny_run_on_the_same_folder_at_two_paths_gives_identical_results(tmp_path):
    from fedsilo.runs.runner import run_experiment

    results = []
    for i, where in enumerate((tmp_path / "a" / "bank", tmp_path / "b" / "c" / "bank")):
        qa_folder(where)
        cfg = validate({
            "name": "path", "seed": 1,
            "task": {"name": "matching", "pairs_per_question": 2, "max_length": 32, "eval_batch_size": 16,
                     "sources": {"bank": {"path": str(where),
                                          "files": {s: f"{s}.csv" for s in ("train", "dev", "test")}}}},
            "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 16, "d_ff": 32, "num_layers": 1,
                      "num_heads": 2, "dropout": 0.0},
            "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 8},
            "federation": {"rounds": 1}})
        out = run_experiment(cfg, tmp_path / f"run{i}", show_progress=False)
        results.append([(r["client"], r["metrics"]) for r in out["test"]["rows"]])
    assert results[0] == results[1]


# ---- OD28: a FIFO in place of a data file ---------------------------------------------------------

@pytest.fixture
def fifo_with_a_writer(tmp_path):
    """A FIFO named train.csv that feeds every reader valid rows (so code that opens it reads them and
    the test fails rather than hangs)."""
    (tmp_path / "silo").mkdir()
    rows = "question,candidate,label\n" + "".join(f"q{i},a{i},1\nq{i},b{i},0\n" for i in range(10))
    with fed_fifo(tmp_path / "silo" / "train.csv", rows) as fifo:
        yield fifo


def test_a_fifo_in_place_of_a_data_file_is_refused_by_name_before_it_is_opened(fifo_with_a_writer, tmp_path):
    source = validate({"task": {"name": "matching", "sources": {"bank": {
        "path": str(fifo_with_a_writer), "split": {"dev": 0.2, "test": 0.2}}}}}).task.sources["bank"]
    with pytest.raises(DataError, match=r"silo bank: .*train\.csv is a FIFO .*not a regular file"):
        load_rows("bank", source)


@pytest.mark.parametrize("command", ["check", "run"])
def test_data_check_and_run_refuse_a_fifo_in_one_line(fifo_with_a_writer, tmp_path, capsys, command):
    config = tmp_path / "c.toml"
    config.write_text(f'[task]\nname = "matching"\n[task.sources.bank]\npath = "{fifo_with_a_writer}"\n'
                      'split = {dev = 0.2, test = 0.2}\n')
    argv = ["data", "check", str(config)] if command == "check" else ["run", str(config), "--out", str(tmp_path / "r")]
    if command == "check":  # the silo's row of the report, which cannot be run (issue 50: exit 1, as documented)
        assert main(argv) == 1
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("silo bank (csv): "))
        assert "cannot be run: " in line and "train.csv is a FIFO" in line
        return
    assert main(argv) == 2
    assert "train.csv is a FIFO" in one_error_line(capsys.readouterr().err)


# ---- OD13 / IN05: a symlink loop -----------------------------------------------------------------

def symlink_loop(a: Path, b: Path) -> Path:
    a.symlink_to(b.name)
    b.symlink_to(a.name)
    return a


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_symlink_loop_as_a_data_file_is_one_line_naming_it(tmp_path, capsys, command):
    loop = symlink_loop(tmp_path / "bank.csv", tmp_path / "other.csv")
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "matching"\n[task.sources.bank]\npath = "bank.csv"\n'
                      'split = {dev = 0.2, test = 0.2}\n')
    argv = ["data", "check", str(config)] if command == "check" else ["run", str(config), "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "symlink loop" in line and str(loop.name) in line and "task.sources.bank.path" in line


def test_a_symlink_loop_inside_a_lines_silo_is_one_line_naming_it(tmp_path, capsys):
    folder = lines_folder(tmp_path / "legal", names=("train", "val", "test"))
    (folder / "train.en").unlink()
    symlink_loop(folder / "train.en", folder / "loop.en")
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "translation"\ntokenizer_domain = "legal"\n[task.sources.legal]\n'
                      'path = "legal"\nformat = "lines"\nfields = {source = "de", target = "en"}\n'
                      'files = {train = "train", dev = "val", test = "test"}\n')
    assert main(["data", "check", str(config)]) == 1  # the silo's row (issue 50: exit 1, as documented)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("silo legal"))
    assert "cannot be run: " in line and "symlink loop" in line and "train.en" in line


def test_init_names_a_symlink_loop_and_uses_the_other_silos(tmp_path, capsys):
    data = tmp_path / "data"
    write_csv(data / "bank.csv", qa_rows("bank"))
    symlink_loop(data / "loop", data / "pool")
    (data / "shop").mkdir()
    write_csv(data / "shop" / "train.csv", qa_rows("shop"))
    symlink_loop(data / "shop" / "test.csv", data / "shop" / "x.csv")
    out = tmp_path / "c.toml"
    assert main(["init", str(data), "--task", "matching", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not used: loop (a symlink loop" in printed and "not used: pool (a symlink loop" in printed
    assert "not used: shop/test.csv (a symlink loop" in printed and "not used: shop/x.csv (a symlink loop" in printed
    assert tomllib.loads(out.read_text())["task"]["silos"] == ["bank", "shop"]
    load_config(out)


# ---- IN06 and item 11: init never writes an invalid config -----------------------------------------

def test_init_gives_two_files_sharing_a_name_distinct_silo_names(tmp_path, capsys):
    data = tmp_path / "data"
    write_csv(data / "bank.csv", qa_rows("csv"))
    (data / "bank.jsonl").write_text("".join(json.dumps({"question": q, "candidate": a, "label": y}) + "\n"
                                             for q, a, y in qa_rows("jsonl")))
    out = tmp_path / "c.toml"
    assert main(["init", str(data), "--task", "matching", "--out", str(out)]) == 0
    cfg = load_config(out)  # valid TOML and a valid config
    assert sorted(cfg.task.sources) == ["bank_csv", "bank_jsonl"]
    assert sorted(Path(s.path).name for s in cfg.task.sources.values()) == ["bank.csv", "bank.jsonl"]
    assert main(["data", "check", str(out)]) == 0


def test_init_given_one_silos_own_folder_reads_it_as_one_silo(tmp_path, capsys):
    caps = lines_folder(tmp_path / "caps", names=("train", "val"))
    out = tmp_path / "c.toml"
    assert main(["init", str(caps), "--task", "translation", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "one silo" in printed and "caps" in printed
    raw = tomllib.loads(out.read_text())  # valid TOML
    assert list(raw["task"]["sources"]) == ["caps"]
    assert raw["task"]["sources"]["caps"]["files"] == {"train": "train", "dev": "val"}
    load_config(out)


def test_init_writes_nothing_when_the_config_it_would_write_is_invalid(tmp_path, capsys, monkeypatch):
    """Validated before it is written: a config that does not load (here: a renderer that breaks
    TOML) leaves no file behind, not even a partial one."""
    from fedsilo.runs import init as init_module

    data = tmp_path / "data"
    write_csv(data / "bank.csv", qa_rows("bank"))
    real = init_module.render
    monkeypatch.setattr(init_module, "render", lambda *a: real(*a) + "\n[task]\nname = 'x'\n")
    out = tmp_path / "c.toml"
    assert main(["init", str(data), "--task", "matching", "--out", str(out)]) == 2
    assert "not valid TOML" in one_error_line(capsys.readouterr().err)
    assert not out.exists() and not list(tmp_path.glob("c.toml*"))


# ---- OD29: an out-of-range column index --------------------------------------------------------------

def test_an_out_of_range_column_index_names_the_silo_file_index_and_the_files_columns(tmp_path):
    path = write_csv(tmp_path / "pairs.csv", [("Guten Tag", "Good day")] * 10, header=None)
    task = validate({"task": {"name": "translation", "tokenizer_domain": "legal", "sources": {"legal": {
        "path": str(path), "header": False, "fields": {"source": 0, "target": 5},
        "split": {"dev": 0.2, "test": 0.2}}}}}).task
    with pytest.raises(DataError) as err:
        load_rows("legal", task.sources["legal"])
    message = str(err.value)
    assert "silo legal" in message and "pairs.csv" in message and "fields.target = 5" in message
    assert "the file has 2 comma-separated column(s)" in message


# ---- item 4: gzip-compressed files ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csv", "jsonl", "lines"])
def test_gzip_files_read_as_their_plain_text_and_are_fingerprinted_as_stored(tmp_path, fmt):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    if fmt == "lines":
        lines_folder(plain, names=("train", "dev", "test"))
        lines_folder(packed, names=("train", "dev", "test"), gz=("train", "dev", "test"))
        files = {"train": "train", "dev": "dev", "test": "test"}
        extra = {"format": "lines", "fields": {"source": "de", "target": "en"}}
    else:
        for folder, suffix in ((plain, ""), (packed, ".gz")):
            folder.mkdir()
            for s in ("train", "dev", "test"):
                rows = [(f"satz {s} {i}", f"sentence {s} {i}") for i in range(5)]
                text = ("source,target\n" + "".join(f"{a},{b}\n" for a, b in rows) if fmt == "csv" else
                        "".join(json.dumps({"source": a, "target": b}) + "\n" for a, b in rows)).encode()
                (folder / f"{s}.{fmt}{suffix}").write_bytes(gzip.compress(text) if suffix else text)
        files, extra = None, {}
    loaded = {}
    for folder, suffix in ((plain, ""), (packed, ".gz")):
        given = files or {s: f"{s}.{fmt}{suffix}" for s in ("train", "dev", "test")}
        source = validate({"task": {"name": "translation", "tokenizer_domain": "legal", "sources": {"legal": {
            "path": str(folder), "files": given, **extra}}}}).task.sources["legal"]
        loaded[suffix] = load_rows("legal", source)
    rows = {k: {s: [r.values for r in v.splits[s]] for s in v.splits} for k, v in loaded.items()}
    assert rows[".gz"] == rows[""] and len(rows[""]["train"]) in (5, 12)
    assert all(str(f).endswith(".gz") for f in loaded[".gz"].files)
    stored = fingerprints(loaded[".gz"].files)
    assert all(fp["bytes"] == Path(f).stat().st_size for f, fp in stored.items())


def test_a_gz_file_that_is_not_gzip_is_a_data_error_naming_it(tmp_path):
    (tmp_path / "train.csv.gz").write_text("source,target\na,b\n")
    source = validate({"task": {"name": "translation", "tokenizer_domain": "legal", "sources": {"legal": {
        "path": str(tmp_path / "train.csv.gz"), "split": {"dev": 0.2, "test": 0.2}}}}}).task.sources["legal"]
    with pytest.raises(DataError, match=r"train\.csv\.gz.*not gzip"):
        load_rows("legal", source)


# ---- item 1 and the held-out case: a test file of another name ------------------------------------------

@pytest.mark.parametrize("gz", [(), ("test_2019",), ("train", "val", "test_2019")], ids=["plain", "gz-test", "gz-all"])
def test_init_takes_a_differently_named_test_pair_as_the_test_split_and_data_check_passes(tmp_path, capsys, gz):
    data = tmp_path / "data"
    lines_folder(data / "held", names=("train", "val", "test_2019"), n=30, gz=gz)
    out = tmp_path / "c.toml"
    assert main(["init", str(data), "--task", "translation", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "DECIDE for held: " in printed and "test_2019" in printed and "test split" in printed
    assert "not used" not in printed
    source = tomllib.loads(out.read_text())["task"]["sources"]["held"]
    assert source["files"] == {"train": "train", "dev": "val", "test": "test_2019"} and "split" not in source
    assert main(["data", "check", str(out), "--no-lengths", "--set", 'task.tokenizer_domain="held"']) == 0
    assert "silo held (lines): 30 train, 30 dev, 30 test pairs" in capsys.readouterr().out


def test_init_names_every_file_it_does_not_use_and_why(tmp_path, capsys):
    data = tmp_path / "data"
    folder = lines_folder(data / "held", names=("train", "val", "test_2019"))
    (folder / "README.txt").write_text("where the corpus comes from\n")
    (folder / "train.fr").write_text("une phrase\n")
    (data / "notes.md").write_text("my notes\n")
    out = tmp_path / "c.toml"
    assert main(["init", str(data), "--task", "translation", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("held/README.txt (not a data file", "held/train.fr (its suffix .fr is no role's",
                 "notes.md (not a silo"):
        assert f"not used: {name}" in printed, name
    text = out.read_text()
    assert "README.txt" in text and "train.fr" in text  # said in the config too, under the silo
