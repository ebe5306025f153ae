import json
import time
from pathlib import Path

import pytest

from fedsilo.tasks.text2sql.data import (
    DISPLAY,
    SILOS,
    DataError,
    Example,
    load_silo,
    normalise_sql,
    normalise_text,
    serialize_schema,
    substitute,
)
from tests.synth import REAL, needs_real

SCHEMA_CSV = """Table Name, Field Name, Is Primary Key, Is Foreign Key, Type
STATE, STATE_NAME, y, n, varchar(255)
STATE, POPULATION, n, n, "decimal(1,1)"
-, -, -, -, -

CITY, CITY_NAME, y, n, varchar(255)
CITY, STATE_NAME, y, y, varchar(255)
"""


def _record(split_labels, text="cities in state_name0", sql='SELECT X FROM T WHERE S = "state_name0" ;',
            values=("texas",), variables=None):
    return {
        "query-split": "train",
        "sentences": [{"question-split": s, "text": text, "variables": {"state_name0": v}}
                      for s, v in zip(split_labels, values)],
        "sql": [sql, "SELECT OTHER ;"],
        "variables": variables if variables is not None else
        [{"name": "state_name0", "example": "ohio", "location": "both", "type": "state_name"}],
    }


def _write_silo(tmp_path: Path, name: str, records) -> Path:
    (tmp_path / f"{name}.json").write_text(json.dumps(records))
    (tmp_path / f"{name}-schema.csv").write_text(SCHEMA_CSV)
    return tmp_path


# ---- substitution, schema, normalisation -------------------------------------------------

def test_substitute_longest_name_first():
    values = {"state_name1": "ohio", "state_name10": "utah"}
    assert substitute("state_name10 and state_name1", values) == "utah and ohio"


def test_substitute_does_not_rescan_inserted_values():
    assert substitute("a0 b0", {"a0": "b0", "b0": "x"}) == "b0 x"


def test_substitute_without_values_is_identity():
    assert substitute("city_name0", {}) == "city_name0"


def test_empty_sentence_value_falls_back_to_example(tmp_path):
    _write_silo(tmp_path, "geography", [_record(["train", "train"], values=("", "texas"))])
    train = load_silo(tmp_path, "geography")["train"]
    assert [e.question for e in train] == ["cities in ohio", "cities in texas"]
    assert train[0].sql == 'select x from t where s = " ohio " ;'


def test_missing_sentence_value_falls_back_to_example(tmp_path):
    record = _record(["train"], text="courses in department0", sql='SELECT C WHERE D = "department0" ;')
    record["variables"] = [{"name": "department0", "example": "EECS"}]
    _write_silo(tmp_path, "advising", [record])
    (ex,) = load_silo(tmp_path, "advising")["train"]
    assert ex.question == "courses in EECS"
    assert ex.sql == 'select c where d = " eecs " ;'


def test_serialize_schema(tmp_path):
    path = tmp_path / "x-schema.csv"
    path.write_text(SCHEMA_CSV)
    assert serialize_schema(path) == "state: state_name, population | city: city_name, state_name"


def test_serialize_schema_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope-schema.csv"):
        serialize_schema(tmp_path / "nope-schema.csv")


def test_normalise_splits_punctuation_and_underscores():
    assert normalise_sql('SELECT A.STATE_NAME FROM T WHERE x<=1.5 AND n = "New York" ;') == \
        'select a . state _ name from t where x < = 1 . 5 and n = " new york " ;'
    assert normalise_text("  What's   THE  capital? ") == "what ' s the capital ?"


def test_normalise_is_idempotent():
    text = 'SELECT COUNT( * ) FROM A_B WHERE x LIKE "%db%" ;'
    assert normalise_sql(normalise_sql(text)) == normalise_sql(text)


# ---- splits ------------------------------------------------------------------------------

def test_named_split_drops_exclude_and_uses_first_sql(tmp_path):
    labels = ["train", "dev", "test", "exclude", "train"]
    _write_silo(tmp_path, "advising", [_record(labels, values=["texas"] * 5)])
    splits = load_silo(tmp_path, "advising")
    assert {k: len(v) for k, v in splits.items()} == {"train": 2, "dev": 1, "test": 1}
    ex = splits["dev"][0]
    assert ex == Example("advising", "cities in texas", 'select x from t where s = " texas " ;',
                         "cities in texas | state: state_name, population | city: city_name, state_name")


def test_fold_split(tmp_path):
    labels = [str(f) for f in range(10)]
    _write_silo(tmp_path, "yelp", [_record(labels[:5], values=["a"] * 5), _record(labels[5:], values=["b"] * 5)])
    splits = load_silo(tmp_path, "yelp")
    assert {k: len(v) for k, v in splits.items()} == {"train": 6, "dev": 2, "test": 2}
    assert [e.question for e in splits["test"]] == ["cities in b", "cities in b"]


@pytest.mark.parametrize("silo, label", [("yelp", "train"), ("atis", "3"), ("atis", "exclud")])
def test_unexpected_split_label(tmp_path, silo, label):
    _write_silo(tmp_path, silo, [_record([label])])
    with pytest.raises(DataError, match=rf"{silo}\.json: record 0, sentence 0: unexpected question-split"):
        load_silo(tmp_path, silo)


# ---- errors ------------------------------------------------------------------------------

def test_missing_json_names_file(tmp_path):
    (tmp_path / "imdb-schema.csv").write_text(SCHEMA_CSV)
    with pytest.raises(DataError, match=r"not found: .*imdb\.json"):
        load_silo(tmp_path, "imdb")


def test_invalid_json_names_file(tmp_path):
    _write_silo(tmp_path, "imdb", [])
    (tmp_path / "imdb.json").write_text('[{"sql": [')
    with pytest.raises(DataError, match=r"imdb\.json: invalid JSON"):
        load_silo(tmp_path, "imdb")


def test_record_without_sql_names_file_and_index(tmp_path):
    bad = _record(["0"])
    del bad["sql"]
    _write_silo(tmp_path, "imdb", [_record(["0"]), bad])
    with pytest.raises(DataError, match=r"imdb\.json: record 1: missing key 'sql'"):
        load_silo(tmp_path, "imdb")


def test_sentence_without_text_names_sentence(tmp_path):
    bad = _record(["0", "1"], values=("a", "b"))
    del bad["sentences"][1]["text"]
    _write_silo(tmp_path, "imdb", [bad])
    with pytest.raises(DataError, match=r"record 0, sentence 1: missing key 'text'"):
        load_silo(tmp_path, "imdb")


def test_unknown_silo(tmp_path):
    with pytest.raises(DataError, match="unknown text2sql silo 'spider'"):
        load_silo(tmp_path, "spider")


def test_display_names_cover_silos():
    assert set(DISPLAY) == set(SILOS) and DISPLAY["geography"] == "GeoQuery"


# ---- real data ---------------------------------------------------------------------------

EXPECTED_COUNTS = {
    "advising": (2629, 229, 573), "atis": (4347, 486, 447), "geography": (549, 49, 279),
    "scholar": (499, 100, 218), "restaurants": (228, 76, 74), "academic": (120, 38, 38),
    "imdb": (79, 26, 26), "yelp": (78, 26, 24),
}


@pytest.fixture(scope="module")
def real():
    start = time.perf_counter()
    data = {silo: load_silo(REAL, silo) for silo in SILOS}
    return data, time.perf_counter() - start


@needs_real
@pytest.mark.parametrize("silo", SILOS)
def test_real_split_counts(real, silo):
    splits = real[0][silo]
    assert tuple(len(splits[s]) for s in ("train", "dev", "test")) == EXPECTED_COUNTS[silo]


@needs_real
def test_real_load_is_fast(real):
    assert real[1] < 5.0


def _find(examples, question):
    return next(e for e in examples if e.question == question)


@needs_real
def test_real_academic_author_substitution(real):
    ex = _find(real[0]["academic"]["train"], 'return me the homepage of " H. V. Jagadish " .')
    assert ex.sql == 'select authoralias0 . homepage from author as authoralias0 ' \
                     'where authoralias0 . name = " h . v . jagadish " ;'
    assert ex.source.startswith('return me the homepage of " H. V. Jagadish " . | author: aid, homepage, name, oid | ')


@needs_real
def test_real_advising_empty_value_uses_example(real):
    # department0 is "" in the sentence; the variable's example is EECS.
    ex = _find(real[0]["advising"]["train"], "Can undergrads take 550 ?")
    assert ex.sql.endswith('where coursealias0 . department = " eecs " and coursealias0 . number = 550 ;')


@needs_real
def test_real_geography_and_atis_examples(real):
    geo = real[0]["geography"]["test"][0]
    assert geo.question == "what is the biggest city in kansas"
    assert geo.sql == ('select cityalias0 . city _ name from city as cityalias0 where cityalias0 . population = '
                       '( select max ( cityalias1 . population ) from city as cityalias1 where cityalias1 . '
                       'state _ name = " kansas " ) and cityalias0 . state _ name = " kansas " ;')
    atis = real[0]["atis"]["test"][0]
    assert atis.question == "i need a flight from DENVER to SALT LAKE CITY on monday"
    assert 'cityalias1 . city _ name = " salt lake city "' in atis.sql
