"""Own silos (issue 25, "a silo is data, not code"): each format read to the same rows, every kind of
malformed row named by file:line, the seeded split grouped by a key, settings refused with a reason,
`accept` (error or skip), the check's duplicates and overlap, fingerprints on resume, and a run on
two own silos end to end. Every file is written here (tmp_path): no benchmark data is needed."""
import csv
import hashlib
import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from fedsilo.config import ConfigError, validate
from fedsilo.errors import DataError
from fedsilo.rundir.datacheck import check_at_start, warnings_of
from fedsilo.runs.datareport import inspect_silos, report
from fedsilo.sources.check import Item, inspect_items
from fedsilo.sources.fingerprint import RECORD, fingerprints, record
from fedsilo.sources.load import SHOWN_PROBLEMS, accept, load_rows, source_files
from fedsilo.sources.read import read_rows
from fedsilo.tasks.translation.data import load_silo
from fedsilo.tasks.translation.plugin import PairSource

SPLIT = {"dev": 0.1, "test": 0.1}

CORPUS = [
    ("Guten Morgen", "Good morning"),
    ("Das Haus ist groß.", "The house is big."),
    ("Grüße aus Köln", "Greetings from Cologne"),
    ("Wie spät ist es?", "What time is it?"),
    ("Danke schön", "Thank you"),
]


def pair_source(path, **kw) -> PairSource:
    if "files" not in kw:
        kw.setdefault("split", SPLIT)
    return PairSource(path=str(path), **kw)


def read(path, **kw):
    return read_rows(pair_source(path, **kw), Path(path))


def pairs_of(rows) -> list[tuple[str, str]]:
    return [(r.values["source"], r.values["target"]) for r in rows]


def lines_of(rows) -> list[int]:
    return [int(r.where.rpartition(":")[2]) for r in rows]


def write_jsonl(path: Path, pairs, keys=("source", "target")) -> Path:
    path.write_text("".join(json.dumps(dict(zip(keys, p)), ensure_ascii=False) + "\n" for p in pairs),
                    encoding="utf-8")
    return path


def write_csv(path: Path, pairs, header=("source", "target"), delimiter=",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=delimiter)
        if header:
            w.writerow(header)
        w.writerows(pairs)
    return path


def write_lines(prefix: Path, pairs) -> Path:
    Path(f"{prefix}.de").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    Path(f"{prefix}.en").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return prefix


# ---- 1. every format reads the same corpus -------------------------------------------------

def test_jsonl_csv_tsv_and_lines_read_the_same_rows(tmp_path):
    read_back = {
        "jsonl": read(write_jsonl(tmp_path / "c.jsonl", CORPUS)),
        "csv": read(write_csv(tmp_path / "c.csv", CORPUS)),
        "tsv": read(write_csv(tmp_path / "c.tsv", CORPUS, delimiter="\t")),
        "lines": read(write_lines(tmp_path / "c", CORPUS), format="lines",
                      fields={"source": "de", "target": "en"}),
        "csv, no header": read(write_csv(tmp_path / "n.csv", [(t, s) for s, t in CORPUS], header=None),
                               header=False, fields={"source": 1, "target": 0}),
    }
    for fmt, (rows, problems) in read_back.items():
        assert problems == [], fmt
        assert pairs_of(rows) == CORPUS, fmt
    # each row is named by the line it is on: after the header for csv/tsv, from 1 otherwise
    assert lines_of(read_back["csv"][0]) == lines_of(read_back["tsv"][0]) == [2, 3, 4, 5, 6]
    assert lines_of(read_back["jsonl"][0]) == lines_of(read_back["csv, no header"][0]) == [1, 2, 3, 4, 5]
    assert {r.where.rpartition(":")[0] for r in read_back["lines"][0]} == {f"{tmp_path / 'c'}.de"}


def test_a_quoted_csv_field_holds_a_comma_and_a_newline_and_later_rows_keep_their_line(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('source,target\nHallo,Hello\n"Ja, und\nnein","Yes, and\nno"\nTschüss,Bye\n', encoding="utf-8")
    rows, problems = read(path)
    assert problems == []
    assert pairs_of(rows) == [("Hallo", "Hello"), ("Ja, und\nnein", "Yes, and\nno"), ("Tschüss", "Bye")]
    assert lines_of(rows) == [2, 3, 6]  # the quoted row spans lines 3-5
    # the same pairs written by csv.writer and as JSONL read back equal
    quoted = [("Ja, und\nnein", "Yes, and\nno"), ('Er sagte "nein"', 'He said "no"')]
    assert pairs_of(read(write_csv(tmp_path / "w.csv", quoted))[0]) == quoted
    assert pairs_of(read(write_jsonl(tmp_path / "w.jsonl", quoted))[0]) == quoted


def test_fields_map_roles_to_other_columns_and_a_role_left_out_reads_its_own_name(tmp_path):
    # columns in another order, one extra, the source under another name, the target under its own
    path = write_csv(tmp_path / "m.csv", [("7", t, s) for s, t in CORPUS], header=("id", "target", "german"))
    rows, problems = read(path, fields={"source": "german"})
    assert problems == [] and pairs_of(rows) == CORPUS
    path = write_jsonl(tmp_path / "m.jsonl", [(s, t, "x") for s, t in CORPUS], keys=("de", "en", "note"))
    rows, problems = read(path, fields={"source": "de", "target": "en"})
    assert problems == [] and pairs_of(rows) == CORPUS
    # lines: an unmapped role's suffix is its own name
    Path(f"{tmp_path / 'p'}.de").write_text("a\nb\n")
    Path(f"{tmp_path / 'p'}.target").write_text("A\nB\n")
    rows, _ = read(tmp_path / "p", format="lines", fields={"source": "de", "target": "target"})
    assert pairs_of(rows) == [("a", "A"), ("b", "B")]
    assert source_files(pair_source(tmp_path / "p", format="lines", fields={"source": "de", "target": "target"})) \
        == [Path(f"{tmp_path / 'p'}.de"), Path(f"{tmp_path / 'p'}.target")]


def test_values_are_stripped_and_numbers_read_as_text(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"source": "  eins  ", "target": 1}\n\n{"source": "zwei", "target": 2.5}\n')
    rows, problems = read(path)
    assert problems == [] and pairs_of(rows) == [("eins", "1"), ("zwei", "2.5")]
    assert lines_of(rows) == [1, 3]  # a blank line is no row, and moves no line number


# ---- 2. malformed rows: a Problem per row, named by file:line ------------------------------

GOOD_JSON = '{"source": "gut", "target": "good"}\n'
GOOD_CSV = "gut,good\n"

MALFORMED = [
    # (file name, bytes, settings, line of the bad row, reason)
    ("bad.jsonl", GOOD_JSON + '{"source": "x", "target": \n' + GOOD_JSON, {}, 2, r"^not JSON \("),
    ("list.jsonl", GOOD_JSON + '["x", "y"]\n' + GOOD_JSON, {}, 2, r"a JSON list; expected an object"),
    ("number.jsonl", GOOD_JSON + "42\n" + GOOD_JSON, {}, 2, r"a JSON int; expected an object"),
    ("missing.jsonl", GOOD_JSON + '{"source": "x"}\n' + GOOD_JSON, {}, 2, r"no key 'target' for target"),
    ("mapped.jsonl", '{"de": "a", "en": "b"}\n{"de": "x", "english": "y"}\n', {"fields": {"source": "de",
     "target": "en"}}, 2, r"no key 'en' for target"),
    ("empty.jsonl", GOOD_JSON + '{"source": "  ", "target": "y"}\n' + GOOD_JSON, {}, 2, r"empty source"),
    ("alist.jsonl", GOOD_JSON + '{"source": ["x"], "target": "y"}\n' + GOOD_JSON, {}, 2,
     r"key 'source' \(source\) is a list; expected one text"),
    ("object.jsonl", GOOD_JSON + '{"source": "x", "target": {"t": 1}}\n' + GOOD_JSON, {}, 2,
     r"key 'target' \(target\) is a dict; expected text"),
    ("many.csv", "source,target\n" + GOOD_CSV + "x,y,z\n" + GOOD_CSV, {}, 3,
     r"3 comma-separated fields; the header has 2 \(a comma inside a field needs the field in double quotes\)"),
    ("few.csv", "source,target\n" + GOOD_CSV + "x\n" + GOOD_CSV, {}, 3, r"1 comma-separated fields; the header has 2"),
    ("empty.csv", "source,target\n" + GOOD_CSV + "x,\n" + GOOD_CSV, {}, 3, r"empty target \(column 'target'\)"),
    ("few.tsv", "source\ttarget\ngut\tgood\nx y\ngut\tgood\n", {}, 3, r"1 tab-separated fields; the header has 2"),
    ("noheader.csv", GOOD_CSV + "x\n" + GOOD_CSV, {"header": False, "fields": {"source": 0, "target": 1}}, 2,
     r"1 comma-separated fields; expected at least 2"),
    ("latin1.csv", b"source,target\n" + GOOD_CSV.encode() + "Grüße,greetings\n".encode("latin-1")
     + GOOD_CSV.encode(), {}, 3, r"not utf-8 text \(byte 0xfc at column 3\); is the file in another encoding"),
    ("latin1.jsonl", GOOD_JSON.encode() + '{"source": "Grüße", "target": "g"}\n'.encode("latin-1")
     + GOOD_JSON.encode(), {}, 2, r"not utf-8 text \(byte 0xfc"),
    ("stray.csv", "source,target\n" + GOOD_CSV + '"x"y,z\n' + GOOD_CSV, {}, 3, r"malformed CSV \("),
]


@pytest.mark.parametrize("name, content, settings, line, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_row_is_a_problem_named_by_file_and_line_and_the_others_are_read(
        tmp_path, name, content, settings, line, reason):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    rows, problems = read(path, **settings)
    assert [p.where for p in problems] == [f"{path}:{line}"]
    assert re.search(reason, problems[0].reason), problems[0].reason
    assert str(problems[0]) == f"{path}:{line}: {problems[0].reason}"
    assert line not in lines_of(rows)
    assert len(rows) == (2 if name != "mapped.jsonl" else 1)  # the rows around it are read, none filled in


def test_an_unclosed_quote_is_named_at_the_row_it_opens_and_says_how_far_it_read(tmp_path):
    path = tmp_path / "open.csv"
    path.write_text('source,target\ngut,good\n"offen,open\nmehr,more\n')
    rows, problems = read(path)
    assert pairs_of(rows) == [("gut", "good")]
    assert [p.where for p in problems] == [f"{path}:3"]
    assert "lines 3-4 read as one row" in problems[0].reason


def test_several_problems_come_in_file_order(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"{bad\n" + GOOD_JSON.encode() + '{"source": "ü", "target": "u"}\n'.encode("latin-1")
                     + b'{"source": "x"}\n')
    _, problems = read(path)
    assert [p.where.rpartition(":")[2] for p in problems] == ["1", "3", "4"]


def test_lines_format_empty_line_names_the_row_and_the_file_holding_it(tmp_path):
    prefix = tmp_path / "corpus"
    Path(f"{prefix}.de").write_text("eins\n\ndrei\nvier\n")
    Path(f"{prefix}.en").write_text("one\ntwo\nthree\n\n")
    rows, problems = read(prefix, format="lines", fields={"source": "de", "target": "en"})
    assert pairs_of(rows) == [("eins", "one"), ("drei", "three")]
    assert [p.where for p in problems] == [f"{prefix}.de:2", f"{prefix}.de:4"]
    assert problems[0].reason == "empty source (line 2 of corpus.de)"
    assert problems[1].reason == "empty target (line 4 of corpus.en)"


def test_lines_format_undecodable_line_in_one_file_drops_that_row_only(tmp_path):
    prefix = tmp_path / "corpus"
    Path(f"{prefix}.de").write_text("eins\nzwei\ndrei\n")
    Path(f"{prefix}.en").write_bytes(b"one\ntw\xf6\nthree\n")
    rows, problems = read(prefix, format="lines", fields={"source": "de", "target": "en"})
    assert pairs_of(rows) == [("eins", "one"), ("drei", "three")]
    assert [p.where for p in problems] == [f"{prefix}.en:2"]


def test_a_missing_file_is_a_data_error_naming_it(tmp_path):
    with pytest.raises(DataError, match=rf"file not found: {tmp_path / 'nope.csv'}$"):
        read(tmp_path / "nope.csv")
    with pytest.raises(DataError, match=rf"file not found: {tmp_path / 'nope'}\.de"):
        read(tmp_path / "nope", format="lines", fields={"source": "de", "target": "en"})
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.csv").write_text("source,target\na,b\n")
    with pytest.raises(DataError, match=r"dir[/\\]dev\.csv"):
        load_rows("x", pair_source(tmp_path / "dir", files={"train": "train.csv", "dev": "dev.csv",
                                                            "test": "test.csv"}))


def test_a_header_without_the_mapped_column_lists_the_header(tmp_path):
    path = write_csv(tmp_path / "h.csv", CORPUS, header=("de", "en"))
    with pytest.raises(DataError, match=r"h\.csv: line 1: no column 'german' for source; the header has 'de', 'en'$"):
        read(path, fields={"source": "german", "target": "en"})
    with pytest.raises(DataError, match=r"no column 'target' for target \(set fields\.target to the column holding "
                                        r"the target\); the header has 'de', 'en'"):
        read(path, fields={"source": "de"})
    with pytest.raises(DataError, match=r"fields\.source = 0 is a column index, but the file has a header"):
        read(path, fields={"source": 0, "target": "en"})


def test_an_empty_csv_with_header_expected_is_a_data_error(tmp_path):
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(DataError, match=r"e\.csv: empty file"):
        read(tmp_path / "e.csv")


def test_an_undecodable_or_malformed_header_is_a_data_error_not_a_later_row_taken_for_it(tmp_path):
    path = tmp_path / "h.csv"
    path.write_bytes("quelle,übersetzung\n".encode("latin-1") + b"a,b\nc,d\n")
    with pytest.raises(DataError, match=rf"{path}:1: the header line is not utf-8 text"):
        read(path, fields={"source": "quelle", "target": "übersetzung"})
    path.write_bytes('"source"x,target\na,b\n'.encode())
    with pytest.raises(DataError, match=rf"{path}:1: the header line is malformed CSV"):
        read(path)


def test_aligned_files_of_different_lengths_are_a_data_error_naming_both(tmp_path):
    prefix = tmp_path / "corpus"
    Path(f"{prefix}.de").write_text("a\nb\nc\n")
    Path(f"{prefix}.en").write_text("A\nB\n")
    with pytest.raises(DataError, match=rf"{prefix}\.de has 3, {prefix}\.en has 2 lines"):
        read(prefix, format="lines", fields={"source": "de", "target": "en"})


def test_header_false_needs_column_indices(tmp_path):
    with pytest.raises(ValidationError, match=r"header = false: give every role its 0-based column index"):
        pair_source(tmp_path / "x.csv", header=False, fields={"source": "de", "target": 1})
    with pytest.raises(ValidationError, match=r"header = false applies to csv and tsv files, not jsonl"):
        pair_source(tmp_path / "x.jsonl", header=False)


def test_a_utf8_bom_is_skipped_and_latin1_reads_with_its_encoding(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + "source,target\r\nGrüße,Greetings\r\n".encode())
    assert read(bom) == read(bom, encoding="UTF8") and pairs_of(read(bom)[0]) == [("Grüße", "Greetings")]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + '{"source": "a", "target": "b"}\n'.encode())
    rows, problems = read(bom)
    assert problems == [] and pairs_of(rows) == [("a", "b")]
    latin = tmp_path / "latin.tsv"
    latin.write_bytes("source\ttarget\nGrüße\tGreetings\nStraße\tStreet\n".encode("latin-1"))
    rows, problems = read(latin, encoding="latin-1")
    assert problems == [] and pairs_of(rows) == [("Grüße", "Greetings"), ("Straße", "Street")]
    rows, problems = read(latin)  # read as utf-8: both rows named, none read with a replacement character
    assert rows == [] and [p.where for p in problems] == [f"{latin}:2", f"{latin}:3"]


# ---- 3. split by fraction -----------------------------------------------------------------

def numbered(tmp_path, n, name="s.csv", source=lambda i: f"Satz {i}", target=lambda i: f"Sentence {i}"):
    return write_csv(tmp_path / name, [(source(i), target(i)) for i in range(n)])


@pytest.mark.parametrize("dev, test, sizes", [
    (0.25, 0.05, (6, 3, 1)),    # 2.5 → 3 (half up), 0.5 → 1 (half up)
    (0.15, 0.01, (7, 2, 1)),    # 1.5 → 2, 0.1 → at least 1
    (0.34, 0.2, (5, 3, 2)),     # 3.4 → 3, 2.0 → 2
])
def test_split_sizes_round_half_up_and_are_at_least_one(tmp_path, dev, test, sizes):
    loaded = load_rows("s", pair_source(numbered(tmp_path, 10), split={"dev": dev, "test": test}))
    assert tuple(len(loaded.splits[s]) for s in ("train", "dev", "test")) == sizes
    assert loaded.problems == []


def test_split_is_fixed_by_its_seed_and_another_seed_draws_another(tmp_path):
    path = numbered(tmp_path, 40)

    def splits(seed):
        loaded = load_rows("s", pair_source(path, split={"dev": 0.2, "test": 0.2, "seed": seed}))
        return {s: pairs_of(rows) for s, rows in loaded.splits.items()}, loaded

    first, loaded = splits(3)
    assert first == splits(3)[0]
    assert first != splits(4)[0]
    assert sorted(p for rows in first.values() for p in rows) == sorted(pairs_of(read(path)[0]))
    for rows in loaded.splits.values():  # file order kept within each split
        assert lines_of(rows) == sorted(lines_of(rows))


def test_rows_sharing_a_key_up_to_case_and_spacing_never_cross_splits(tmp_path):
    variants = lambda i: [f"Das Haus {i}", f"das  haus {i}", f" DAS HAUS {i} "]  # noqa: E731
    path = write_csv(tmp_path / "g.csv", [(v, f"house {i}/{k}") for i in range(20) for k, v in enumerate(variants(i))])
    for seed in range(5):
        loaded = load_rows("g", pair_source(path, split={"dev": 0.2, "test": 0.2, "seed": seed}))
        where = {}
        for split, rows in loaded.splits.items():
            for r in rows:
                key = " ".join(r.values["source"].split()).casefold()
                assert where.setdefault(key, split) == split, f"{key!r} in {where[key]} and {split}"
        assert [len(loaded.splits[s]) for s in ("train", "dev", "test")] == [36, 12, 12]  # 12/4/4 groups of 3


def test_split_by_another_role_groups_by_it(tmp_path):
    # 30 German sources, 10 English targets shared by three sources each
    path = write_csv(tmp_path / "t.csv", [(f"Quelle {i}", f"Target {i % 10}") for i in range(30)])

    def crossing(by):
        loaded = load_rows("t", pair_source(path, split={"dev": 0.2, "test": 0.2, "seed": 0, "by": by}))
        split_of = {}
        for split, rows in loaded.splits.items():
            for r in rows:
                split_of.setdefault(r.values["target"], set()).add(split)
        return sum(len(s) > 1 for s in split_of.values())

    assert crossing("target") == 0
    assert crossing("source") > 0  # grouping by the source lets a shared target cross


def test_too_few_groups_to_split_is_a_data_error(tmp_path):
    path = write_csv(tmp_path / "few.csv", [("Hallo", f"Hello {i}") for i in range(5)] + [("hallo ", "hi"),
                                                                                          ("Tschüss", "Bye")])
    with pytest.raises(DataError, match=r"silo few: 2 distinct source value\(s\) in .*few\.csv cannot be split into "
                                        r"train and dev and test"):
        load_rows("few", pair_source(path))
    # three groups are enough for one each
    write_csv(path, [("a", "A"), ("b", "B"), ("c", "C")])
    assert [len(v) for v in load_rows("few", pair_source(path)).splits.values()] == [1, 1, 1]


def test_files_for_train_and_test_with_dev_cut_from_train(tmp_path):
    numbered(tmp_path, 20, "train.csv")
    test = numbered(tmp_path, 4, "test.csv", source=lambda i: f"Test {i}", target=lambda i: f"Test {i}")
    source = pair_source(tmp_path, files={"train": "train.csv", "test": "test.csv"}, split={"dev": 0.25})
    loaded = load_rows("f", source)
    assert list(loaded.splits) == ["train", "dev", "test"]
    assert pairs_of(loaded.splits["test"]) == pairs_of(read(test)[0])
    assert len(loaded.splits["dev"]) == 5 and len(loaded.splits["train"]) == 15
    train_file = pairs_of(read(tmp_path / "train.csv")[0])
    assert sorted(pairs_of(loaded.splits["train"]) + pairs_of(loaded.splits["dev"])) == sorted(train_file)
    assert loaded.files == [tmp_path / "train.csv", tmp_path / "test.csv"]


def test_files_need_a_folder(tmp_path):
    path = write_csv(tmp_path / "one.csv", CORPUS)
    with pytest.raises(DataError, match=r"path .*one\.csv is not a folder"):
        load_rows("x", PairSource(path=str(path), format="csv",
                                  files={"train": "a.csv", "dev": "b.csv", "test": "c.csv"}))


# ---- 4. settings refused with a reason ------------------------------------------------------

def config(sources, **task) -> dict:
    return {"task": {"name": "translation", "sources": sources, **task}}


OWN = {"path": "/data/legal.csv", "split": SPLIT}

REFUSED = [
    ({"a": {**OWN, "fields": {"german": "de"}}}, {}, r"task\.sources\.a: fields: 'german' is not a role of this "
     r"task's examples; roles: source, target"),
    ({"a": {"path": "/data/legal.txt", "split": SPLIT}}, {}, r"format: cannot tell it from the file name "
     r"'/data/legal\.txt'; set format = one of jsonl, csv, tsv, lines"),
    ({"news": {"format": "benchmark", "path": "/data"}}, {}, r"format = \"benchmark\" reads the benchmark's own "
     r"files: remove path"),
    ({"legal": {"format": "benchmark"}}, {}, r"sources\.legal: format = \"benchmark\" but no benchmark silo is "
     r"called 'legal'"),
    ({"a": {"path": "/data/legal.csv"}}, {}, r"give files per split .* or split = "),
    ({"a": {"path": "/data"}}, {}, r"format: cannot tell"),
    ({"a": {**OWN, "split": {"dev": 0.5, "test": 0.5}}}, {}, r"split: dev \+ test = 1 leaves nothing to train on"),
    ({"a": {**OWN, "split": {"dev": 0.7, "test": 0.4}}}, {}, r"dev \+ test = 1\.1 leaves nothing"),
    ({"a": {**OWN, "split": {"by": "text"}}}, {}, r"split\.by: 'text' is not a role; roles: source, target"),
    ({"news": OWN}, {}, r"sources\.news: 'news' is a benchmark silo's name; give your silo another name"),
    ({"a/b": OWN}, {}, r"sources\.a/b: a silo name is letters, digits"),
    ({"a": OWN}, {"silos": ["a", "legal"]}, r"unknown silo 'legal'; choose from news, ted, tatoeba, docs, ui, a"),
    ({"a": {**OWN, "encoding": "klingon"}}, {}, r"unknown text encoding 'klingon'"),
    ({"a": {**OWN, "bad_rows": "ignore"}}, {}, r"bad_rows"),
    ({"a": {**OWN, "colour": "red"}}, {}, r"colour"),
    ({"a": {"path": "/data", "files": {"train": "t.csv", "dev": "d.csv"}}}, {}, r"files: no test file: give it, "
     r"or cut it from train with split"),
    ({"a": {"path": "/data", "files": {"dev": "d.csv", "test": "t.csv"}}}, {}, r"files: train is required"),
    ({"a": {"path": "/data", "files": {"train": "t.csv", "test": "x.csv"}, "split": {"dev": 0}}}, {},
     r"split\.dev = 0 leaves no dev split"),
    ({"a": {"path": "/data/c", "format": "lines", "split": SPLIT}}, {}, r"format \"lines\" reads one file per role"),
]


@pytest.mark.parametrize("sources, task, message", REFUSED, ids=[m[2][:40] for m in REFUSED])
def test_a_wrong_source_entry_is_refused_with_its_reason(sources, task, message):
    with pytest.raises(ConfigError, match=message):
        validate(config(sources, **task))


def test_a_source_entry_alone_raises_a_pydantic_validation_error():
    with pytest.raises(ValidationError, match=r"fields: 'german' is not a role"):
        PairSource(path="/data/legal.csv", split=SPLIT, fields={"german": "de"})


def test_silos_default_to_the_sources_in_config_order_and_mix_with_benchmark_ones():
    task = validate(config({"zeta": OWN, "alpha": {**OWN, "path": "/data/b.jsonl", "display": "Alpha corpus"},
                            "news": {"format": "benchmark"}})).task
    assert task.silos == ["zeta", "alpha", "news"]
    assert task.own_source("zeta").format_name == "csv" and task.own_source("alpha").format_name == "jsonl"
    assert task.own_source("news") is None and task.needs_benchmark()
    names = task.display_names()
    assert names["alpha"] == "Alpha corpus" and names["news"] == "News" and "zeta" not in names  # shown as named
    task = validate(config({"zeta": OWN}, silos=["zeta", "ted"])).task
    assert task.silos == ["zeta", "ted"]
    assert validate({"task": {"name": "translation"}}).task.silos == ["news", "ted", "tatoeba", "docs", "ui"]


# ---- 5. accept: a malformed row stops the run, or is skipped with a warning -----------------

def bad_rows_file(tmp_path, n_bad=7) -> Path:
    good = [json.dumps({"source": f"Satz {i}", "target": f"Sentence {i}"}) for i in range(12)]
    lines = []
    for i, line in enumerate(good):
        lines.append(line)
        if i < n_bad:
            lines.append('{"source": "kaputt"}')
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path  # bad rows at lines 2, 4, ..., 2 * n_bad


def test_error_mode_lists_the_first_problems_by_file_and_line_and_counts_them(tmp_path):
    path = bad_rows_file(tmp_path)
    source = pair_source(path)
    loaded = load_rows("legal", source)
    assert len(loaded.problems) == 7
    with pytest.raises(DataError) as err:
        accept(loaded, source)
    message = str(err.value)
    assert message.startswith("silo legal: 7 malformed row(s): ")
    shown = [f"{path}:{2 * i}: no key 'target' for target" for i in range(1, SHOWN_PROBLEMS + 1)]
    assert "; ".join(shown) in message
    assert f"{path}:12:" not in message and "(and 2 more)" in message
    assert "bad_rows = \"skip\" in [task.sources.legal]" in message
    accept(load_rows("legal", pair_source(write_jsonl(tmp_path / "ok.jsonl", CORPUS * 3))), source)  # none: no error


def test_skip_mode_warns_and_the_silo_has_no_bad_row(tmp_path):
    path = bad_rows_file(tmp_path, n_bad=2)
    settings = validate(config({"legal": {"path": str(path), "split": SPLIT, "bad_rows": "skip"}},
                               tokenizer_domain="legal", matrix=[])).task
    with pytest.warns(UserWarning, match=rf"silo legal: 2 malformed row\(s\) left out \(bad_rows = \"skip\"\): "
                                         rf"{path}:2: no key 'target' for target; {path}:4: "):
        pairs = load_silo(settings, "legal", None)
    everything = [p for split in pairs.values() for p in split]
    assert len(everything) == 12 and all(p.source != "kaputt" for p in everything)
    assert {p.where for p in everything}.isdisjoint({f"{path}:2", f"{path}:4"})
    # the same file with bad_rows = "error" (the default) stops the silo
    settings = validate(config({"legal": {"path": str(path), "split": SPLIT}}, tokenizer_domain="legal",
                               matrix=[])).task
    with pytest.raises(DataError, match=rf"silo legal: 2 malformed row\(s\): {path}:2: "):
        load_silo(settings, "legal", None)


# ---- 6. the check: duplicates, overlap; fingerprints ------------------------------------------

def test_inspect_items_names_duplicates_where_and_first_seen_and_overlap_between_splits():
    splits = {
        "train": [Item("f:1", "Hallo", ("Hallo", "Hello")), Item("f:2", "Hallo", ("Hallo", "Hi")),
                  Item("f:3", "Tag", ("Tag", "Day")), Item("f:4", "Hallo", ("Hallo", "Hello"))],
        "dev": [Item("d:1", " hallo ", ("hallo", "hello"))],
        "test": [Item("t:1", "Nacht", ("Nacht", "Night")), Item("t:2", "Nacht", ("Nacht", "Night")),
                 Item("t:3", "Nacht", ("Nacht", "Night"))],
    }
    check = inspect_items("legal", "csv", "pairs", splits, "source")
    assert check.counts == {"train": 4, "dev": 1, "test": 3}
    assert check.duplicates == {"train": [("f:4", "f:1")], "test": [("t:2", "t:1"), ("t:3", "t:1")]}
    # " hallo " is "Hallo" only up to case and spacing: listed apart, as written; "Tag" is train only
    assert check.overlap == {} and [(k.text, k.where, k.first) for k in check.folded["train/dev"]] == [
        (" hallo ", "d:1", "f:1")]
    assert not check.blocking
    lines = "\n".join(check.lines())
    assert "f:4 repeats f:1" in lines and "1 source(s) of dev equal to a train one only up to case" in lines
    assert warnings_of(check) == [
        "silo legal: 1 exact duplicate example(s) in train, first f:4 (repeats f:1)",
        "silo legal: 2 exact duplicate example(s) in test, first t:2 (repeats t:1)"]
    splits["dev"] = [Item("d:1", "Hallo", ("Hallo", "Hello there"))]
    assert warnings_of(inspect_items("legal", "csv", "pairs", splits, "source"))[-1] == (
        "silo legal: 1 source(s) in both train/dev, e.g. 'Hallo' (d:1 and f:1): evaluation sees them in training")
    assert inspect_items("e", "csv", "pairs", {"train": splits["train"], "dev": [], "test": []}, "source").blocking


def own_config(sources: dict, **task) -> dict:
    first = next(iter(sources))
    return config(sources, tokenizer_domain=task.pop("tokenizer_domain", first), matrix=[], **task)


def test_inspect_silos_finds_overlap_between_split_files_and_problems(tmp_path):
    (tmp_path / "legal").mkdir()
    write_csv(tmp_path / "legal" / "train.csv", [("Hallo", "Hello"), ("Tag", "Day"), ("Tag", "Day")])
    write_csv(tmp_path / "legal" / "dev.csv", [("Abend", "Evening")])
    write_csv(tmp_path / "legal" / "test.csv", [("hallo", "hello"), ("Nacht", "Night")])
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"source": f"s{i}", "target": f"t{i}"}) + "\n" for i in range(9))
                    + '{"source": "x"}\n')
    cfg = validate(own_config({
        "legal": {"path": str(tmp_path / "legal"), "files": {s: f"{s}.csv" for s in ("train", "dev", "test")}},
        "chat": {"path": str(chat), "split": {"dev": 0.2, "test": 0.2}}}))
    legal, chat_check = inspect_silos(cfg)
    assert legal.counts == {"train": 3, "dev": 1, "test": 2} and legal.problems == []
    assert legal.overlap == {} and [k.text for k in legal.folded["train/test"]] == ["hallo"]  # up to case
    assert legal.duplicates == {"train": [(f"{tmp_path / 'legal' / 'train.csv'}:4",
                                           f"{tmp_path / 'legal' / 'train.csv'}:3")]}
    assert set(legal.files) == {str(tmp_path / "legal" / f"{s}.csv") for s in ("train", "dev", "test")}
    assert [str(p) for p in chat_check.problems] == [f"{chat}:10: no key 'target' for target"]
    assert chat_check.blocking and not legal.blocking
    text = report([legal, chat_check])
    assert f"{chat}:10: no key 'target' for target" in text
    assert text.endswith("2 silo(s) checked: 1 cannot be run (chat)")
    with pytest.raises(DataError, match=rf"silo chat: 1 malformed row\(s\): {chat}:10: no key 'target'"):
        check_at_start(cfg, tmp_path / "run", False, lambda line: None)
    assert not (tmp_path / "run" / RECORD).exists()  # a blocked start records nothing


def test_record_keeps_what_the_run_started_on_and_names_a_changed_file(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.csv", "b.csv", "c.csv"))
    for f in (a, b, c):
        f.write_text(f"source,target\n{f.stem},x\n")
    run = tmp_path / "run"
    now = lambda: {"legal": fingerprints([a, b]), "chat": fingerprints([c])}  # noqa: E731
    assert record(run, now(), resume=False) == []
    data = json.loads((run / RECORD).read_text())
    assert data["started"] == data["now"] == now()
    assert data["started"]["legal"][str(a)] == {"bytes": a.stat().st_size,
                                                "sha256": hashlib.sha256(a.read_bytes()).hexdigest()}
    assert record(run, now(), resume=True) == []  # unchanged
    b.write_text("source,target\nb,changed\n")
    found = record(run, now(), resume=True)
    assert len(found) == 1 and found[0].startswith(f"silo legal: {b} changed since the run started (")
    assert str(a) not in found[0]
    assert record(run, now(), resume=True) == found  # compared with the start, not the last resume
    assert json.loads((run / RECORD).read_text())["started"] == data["started"]
    # a silo the run did not start with is not compared; one the run read before but not now is not either
    d = tmp_path / "d.csv"
    d.write_text("x")
    assert record(run, {**now(), "new": fingerprints([d])}, resume=True) == found
    assert record(run, {"chat": fingerprints([c])}, resume=True) == []
    # a file no longer read, or read now and not at the start, is named
    assert record(run, {"legal": fingerprints([a]), "chat": fingerprints([c, d])}, resume=True) == [
        f"silo chat: {d} is read now but was not when the run started",
        f"silo legal: {b} is no longer read (it was when the run started)"]
    # not a resume: a new start
    assert record(run, now(), resume=False) == []
    assert json.loads((run / RECORD).read_text())["started"] == now()


# ---- 7. end to end: two own silos, a resume after a file changed, a malformed row -----------

@pytest.fixture
def own_data_root(tmp_path, monkeypatch):
    """The tokenizer fitted on an own silo is cached here, never in the user's data folder."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "fedsilo-data"))


WORDS = [("das", "the"), ("haus", "house"), ("ist", "is"), ("groß", "big"), ("klein", "small"), ("hund", "dog"),
         ("katze", "cat"), ("läuft", "runs"), ("schnell", "fast"), ("heute", "today"), ("gut", "good")]


def sentences(n: int, offset: int) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        idx = [(i * 7 + k * 3 + offset) % len(WORDS) for k in range(4)]
        out.append((" ".join(WORDS[j][0] for j in idx) + f" {i}", " ".join(WORDS[j][1] for j in idx) + f" {i}"))
    return out


def run_config(tmp_path, rounds=1, legal_bad_rows="error") -> dict:
    return {
        "name": "own", "seed": 1,
        "task": {"name": "translation", "max_train": 16, "max_eval": 4, "vocab_size": 100, "matrix": [],
                 "max_source_length": 16, "max_target_length": 16, "eval_batch_size": 8, "tokenizer_domain": "legal",
                 "sources": {
                     "legal": {"path": str(tmp_path / "legal.csv"), "fields": {"source": "german", "target": "english"},
                               "split": {"dev": 0.2, "test": 0.2}, "display": "Legal texts",
                               "bad_rows": legal_bad_rows},
                     "chat": {"path": str(tmp_path / "chat.jsonl"), "fields": {"source": "de", "target": "en"},
                              "split": {"dev": 0.2, "test": 0.2, "seed": 2}, "display": "Chat"}}},
        "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2},
        "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "logging_steps": 1},
        "federation": {"rounds": rounds},
    }


def write_silos(tmp_path):
    write_csv(tmp_path / "legal.csv", sentences(30, 0), header=("german", "english"))
    write_jsonl(tmp_path / "chat.jsonl", sentences(30, 5), keys=("de", "en"))


def test_a_run_on_two_own_silos_records_their_files_and_a_resume_names_a_changed_one(tmp_path, own_data_root,
                                                                                      capsys):
    from fedsilo.runs.runner import run_experiment

    write_silos(tmp_path)
    legal, chat = tmp_path / "legal.csv", tmp_path / "chat.jsonl"
    out = tmp_path / "run"
    results = run_experiment(validate(run_config(tmp_path)), out, show_progress=False)
    assert sorted(row["client"] for row in results["test"]["rows"]) == ["chat", "legal"]
    assert results["display"]["legal"] == "Legal texts" and results["display"]["chat"] == "Chat"
    data = json.loads((out / RECORD).read_text())
    fp = lambda f: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}  # noqa: E731
    assert data["started"] == data["now"] == {"legal": {str(legal): fp(legal)}, "chat": {str(chat): fp(chat)}}
    assert "changed since" not in capsys.readouterr().err

    with open(chat, "a") as f:
        f.write(json.dumps({"de": "neu", "en": "new"}) + "\n")
    results = run_experiment(validate(run_config(tmp_path, rounds=2)), out, resume=True, show_progress=False)
    err = capsys.readouterr().err
    assert results["rounds"] == 2
    assert f"silo chat: {chat} changed since the run started" in " ".join(err.split())
    assert str(legal) not in err
    data = json.loads((out / RECORD).read_text())
    assert data["now"]["chat"][str(chat)]["sha256"] == hashlib.sha256(chat.read_bytes()).hexdigest()
    assert data["started"]["chat"][str(chat)]["sha256"] != data["now"]["chat"][str(chat)]["sha256"]


@pytest.mark.parametrize("silo, bad, where, reason", [
    ("legal", "nur ein feld\n", "legal.csv:32", r"1 comma-separated fields; the header has 2"),  # the tokenizer's
    ("chat", '{"de": "nur deutsch"}\n', "chat.jsonl:31", r"no key 'en' for target"),
])
def test_a_malformed_row_stops_the_run_before_training(tmp_path, own_data_root, silo, bad, where, reason):
    from fedsilo.runs.runner import run_experiment

    write_silos(tmp_path)
    with open(tmp_path / where.partition(":")[0], "a") as f:
        f.write(bad)  # after the 30 good rows (and the csv's header)
    out = tmp_path / "run"
    with pytest.raises(DataError, match=rf"silo {silo}: 1 malformed row\(s\): {tmp_path / where}: {reason}"):
        run_experiment(validate(run_config(tmp_path)), out, show_progress=False)
    assert not (out / "checkpoint.pt").exists() and not (out / "rounds.jsonl").exists()
    assert not (out / RECORD).exists()


def test_a_run_with_bad_rows_skipped_warns_naming_them_and_trains(tmp_path, own_data_root, capsys):
    from fedsilo.runs.runner import run_experiment

    write_silos(tmp_path)
    with open(tmp_path / "legal.csv", "a") as f:
        f.write("nur ein feld\n")
    results = run_experiment(validate(run_config(tmp_path, legal_bad_rows="skip")), tmp_path / "run",
                             show_progress=False)
    err = " ".join(capsys.readouterr().err.split())
    assert f"silo legal: 1 malformed row(s) left out (bad_rows = \"skip\"): {tmp_path / 'legal.csv'}:32" in err
    assert results["rounds"] == 1 and (tmp_path / "run" / "checkpoint.pt").exists()


def test_data_check_command_reports_each_silo_and_fails_on_a_malformed_row(tmp_path, own_data_root, capsys):
    from fedsilo.cli import main

    write_silos(tmp_path)
    toml = tmp_path / "own.toml"
    toml.write_text(f"""[task]
name = "translation"
tokenizer_domain = "legal"
matrix = []
[task.sources.legal]
path = "{tmp_path / 'legal.csv'}"
fields = {{source = "german", target = "english"}}
split = {{dev = 0.2, test = 0.2}}
[task.sources.chat]
path = "{tmp_path / 'chat.jsonl'}"
fields = {{source = "de", target = "en"}}
split = {{dev = 0.2, test = 0.2, seed = 2}}
""")
    assert main(["data", "check", str(toml), "--no-lengths", "--json", str(tmp_path / "check.json")]) == 0
    out = capsys.readouterr().out
    assert "silo legal (csv): 18 train, 6 dev, 6 test pairs" in out and "silo chat (jsonl):" in out
    assert "2 silo(s) checked: ready to run" in out
    assert [c["name"] for c in json.loads((tmp_path / "check.json").read_text())] == ["legal", "chat"]
    with open(tmp_path / "chat.jsonl", "a") as f:
        f.write("[1, 2]\n")
    assert main(["data", "check", str(toml), "--no-lengths"]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'chat.jsonl'}:31: a JSON list; expected an object" in out
    assert "1 cannot be run (chat)" in out


def test_a_config_file_names_its_silos_files_relative_to_its_own_folder(tmp_path, own_data_root, monkeypatch, capsys):
    from fedsilo.cli import main

    (tmp_path / "project" / "data").mkdir(parents=True)
    write_csv(tmp_path / "project" / "data" / "legal.csv", sentences(10, 0))
    toml = tmp_path / "project" / "own.toml"
    toml.write_text('[task]\nname = "translation"\ntokenizer_domain = "legal"\nmatrix = []\n'
                    '[task.sources.legal]\npath = "data/legal.csv"\nsplit = {dev = 0.2, test = 0.2}\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["data", "check", str(toml), "--no-lengths"]) == 0
    out = capsys.readouterr().out
    assert "silo legal (csv): 6 train, 2 dev, 2 test pairs" in out
    assert f"file {tmp_path / 'project' / 'data' / 'legal.csv'}:" in out


def test_a_run_start_records_the_silos_it_reads_besides_its_own_the_tokenizers(tmp_path):
    write_silos(tmp_path)
    legal = tmp_path / "legal.csv"
    cfg = validate(run_config(tmp_path) | {"task": {**run_config(tmp_path)["task"], "silos": ["chat"]}})
    assert cfg.task.silos == ["chat"] and cfg.task.tokenizer_domain == "legal"
    checks = check_at_start(cfg, tmp_path / "run", False, lambda line: None)
    assert [c.name for c in checks] == ["chat", "legal"]
    assert set(json.loads((tmp_path / "run" / RECORD).read_text())["started"]) == {"chat", "legal"}
    with open(legal, "a") as f:
        f.write("neu,new\n")
    warned = []
    check_at_start(cfg, tmp_path / "run", True, warned.append)
    assert len(warned) == 1 and warned[0].startswith(f"silo legal: {legal} changed since the run started")
    # one machine's own silo only (a Flower silo) records that silo
    assert [c.name for c in check_at_start(cfg, tmp_path / "one", False, warned.append, silos=["chat"])] == ["chat"]
