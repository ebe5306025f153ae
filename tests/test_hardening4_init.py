"""`fedsilo init`, the own-data readers and docs/your-data.md, fourth hardening round (issue 50): a
CSV header holding a bare carriage return, a folder of chat split files, non-ASCII file names, JSON
arrays (Alpaca's `alpaca_data.json`, also put in a .jsonl) and chat rows mixed with Alpaca rows, the
translation recipe (a generic engine first) from init's config and the docs, and `engine.threads`
on a busy machine. Every file is written here; only the news text the built-in instruct tokenizer is
fitted on is copied from ../shared/data (the data-check tests skip without it).
"""
import json
import re
import tomllib
from pathlib import Path

import pytest

from fedsilo.cli import main
from fedsilo.config import load_config
from fedsilo.errors import DataError
from fedsilo.sources.load import load_rows
from fedsilo.tasks.instruct.source import InstructSource

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
NEWS = "nmt/wmt_news/opennmt_py_wmt_sample"
TINY = ["task.vocab_size=400", "task.max_length=64"]


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def news_root(tmp_path_factory):
    """A data cache of its own, filled from ../shared/data (the news text alone is copied)."""
    if not (SHARED / NEWS / "src-train.txt").is_file():
        pytest.skip("../shared/data holds no news text (the built-in tokenizer is fitted on it)")
    root = tmp_path_factory.mktemp("init4-data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(root))
        mp.setenv("FEDSILO_DATA_MIRROR", str(SHARED))
        yield root


def alpaca_rows(n: int, start: int = 0) -> list[dict]:
    return [{"instruction": f"Task {i}: name colour {i}", "input": "", "output": f"colour {i} is blue"}
            for i in range(start, start + n)]


def chat_row(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"hello {i}, how is device {i}?"},
                         {"role": "assistant", "content": f"device {i} is fine"}]}


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def init(data: Path, out: Path, task: str = "instruct") -> int:
    return main(["init", str(data), "--task", task, "--out", str(out)])


def source_of(config: Path, silo: str):
    return load_config(config).task.sources[silo]


# ---- item 1: a bare carriage return in a CSV header ------------------------------------------------

def test_init_reads_a_csv_header_with_a_bare_carriage_return_as_a_run_does(tmp_path, capsys):
    """Before: `_csv.Error: new-line character seen in unquoted field` as a traceback. A CR ends a
    CSV line for the run's reader: init reads the header the same way, and says so when the CR sits
    inside the first line."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "stray.csv").write_bytes(b"instruction,resp\ronse\n" + b"".join(
        f"do {i},done {i}\n".encode() for i in range(10)))
    (data / "mac.csv").write_bytes(b"instruction,response\r" + b"".join(
        f"do {i},done {i}\r".encode() for i in range(10)))
    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    out = capsys.readouterr().out
    assert re.search(r"DECIDE for stray: stray\.csv's first line holds a carriage return \(\\r\) before its end: "
                     r"the header is read up to it", out)
    assert "DECIDE for mac" not in out  # old Mac line ends: a CR at every line's end, read as a run reads it
    text = config.read_text()
    assert "columns: instruction, resp)" in text  # what the run reads; data check names line 2 ("onse")
    assert "fields" not in tomllib.loads(text)["task"]["sources"]["mac"]

def test_init_on_a_csv_with_only_carriage_returns_reads_every_row(tmp_path, capsys):
    """The classic Mac line ends (CR alone): init maps the header, and the rows read are all of them."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "mac.csv").write_bytes(b"instruction,response\r" + b"".join(
        f"do {i},done {i}\r".encode() for i in range(10)))
    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    capsys.readouterr()
    loaded = load_rows("mac", source_of(config, "mac"))
    assert sum(len(rows) for rows in loaded.splits.values()) == 10 and not loaded.problems


# ---- item 2: a folder of chat split files ----------------------------------------------------------

def write_chat_splits(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split, start, n in (("train", 0, 12), ("dev", 100, 4), ("test", 200, 4)):
        write_jsonl(folder / f"{split}.jsonl", [chat_row(i) for i in range(start, start + n)])
    return folder


def test_init_on_a_folder_of_chat_split_files_writes_a_config_that_reads_them(tmp_path, capsys):
    """Before: KeyError 'split' (a traceback): with every split given no split line is written, and
    the chat comment rewrote that line's comment."""
    ward = write_chat_splits(tmp_path / "ward")
    config = tmp_path / "ward.toml"
    assert init(ward, config) == 0
    capsys.readouterr()
    source = source_of(config, "ward")
    assert source.chat and dict(source.files) == {"train": "train.jsonl", "dev": "dev.jsonl", "test": "test.jsonl"}
    assert source.split is None
    loaded = load_rows("ward", source)
    assert {s: len(r) for s, r in loaded.splits.items()} == {"train": 12, "dev": 4, "test": 4}
    assert not loaded.problems


def test_data_check_passes_on_inits_config_for_chat_split_files(tmp_path, capsys, news_root):
    ward = write_chat_splits(tmp_path / "ward")
    config = tmp_path / "ward.toml"
    assert init(ward, config) == 0
    capsys.readouterr()
    assert main(["data", "check", str(config), *sets(TINY)]) == 0
    out = capsys.readouterr().out
    assert "silo ward (jsonl, chat): 12 train, 4 dev, 4 test records" in out and "ready to run" in out


# ---- item 3: non-ASCII file names ------------------------------------------------------------------

def test_init_on_non_ascii_file_names_writes_valid_toml_with_ascii_silo_names(tmp_path, capsys):
    """Before: "made a config that is not valid TOML ... please report it" (a bare TOML key is ASCII
    only, and so is a silo name). Now the silo is named in ASCII and keeps the file's name as its
    display name, which a comment explains."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "café.jsonl", alpaca_rows(10))
    (data / "Zürich Klinik.csv").write_text("instruction,output\n" + "".join(f"do {i},done {i}\n" for i in range(10)))
    (data / "病院.csv").write_text("instruction,output\n" + "".join(f"do {i},done {i}\n" for i in range(10)))
    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    out = capsys.readouterr().out
    assert "written:" in out
    cfg = load_config(config)
    assert cfg.task.silos == ["Zurich_Klinik", "cafe", "silo"]
    assert {n: s.display for n, s in cfg.task.sources.items()} == {
        "cafe": "café", "Zurich_Klinik": "Zürich Klinik", "silo": "病院"}
    assert 'display = "café"  # the file\'s name; the silo\'s name is cafe' in config.read_text()
    assert len(load_rows("cafe", cfg.task.sources["cafe"]).splits["train"]) > 0


def test_init_names_a_file_whose_name_is_not_utf8_and_uses_the_other_silos(tmp_path, capsys):
    """Before: "made a config that is not valid TOML ... please report it" (TOML is UTF-8 text and cannot
    hold the name's undecodable byte). Now that file is named unused with why; the others make the config."""
    data = tmp_path / "data"
    data.mkdir()
    rows = "instruction,output\n" + "".join(f"do {i},done {i}\n" for i in range(10))
    (data / "ok.csv").write_text(rows)
    with open(bytes(data) + b"/h\xe9pital.csv", "w") as fh:  # Latin-1's é: no UTF-8 text
        fh.write(rows)
    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    out = capsys.readouterr().out
    assert "not used: h" in out and "a name that is not UTF-8 text, which a config cannot hold: rename it" in out
    assert load_config(config).task.silos == ["ok"]


# ---- item 4: JSON arrays, and chat rows among Alpaca rows ------------------------------------------

def test_a_jsonl_holding_one_json_array_is_named_as_one_and_init_reads_it_as_json(tmp_path, capsys):
    """Before: "0 distinct instruction value(s) ... cannot be split" (every line of the array a
    malformed row, none read). The reader names the layout; init writes format = "json" for it."""
    data = tmp_path / "data"
    data.mkdir()
    path = data / "helpdesk.jsonl"
    path.write_text(json.dumps(alpaca_rows(12), indent=4))
    source = InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1}, fields={"response": "output"})
    with pytest.raises(DataError, match=r"silo helpdesk: .*helpdesk\.jsonl: one JSON array of 12 items, not JSON "
                                        r"lines \(one object per line\): name the file \.json"):
        load_rows("helpdesk", source)
    path.with_name("one-line.jsonl").write_text(json.dumps(alpaca_rows(5)))
    one_line = InstructSource(path=str(path.with_name("one-line.jsonl")), split={"dev": 0.2, "test": 0.2})
    with pytest.raises(DataError, match=r"one JSON array of 5 items, not JSON lines"):
        load_rows("one", one_line)
    (data / "one-line.jsonl").unlink()

    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    capsys.readouterr()
    assert 'format = "json"  # helpdesk.jsonl holds one JSON array of rows, not JSON lines' in config.read_text()
    loaded = load_rows("helpdesk", source_of(config, "helpdesk"))
    assert sum(len(r) for r in loaded.splits.values()) == 12 and not loaded.problems


def test_alpacas_json_array_file_is_read_as_rows_and_bad_items_are_named_by_index(tmp_path, capsys):
    """Before: init named alpaca_data.json "not a silo" (no silo at all: an error) and a source
    could not tell its format. Now a .json file holding an array of objects is a source's rows, each
    item named by its index and the line it starts on."""
    data = tmp_path / "data"
    data.mkdir()
    items = alpaca_rows(20)
    items[3] = ["not", "an", "object"]
    del items[5]["output"]
    (data / "alpaca_data.json").write_text(json.dumps(items, indent=4))
    (data / "dataset_info.json").write_text(json.dumps({"name": "not rows"}))
    config = tmp_path / "mine.toml"
    assert init(data, config) == 0
    out = capsys.readouterr().out
    assert "1 silo(s): alpaca_data" in out
    assert re.search(r"not used: dataset_info\.json \(not a silo: .*\.json file holds no JSON array", out)
    text = config.read_text()
    assert 'format = "json"' in text and 'fields = {response = "output"}' in text
    loaded = load_rows("alpaca_data", source_of(config, "alpaca_data"))
    assert sum(len(r) for r in loaded.splits.values()) == 18
    assert [(Path(p.where).name, p.reason) for p in loaded.problems] == [
        ("alpaca_data.json[3]:17", "item [3] is a JSON list; expected an object (a row)"),
        ("alpaca_data.json[5]:27", "item [5]: no key 'output' for response")]

    compact = tmp_path / "compact.json"  # json.dump without indent: every item on line 1
    compact.write_text(json.dumps(alpaca_rows(10)))
    rows = load_rows("c", InstructSource(path=str(compact), split={"dev": 0.1, "test": 0.1},
                                         fields={"response": "output"})).splits
    wheres = [r.where for split in rows.values() for r in split]
    assert len(set(wheres)) == 10  # a row's place is its id: distinct on one line too


@pytest.mark.parametrize("text, why", [
    ("[\n  {\"instruction\": \"a\", \"output\": \"b\"},\n  {\"instruction\": \"c\"\n]",
     r"bad\.json:4: not JSON \(Expecting ',' delimiter at column 1\); a \.json source is one JSON array of row "
     r"objects"),
    ("{\"instruction\": \"a\", \"output\": \"b\"}", r"bad\.json: a JSON object, not an array of row objects"),
])
def test_a_json_file_that_is_no_array_of_rows_is_one_line_naming_it(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DataError, match=why):
        load_rows("bad", InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1}, fields={"response": "output"}))


def test_chat_rows_among_alpaca_rows_are_named_with_the_first_row_of_each_kind(tmp_path):
    """Before: each chat row was "no key 'instruction' for instruction", and a file of chat rows read
    as Alpaca rows "0 distinct instruction value(s) ... cannot be split"."""
    path = tmp_path / "mixed.jsonl"
    rows = alpaca_rows(12)
    for i in (3, 6, 8, 9, 10, 11):
        rows[i] = chat_row(i)
    write_jsonl(path, rows)
    loaded = load_rows("mixed", InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1},
                                               fields={"response": "output"}))
    assert [(p.where.rpartition(":")[2], p.reason) for p in loaded.problems] == [
        (line, f"a chat row among Alpaca rows (the first Alpaca row: line 1; the first chat row: line 4): a "
               "silo's rows are of one kind; put the chat rows in a file of their own, a silo with chat = true")
        for line in ("4", "7", "9", "10", "11", "12")]
    chat = InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1}, chat=True)
    assert loaded.problems and all("among chat rows (the first chat row: line 4; the first Alpaca row: line 1)"
                                   in p.reason for p in load_rows("mixed", chat).problems)

    write_jsonl(path, [chat_row(i) for i in range(10)])
    with pytest.raises(DataError, match=r"silo mixed: no row read from .*mixed\.jsonl: 10 malformed row\(s\): "
                                        r".*mixed\.jsonl:1: a chat row; this source reads Alpaca rows: set "
                                        r"chat = true to read chat rows"):
        load_rows("mixed", InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1}))


# ---- item 5: the translation recipe from init's config -----------------------------------------------

def write_translation_silo(root: Path) -> Path:
    (root / "legal").mkdir(parents=True)
    (root / "legal" / "corpus.de").write_text("".join(f"Satz {i} ist hier.\n" for i in range(20)))
    (root / "legal" / "corpus.en").write_text("".join(f"Sentence {i} is here.\n" for i in range(20)))
    return root


def test_inits_translation_config_leads_to_the_generic_engine_recipe(tmp_path, capsys):
    """Before: init's translation config trained a Transformer from scratch and named neither the
    generic engine nor Dynamic Pulling. Now its [model] is experiments/nmt/generic.toml's (so that
    engine's weights fit), and uncommenting init_from and the [exchange] lines gives a config that loads."""
    config = tmp_path / "nmt.toml"
    assert init(write_translation_silo(tmp_path / "data"), config, "translation") == 0
    capsys.readouterr()
    text = config.read_text()
    assert "experiments/nmt/generic.toml" in text and 'docs/your-data.md, section "Translation silos"' in text
    generic = tomllib.loads((ROOT / "experiments" / "nmt" / "generic.toml").read_text())["model"]
    assert tomllib.loads(text)["model"] == generic  # the same sizes: its best.pt loads into this model
    recipe = re.sub(r"^# (init_from = |\[exchange\]|upload = |overwrite = )", r"\1", text, flags=re.M)
    assert recipe.count("\n") == text.count("\n") and recipe != text
    config.write_text(recipe)
    cfg = load_config(config)
    assert cfg.model.init_from == "runs/generic"
    assert (cfg.exchange.upload, cfg.exchange.overwrite) == ("dp_l", "uploaded")


# ---- items 5 and 6: docs/your-data.md -----------------------------------------------------------------

def test_your_data_walks_the_translation_recipe_and_names_engine_threads_for_busy_machines():
    doc = (ROOT / "docs" / "your-data.md").read_text()
    section = doc[doc.index("## 7. Translation silos"):doc.index("## Reference")]
    for step in ("fedsilo data translation", "experiments/nmt/generic.toml", "init_from = \"runs/generic\"",
                 "upload = \"dp_l\"", "overwrite = \"uploaded\"", "paradigm = \"finetune\"", "docs/translation.md"):
        assert step in section.replace("](translation.md)", "docs/translation.md"), step
    for named in re.findall(r"experiments/nmt/[\w.-]+\.toml", section):
        assert (ROOT / named).is_file(), named
    run = doc[doc.index("## 3. A federated run"):doc.index("## 4.")]
    assert "engine.threads = 1" in run
