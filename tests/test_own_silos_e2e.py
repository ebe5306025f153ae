"""Own silos end to end, as a new user goes (issue 25): a folder with one sub-folder or file per
silo → `fedsilo init` → `fedsilo data check` → `fedsilo run` → `fedsilo report`, for three small
silos in each format (CSV, TSV and JSONL for answer selection; line-aligned files, CSV and JSONL for
translation); and `fedsilo deploy` with own silos, each SuperNode reading its files where they are.
Every file is written here; nothing of ../shared/data is read.
"""
import csv
import hashlib
import json
import os
import random
from pathlib import Path

from fedsilo.cli import main

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

TOPICS = ["loan", "card", "account", "fee", "deposit", "transfer", "branch", "pension", "saving", "tax"]

# A tiny, fast model and run for every test (the init config's defaults are the real ones).
TINY_QA = ["model.kind=\"encoder\"", "model.name=\"tiny-bert\"", "model.d_model=32", "model.d_ff=64",
           "model.num_layers=1", "model.num_heads=4", "task.max_length=48", "task.eval_batch_size=16",
           "client.batch_size=8", "client.lr=1e-3", "federation.rounds=1"]
TINY_NMT = ["task.vocab_size=120", "task.max_source_length=24", "task.max_target_length=24", "model.d_model=16",
            "model.d_ff=32", "model.num_layers=1", "model.num_decoder_layers=1", "model.num_heads=2",
            "client.batch_size=8", "federation.rounds=1", "task.tokenizer_domain=\"north\""]


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def qa_rows(seed: int, n: int) -> list[tuple[str, str, int]]:
    """(question, answer, label): per question one right answer and two wrong ones."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        t = TOPICS[i % len(TOPICS)]
        q = f"how do i change the {t} limit on plan {seed}-{i}?"
        rows.append((q, f"to change the {t} limit of plan {seed}-{i}, open settings and pick {t}.", 1))
        for other in rnd.sample([x for x in TOPICS if x != t], 2):
            rows.append((q, f"our {other} page lists every {other} offer.", 0))
    return rows


def write_qa_folder(root: Path) -> Path:
    """north/: train, dev, test CSV with its own column names; south.jsonl: candidate lists;
    east.tsv: question and answer only (no labels: negatives are mined)."""
    north = root / "north"
    north.mkdir(parents=True)
    rows = qa_rows(1, 30)
    for split, part in (("train", rows[:54]), ("dev", rows[54:72]), ("test", rows[72:])):
        with open(north / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["query", "answer", "relevant"])
            w.writerows(part)
    with open(root / "south.jsonl", "w") as f:
        grouped: dict[str, list] = {}
        for q, a, y in qa_rows(2, 30):
            grouped.setdefault(q, []).append((a, y))
        for q, judged in grouped.items():
            f.write(json.dumps({"question": q, "candidates": [a for a, _ in judged],
                                "labels": [y for _, y in judged]}) + "\n")
    with open(root / "east.tsv", "w") as f:
        f.write("question\tanswer\n")
        for q, a, y in qa_rows(3, 30):
            if y:
                f.write(f"{q}\t{a}\n")
    return root


def test_answer_selection_from_a_folder_init_check_run_report(tmp_path, capsys):
    data = write_qa_folder(tmp_path / "institutions")
    config = tmp_path / "qa.toml"
    assert main(["init", str(data), "--task", "matching", "--out", str(config)]) == 0
    out = capsys.readouterr().out
    assert "DECIDE" not in out and "east, north, south" in out
    text = config.read_text()
    assert 'fields = {question = "query", candidate = "answer", label = "relevant"}' in text  # north's own names
    assert 'files = {train = "train.csv", dev = "dev.csv", test = "test.csv"}' in text
    assert 'path = "institutions/south.jsonl"' in text and 'fields = {candidate = "candidates", label = "labels"}' in text
    assert "no label column found" in text  # east: every answer correct, negatives mined

    assert main(["data", "check", str(config), *sets(TINY_QA), "--json", str(tmp_path / "check.json")]) == 0
    out = capsys.readouterr().out
    assert "silo north (csv): 18 train, 6 dev, 6 test questions" in out
    assert "silo east (tsv): 24 train, 3 dev, 3 test questions" in out
    assert "ready to run" in out
    checks = {c["name"]: c for c in json.loads((tmp_path / "check.json").read_text())}
    assert checks["south"]["counts"] == {"train": 24, "dev": 3, "test": 3} and not checks["south"]["blocking"]
    assert checks["east"]["lengths"][0]["n"] == 30 * 6  # each question: its answer and 5 mined ones

    run = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run), "--no-progress", *sets(TINY_QA)]) == 0
    capsys.readouterr()
    results = json.loads((run / "results.json").read_text())
    assert [r["client"] for r in results["test"]["rows"]] == ["east", "north", "south"]
    assert [r["stats"]["questions"] for r in results["test"]["rows"]] == [3, 6, 3]
    recorded = json.loads((run / "data.json").read_text())["started"]
    assert set(recorded) == {"east", "north", "south"} and len(recorded["north"]) == 3

    (run / "report.md").unlink()
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    assert all(silo in report for silo in ("east", "north", "south"))


def nmt_pairs(seed: int, n: int) -> list[tuple[str, str]]:
    rnd = random.Random(seed)
    de = ["der", "vertrag", "gilt", "ab", "heute", "und", "endet", "morgen", "das", "gericht"]
    en = ["the", "contract", "applies", "from", "today", "and", "ends", "tomorrow", "the", "court"]
    out = []
    for i in range(n):
        idx = [rnd.randrange(len(de)) for _ in range(5)]
        out.append((" ".join(de[j] for j in idx) + f" {seed}{i}", " ".join(en[j] for j in idx) + f" {seed}{i}"))
    return out


def test_translation_from_a_folder_of_aligned_csv_and_jsonl_silos(tmp_path, capsys):
    data = tmp_path / "firms"
    (data / "north").mkdir(parents=True)
    pairs = nmt_pairs(1, 40)
    (data / "north" / "corpus.de").write_text("".join(d + "\n" for d, _ in pairs))
    (data / "north" / "corpus.en").write_text("".join(e + "\n" for _, e in pairs))
    with open(data / "south.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["german", "english"])
        w.writerows(nmt_pairs(2, 40))
    with open(data / "west.jsonl", "w") as f:
        for d, e in nmt_pairs(3, 40):
            f.write(json.dumps({"src": d, "tgt": e}) + "\n")
    config = tmp_path / "nmt.toml"
    assert main(["init", str(data), "--task", "translation", "--out", str(config)]) == 0
    capsys.readouterr()
    text = config.read_text()
    assert 'format = "lines"' in text and 'fields = {source = "de", target = "en"}' in text
    assert 'fields = {source = "german", target = "english"}' in text and 'fields = {source = "src", target = "tgt"}' in text
    assert 'tokenizer_domain = "news"  # DECIDE' in text  # public text or one of the silos: the user's call

    assert main(["data", "check", str(config), *sets(TINY_NMT)]) == 0
    out = capsys.readouterr().out
    assert "silo north (lines): 32 train, 4 dev, 4 test pairs" in out and "ready to run" in out
    run = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run), "--no-progress", *sets(TINY_NMT), "--set", "task.matrix=[]"]) == 0
    capsys.readouterr()
    rows = json.loads((run / "results.json").read_text())["test"]["rows"]
    assert [r["client"] for r in rows] == ["north", "south", "west"]
    assert main(["report", str(run)]) == 0


def test_deploy_with_own_silos_reads_each_silos_files_where_they_are(tmp_path, capsys):
    """Real SuperLink and SuperNodes on 127.0.0.1: each SuperNode is pointed at its silo's own file
    (silo-path), nothing is copied, and each silo fingerprints only its own file on its own disk.
    Flower's own ClientApp processes (`--cold-clientapps`, a `flwr-clientapp` per message): the other
    deployment tests run fedsilo's warm ones."""
    data = write_qa_folder(tmp_path / "institutions")
    config = tmp_path / "qa.toml"
    assert main(["init", str(data), "--task", "matching", "--out", str(config)]) == 0
    argv = ["deploy", str(config), "--out", str(tmp_path / "run"), "--workdir", str(tmp_path / "work"),
            "--no-progress", "--cold-clientapps", *sets(TINY_QA), "--set", 'task.silos=["east", "south"]']
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["test"]["rows"]
    assert [r["client"] for r in rows] == ["east", "south"]
    log = (tmp_path / "work" / "processes" / "supernode-east.log").read_text()
    assert "Start `flwr-clientapp` process" in log  # Flower's own ClientApp entry ran each message
    for silo, own in (("east", data / "east.tsv"), ("south", data / "south.jsonl")):
        records = list((tmp_path / "work" / "processes" / "state" / silo).glob("*/data.json"))
        assert len(records) == 1, records
        assert json.loads(records[0].read_text())["started"] == {
            silo: {str(own): {"bytes": own.stat().st_size, "sha256": hashlib.sha256(own.read_bytes()).hexdigest()}}}
    assert not any(p.name == "silo-data" for p in (tmp_path / "work").rglob("*"))
    # every own file is still only where it was
    assert sorted(p.name for p in data.rglob("*") if p.is_file()) == sorted(
        ["dev.csv", "east.tsv", "south.jsonl", "test.csv", "train.csv"])


def test_init_marks_what_it_cannot_tell_and_refuses_a_config_it_would_overwrite(tmp_path, capsys):
    """Columns it cannot map, a folder without data files and a text-to-SQL silo without a schema
    become DECIDE lines (and placeholders a run refuses by name), never a guess."""
    data = tmp_path / "silos"
    (data / "notes").mkdir(parents=True)
    (data / "notes" / "readme.txt").write_text("nothing to read here\n")
    with open(data / "shop.csv", "w", newline="") as f:
        csv.writer(f).writerows([["frage", "abfrage"], *([f"how many shoes of size {i}?",
                                                          f"select count(*) from shoes where id = {i}"]
                                                         for i in range(10))])
    config = tmp_path / "sql.toml"
    assert main(["init", str(data), "--task", "text2sql", "--out", str(config)]) == 0
    out = capsys.readouterr().out
    assert "DECIDE for shop: fields.question: which column of shop.csv holds the question (columns: frage, abfrage)" in out
    assert "DECIDE for shop: no schema found" in out and "DECIDE for notes: no .csv, .tsv or .jsonl file" in out
    assert "is not valid until the DECIDE lines are settled" in out  # notes' format is a placeholder
    text = config.read_text()
    assert '# DECIDE: fields.sql: which column of shop.csv holds the sql' in text
    assert 'fields = {question = "??", sql = "??"}' in text and 'schema_file = "??"' in text
    # settled by hand: the notes silo dropped, the columns named, a schema given
    (data / "schema.sql").write_text("CREATE TABLE shoes (id int);")
    notes = text[text.index("[task.sources.notes]"):text.index("[task.sources.shop]")]
    fixed = (text.replace(notes, "")
             .replace('fields = {question = "??", sql = "??"}', 'fields = {question = "frage", sql = "abfrage"}')
             .replace('schema_file = "??"', f'schema_file = "{data / "schema.sql"}"')
             .replace('silos = ["notes", "shop"]', 'silos = ["shop"]'))
    config.write_text(fixed)
    assert main(["data", "check", str(config), "--no-lengths"]) == 0
    assert "silo shop (csv): 8 train, 1 dev, 1 test examples" in capsys.readouterr().out
    # an existing config is not overwritten without --force
    assert main(["init", str(data), "--task", "text2sql", "--out", str(config)]) == 2
    assert f"{config} exists" in capsys.readouterr().err and config.read_text() == fixed
