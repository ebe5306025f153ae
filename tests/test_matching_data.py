import csv
import gzip
import io
import json
import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from fedsilo import datafetch
from fedsilo.datafetch import DataChangedWarning, DataError
from fedsilo.tasks.matching import benchmark as mdata
from fedsilo.tasks.matching.benchmark import load_silo, required_files, verify_data_dir
from fedsilo.tasks.matching.bm25 import Bm25Index, tokenize, top_k
from fedsilo.tasks.matching.plugin import DISPLAY, SILOS
from fedsilo.tasks.matching.questions import SPLITS, Question

# The real data beside the project; tests that need it skip without it.
QA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qa"
needs_qa = pytest.mark.skipif(not QA.is_dir(), reason=f"real QA data not found at {QA}")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Prepared splits go to a per-test data root, never the user's cache."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="")
    return path


def _csv(*rows) -> str:
    out = io.StringIO()
    csv.writer(out).writerows(rows)  # CRLF line ends, as the real files have
    return out.getvalue()


def _wikiqa(root: Path, splits: dict) -> Path:
    """``splits``: split -> [(id, question, candidate, label)]; missing splits get one row."""
    for split in SPLITS:
        rows = splits.get(split, [(f"{split}1", f"{split} question ?", "an answer .", "1")])
        for i, name in enumerate(("id.txt", "a.toks", "b.toks", "sim.txt")):
            _write(root, f"wikiqa/{split}/{name}", "".join(f"{row[i]}\n" for row in rows))
    return root


def _trecqa(root: Path, splits: dict) -> Path:
    for split in SPLITS:
        rows = splits.get(split, [(f"{split} question ?", "1", "an answer .")])
        _write(root, f"trecqa/{split}.csv", _csv(("qtext", "label", "atext"), *rows))
    return root


def _insuranceqa(root: Path, rows) -> Path:
    _write(root, "insuranceqa/test.csv", _csv(("question", "answer", "label"), *rows))
    return root


def _fiqa(root: Path, questions, rels, answers) -> Path:
    _write(root, "fiqa/FiQA_train_question_final.tsv",
           "\tqid\tquestion\ttimestamp\n" + "".join(f"{i}\t{qid}\t{q}\tMay 1 '15\n" for i, (qid, q) in enumerate(questions)))
    _write(root, "fiqa/FiQA_train_question_doc_final.tsv",
           "\tqid\tdocid\n" + "".join(f"{i}\t{qid}\t{d}\n" for i, (qid, d) in enumerate(rels)))
    _write(root, "fiqa/test_answers.csv", "".join(f"{d}\t{text}\n" for d, text in answers))
    return root


def _medquad_xml(*pairs) -> str:
    body = "".join(f'<QAPair pid="{i}"><Question qid="x-{i}" qtype="information">{q}</Question>'
                   f"<Answer>{a}</Answer></QAPair>\n" for i, (q, a) in enumerate(pairs, start=1))
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<Document id="1"><Focus>F</Focus><QAPairs>\n{body}</QAPairs></Document>\n'


def _medquad(root: Path, monkeypatch, files: dict) -> Path:
    """Tiny MedQuAD files; the silo reads exactly the pinned list, so it is pointed at these."""
    for rel, text in files.items():
        _write(root, rel, text)
    monkeypatch.setattr(mdata, "_medquad_files", lambda: sorted(files))
    return root


def _negatives(q: Question) -> list[str]:
    return [c for c, y in zip(q.candidates, q.labels) if not y]


def _golds(q: Question) -> list[str]:
    return [c for c, y in zip(q.candidates, q.labels) if y]


# ---- BM25 ----------------------------------------------------------------------------------

def test_tokenize_lowercases_words():
    assert tokenize("What's a 401(k)?  Tax-FREE\tgrowth!") == ["what", "s", "a", "401", "k", "tax", "free", "growth"]
    assert tokenize(" ?! ") == []


def test_bm25_is_lucenes_formula():
    index = Bm25Index(["the cat sat", "The cat ate the fish.", "a dog"])
    # N = 3, avgdl = 10/3; idf = ln(1 + (N - n + 0.5)/(n + 0.5)); tf part = tf / (tf + k1(1 - b + b dl/avgdl))
    idf_cat, idf_fish = math.log(1 + 1.5 / 2.5), math.log(1 + 2.5 / 1.5)
    norm = [1.2 * (0.25 + 0.75 * dl / (10 / 3)) for dl in (3, 5, 2)]
    expected = [idf_cat / (1 + norm[0]), (idf_cat + idf_fish) / (1 + norm[1]), 0.0]
    assert np.allclose(index.scores("cat fish"), expected, rtol=0, atol=1e-5)
    # a repeated query token counts twice; case and punctuation do not matter
    assert np.allclose(index.scores("Cat, CAT!"), [2 * idf_cat / (1 + norm[0]), 2 * idf_cat / (1 + norm[1]), 0.0],
                       rtol=0, atol=1e-5)
    # tf = 2 in one document: the "the" of document 1
    idf_the = math.log(1 + 1.5 / 2.5)
    assert index.scores("the")[1] == pytest.approx(idf_the * 2 / (2 + norm[1]), abs=1e-5)


def test_bm25_unknown_or_empty_query_scores_zero():
    index = Bm25Index(["alpha beta", "gamma"])
    for query in ("zeta", "", "?!"):
        scores = index.scores(query)
        assert scores.shape == (2,) and not scores.any()


def test_bm25_is_deterministic_and_in_text_order():
    texts = [f"doc {i} " + " ".join(random.Random(i).choices("abcdefg", k=12)) for i in range(30)]
    a, b = Bm25Index(texts).scores("a b c doc"), Bm25Index(texts).scores("a b c doc")
    assert np.array_equal(a, b)
    reversed_scores = Bm25Index(texts[::-1]).scores("a b c doc")
    assert np.allclose(reversed_scores[::-1], a, rtol=0, atol=1e-12)


def test_top_k_ties_by_index_and_exclude():
    scores = np.array([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    assert top_k(scores, 3) == [1, 2, 4]
    assert top_k(scores, 3, exclude={2}) == [1, 4, 5]
    assert top_k(scores, 4, exclude=[1, 2, 4]) == [5, 0, 3]
    assert top_k(scores, 10, exclude={0}) == [1, 2, 4, 5, 3]  # fewer than k left
    assert top_k(scores, 0) == []
    assert top_k(np.zeros(3), 2) == [0, 1]


# ---- reading each silo ---------------------------------------------------------------------

def test_api_names():
    assert SILOS == ("medquad", "fiqa", "insuranceqa", "wikiqa", "trecqa") and SPLITS == ("train", "dev", "test")
    assert set(DISPLAY) == set(SILOS) and DISPLAY["insuranceqa"] == "InsuranceQA"
    assert required_files(["insuranceqa", "trecqa", "insuranceqa"]) == [
        "insuranceqa/test.csv", "trecqa/train.csv", "trecqa/dev.csv", "trecqa/test.csv"]
    medquad = required_files(["medquad"])
    assert len(medquad) == 493 and medquad == sorted(medquad)
    assert {p.split("/")[1] for p in medquad} == {"5_NIDDK_QA", "6_NINDS_QA", "9_CDC_QA"}
    with pytest.raises(DataError, match="unknown matching silo 'bioasq'"):
        required_files(["bioasq"])
    with pytest.raises(DataError, match="unknown matching silo 'bioasq'"):
        load_silo(Path("."), "bioasq")


def test_wikiqa_one_question_per_id_in_file_order(tmp_path):
    _wikiqa(tmp_path, {"train": [("7", "who wrote `` it '' ?", "stephen king wrote it .", "1"),
                                 ("7", "who wrote `` it '' ?", "it is a novel .", "0"),
                                 ("7", "who wrote `` it '' ?", "it is a novel .", "0"),  # repeated candidate
                                 ("3", "what is -lrb- x -rrb- ?", "x is a letter -LRB- y -RRB- .", "0")]})
    out = load_silo(tmp_path, "wikiqa")
    assert out["train"] == [
        Question("7", 'who wrote " it " ?', ("stephen king wrote it .", "it is a novel ."), (1, 0)),
        Question("3", "what is -lrb- x -rrb- ?", ("x is a letter ( y ) .",), (0,)),  # only upper-case escapes
    ]
    assert out["test"] == [Question("test1", "test question ?", ("an answer .",), (1,))]


def test_wikiqa_bad_label_and_misaligned_files(tmp_path):
    _wikiqa(tmp_path, {"dev": [("1", "q ?", "a .", "1"), ("1", "q ?", "b .", "2")]})
    with pytest.raises(DataError, match=r"wikiqa/dev/sim\.txt: line 2: expected the label 0 or 1, got '2'"):
        load_silo(tmp_path, "wikiqa")
    _wikiqa(tmp_path, {"dev": [("1", "q ?", "a .", "1")]})
    _write(tmp_path, "wikiqa/dev/b.toks", "a .\nb .\n")
    with pytest.raises(DataError, match=r"wikiqa/dev/b\.toks has 2 lines but its parallel file .*dev/id\.txt has 1"):
        load_silo(tmp_path, "wikiqa")
    _wikiqa(tmp_path, {"dev": [("1", "q ?", "a .", "1"), ("1", "other q ?", "b .", "0")]})
    with pytest.raises(DataError, match=r"wikiqa/dev/a\.toks: line 2: question id 1 had another question text"):
        load_silo(tmp_path, "wikiqa")


def test_trecqa_groups_consecutive_rows_and_maps_ptb(tmp_path):
    _trecqa(tmp_path, {"train": [("Who is `` the Iron Lady '' ?", "1", "Thatcher -LRB- UK -RRB- , -LSB- 1 -RSB- ."),
                                 ("Who is `` the Iron Lady '' ?", "0", "A  biography ."),
                                 ("When ?", "0", "Then .")]})
    out = load_silo(tmp_path, "trecqa")
    assert out["train"] == [
        Question("2", 'Who is " the Iron Lady " ?', ("Thatcher ( UK ) , [ 1 ] .", "A biography ."), (1, 0)),
        Question("4", "When ?", ("Then .",), (0,)),
    ]
    assert out["dev"] == [Question("2", "dev question ?", ("an answer .",), (1,))]


def test_trecqa_bad_records_name_file_and_line(tmp_path):
    _trecqa(tmp_path, {"test": [("q ?", "1", "a ."), ("q ?", "yes", "b .")]})
    with pytest.raises(DataError, match=r"trecqa/test\.csv: line 3: expected the label 0 or 1, got 'yes'"):
        load_silo(tmp_path, "trecqa")
    _trecqa(tmp_path, {"test": [("q ?", "1", "a ."), ("q ?", "0")]})
    with pytest.raises(DataError, match=r"trecqa/test\.csv: line 3: expected 3 comma-separated fields"):
        load_silo(tmp_path, "trecqa")
    _write(tmp_path, "trecqa/dev.csv", _csv(("question", "label", "answer"), ("q ?", "1", "a .")))
    with pytest.raises(DataError, match=r"trecqa/dev\.csv: line 1: expected the header 'qtext,label,atext'"):
        load_silo(tmp_path, "trecqa")


def test_given_splits_never_share_a_question(tmp_path):
    _trecqa(tmp_path, {"train": [("Shared ?", "1", "a ."), ("Own ?", "1", "b .")],
                       "dev": [("shared ?", "0", "c ."), ("Dev ?", "1", "d .")],
                       "test": [("SHARED ?", "1", "e .")]})
    out = load_silo(tmp_path, "trecqa")
    assert [q.text for q in out["train"]] == ["Own ?"]
    assert [q.text for q in out["dev"]] == ["Dev ?"]
    assert [q.text for q in out["test"]] == ["SHARED ?"]


def _insurance_rows(n: int) -> list[tuple[str, str, str]]:
    """Questions q0..q{n-1}, each with a relevant and an irrelevant answer; q3 asked again in
    another case further down."""
    rows = [(f"what be q{i}", f"answer {i}", "1") for i in range(n)]
    rows += [(f"what be q{i}", f"answer {i + 1}", "0") for i in range(n)]
    return rows + [("WHAT BE Q3", "answer 3", "1")]


def test_insuranceqa_grouped_and_split_by_question(tmp_path, monkeypatch):
    _insuranceqa(tmp_path, _insurance_rows(95))
    random.seed(1)
    first = load_silo(tmp_path, "insuranceqa")
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "other-cache"))  # prepared afresh
    random.seed(2)
    assert load_silo(tmp_path, "insuranceqa") == first  # fixed seed, not the run's
    every = {q.text: (s, q) for s in SPLITS for q in first[s]}
    assert len(every) == 96
    assert every["what be q5"][1] == Question("7", "what be q5", ("answer 5", "answer 6"), (1, 0))
    assert every["what be q3"][0] == every["WHAT BE Q3"][0]  # case variants in one split
    sizes = {s: len({q.text.lower() for q in first[s]}) for s in SPLITS}
    assert sizes == {"train": 75, "dev": 10, "test": 10}  # 10% of 95 distinct questions, rounded half up
    for split in SPLITS:  # file order within a split
        assert [int(q.qid) for q in first[split]] == sorted(int(q.qid) for q in first[split])


def test_insuranceqa_bad_label(tmp_path):
    _insuranceqa(tmp_path, [("q", "a", "1"), ("q", "b", "")])
    with pytest.raises(DataError, match=r"insuranceqa/test\.csv: line 3: expected the label 0 or 1, got ''"):
        load_silo(tmp_path, "insuranceqa")


def test_fiqa_gold_texts_and_mined_negatives(tmp_path):
    _fiqa(tmp_path,
          questions=[("10", "How  are dividends taxed?"), ("11", "No answer text here"), ("12", "Stock splits")],
          rels=[("10", "1"), ("10", "9"), ("11", "8"), ("12", "3"), ("10", "2")],
          answers=[("1", "Dividends  are taxed as income."), ("2", "Qualified dividends are taxed less."),
                   ("3", "A stock split changes share counts."), ("4", "Dividends are taxed as income."),
                   ("5", "Taxes on dividends depend on your bracket; dividends are taxed."),
                   ("6", "Unrelated text about mortgages.")])
    out = load_silo(tmp_path, "fiqa", negatives=2)
    (dividends,) = [q for s in SPLITS for q in out[s] if q.qid == "10"]
    assert dividends.text == "How are dividends taxed?"
    # golds in qrels order (docid 9 has no text); docid 4 repeats gold 1's text: never a negative
    assert _golds(dividends) == ["Dividends are taxed as income.", "Qualified dividends are taxed less."]
    assert _negatives(dividends) == ["Taxes on dividends depend on your bracket; dividends are taxed.",
                                     "A stock split changes share counts."]
    assert sorted(q.qid for s in SPLITS for q in out[s]) == ["10", "12"]  # 11's gold has no text


def test_fiqa_bad_rows(tmp_path):
    _fiqa(tmp_path, [("1", "q")], [("1", "1")], [("1", "a")])
    _write(tmp_path, "fiqa/test_answers.csv", "1\ta\n2\tb\tc\n")
    with pytest.raises(DataError, match=r"fiqa/test_answers\.csv: line 2: expected 2 tab-separated fields, got 3"):
        load_silo(tmp_path, "fiqa")
    _fiqa(tmp_path, [("1", "q")], [("1", "1")], [("1", "a")])
    _write(tmp_path, "fiqa/FiQA_train_question_doc_final.tsv", "qid\tdocid\n1\t1\n")
    with pytest.raises(DataError, match=r"FiQA_train_question_doc_final\.tsv: line 1: expected the header"):
        load_silo(tmp_path, "fiqa")


def test_medquad_pairs_grouped_by_question_with_mined_negatives(tmp_path, monkeypatch):
    _medquad(tmp_path, monkeypatch, {
        "medquad/5_NIDDK_QA/0000001.xml": _medquad_xml(
            ("What is (are) Gout ?", "Gout is a form of\n   arthritis &amp; pain."),
            ("What causes Gout ?", "Uric acid causes gout."),
            ("What is (are) Gout ?", "")),  # no answer: skipped
        "medquad/6_NINDS_QA/0000001.xml": _medquad_xml(
            ("What is (are) Gout ?", "Gout: joint pain from uric acid crystals."),
            ("What is (are) Gout ?", "Uric acid causes gout."),  # another question's answer, gold here too
            ("What to do for Flu ?", "Rest and drink fluids.")),
    })
    out = load_silo(tmp_path, "medquad", negatives=5)
    questions = {q.text: q for s in SPLITS for q in out[s]}
    assert set(questions) == {"What is (are) Gout ?", "What causes Gout ?", "What to do for Flu ?"}
    gout = questions["What is (are) Gout ?"]
    assert gout.qid == "5_NIDDK_QA/0000001-1"
    assert _golds(gout) == ["Gout is a form of arthritis & pain.", "Gout: joint pain from uric acid crystals.",
                            "Uric acid causes gout."]
    assert _negatives(gout) == ["Rest and drink fluids."]  # the pool allows only one
    causes = questions["What causes Gout ?"]
    assert causes.qid == "5_NIDDK_QA/0000001-2" and _golds(causes) == ["Uric acid causes gout."]
    # both gout answers have one "gout" in 7 tokens: a tie, broken by pool (file) order; then no match
    assert _negatives(causes) == ["Gout is a form of arthritis & pain.", "Gout: joint pain from uric acid crystals.",
                                  "Rest and drink fluids."]
    assert [len(_negatives(q)) for q in load_silo(tmp_path, "medquad", negatives=1)["train"]] == [1, 1, 1]


def test_medquad_invalid_xml_names_file_and_line(tmp_path, monkeypatch):
    _medquad(tmp_path, monkeypatch, {"medquad/9_CDC_QA/0000002.xml": "<Document>\n<QAPairs>\n<QAPair></Document>\n"})
    with pytest.raises(DataError, match=r"9_CDC_QA/0000002\.xml: invalid XML: mismatched tag: line 3"):
        load_silo(tmp_path, "medquad")
    _medquad(tmp_path, monkeypatch, {"medquad/9_CDC_QA/0000002.xml": _medquad_xml((" ", "An answer."))})
    with pytest.raises(DataError, match=r"0000002\.xml: QAPair 1 \(pid '1'\) has no question text"):
        load_silo(tmp_path, "medquad")


def test_not_utf8_and_missing_files(tmp_path):
    _insuranceqa(tmp_path, [("q", "a", "1")])
    (tmp_path / "insuranceqa/test.csv").write_bytes(b"question,answer,label\nq\xe9,a,1\n")
    with pytest.raises(DataError, match=r"insuranceqa/test\.csv: not UTF-8"):
        load_silo(tmp_path, "insuranceqa")
    with pytest.raises(DataError, match=r"matching data file not found: .*trecqa/train\.csv"):
        load_silo(tmp_path, "trecqa")


def test_verify_data_dir(tmp_path):
    _insuranceqa(tmp_path, [("q", "a", "1")])
    with pytest.raises(DataError, match=r"matching data file not found: .*trecqa/train\.csv"):
        verify_data_dir(["insuranceqa", "trecqa"], tmp_path)
    with pytest.warns(DataChangedWarning, match=r"not the pinned benchmark files.*insuranceqa/test\.csv"):
        verify_data_dir(["insuranceqa"], tmp_path)


# ---- the prepared-splits cache -------------------------------------------------------------

def test_cache_is_used_rebuilt_when_corrupt_and_keyed_by_content(tmp_path, own_cache, monkeypatch):
    _insuranceqa(tmp_path, [("q one", "a", "1"), ("q one", "b", "0")])
    first = load_silo(tmp_path, "insuranceqa")
    (cached,) = (own_cache / "prepared" / "matching").glob("insuranceqa-*.json.gz")
    assert len(cached.name) == len("insuranceqa-") + 64 + len(".json.gz")

    def refuse(data_dir, negatives):
        raise AssertionError("prepared again")
    prepare = mdata._PREPARE["insuranceqa"]
    monkeypatch.setitem(mdata._PREPARE, "insuranceqa", refuse)
    assert load_silo(tmp_path, "insuranceqa") == first  # from the cache
    monkeypatch.setitem(mdata._PREPARE, "insuranceqa", prepare)

    for corrupt in (b"not gzip", gzip.compress(b'{"version": 1, "splits": {"train": [["q"]]}}'),
                    gzip.compress(json.dumps({"version": 1, "splits": {
                        "train": [["1", "q", ["a"], [2]]], "dev": [], "test": []}}).encode())):
        cached.write_bytes(corrupt)
        assert load_silo(tmp_path, "insuranceqa") == first  # ignored and rewritten
        assert json.loads(gzip.decompress(cached.read_bytes()))["splits"]["train"] == [["2", "q one", ["a", "b"], [1, 0]]]
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temp file left

    load_silo(tmp_path, "insuranceqa", negatives=3)  # another negatives count, another key
    _insuranceqa(tmp_path, [("q two", "a", "1")])  # new content, new key
    assert load_silo(tmp_path, "insuranceqa")["train"] == [Question("2", "q two", ("a",), (1,))]
    assert len(list(cached.parent.glob("insuranceqa-*.json.gz"))) == 3


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    _insuranceqa(tmp_path, [("q", "a", "1")])
    (tmp_path / "blocked").write_text("a file where the cache folder would go")
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "blocked"))
    assert load_silo(tmp_path, "insuranceqa")["train"] == [Question("2", "q", ("a",), (1,))]


def test_manifest_lists_the_needed_files_and_docs():
    sources = datafetch.read_manifest(Path(mdata.__file__).parent / "sources.tsv")
    paths = [s.path for s in sources]
    assert len(paths) == len(set(paths)) == 518
    extra = set(paths) - set(required_files(SILOS))
    assert extra == {"medquad/LICENSE.txt", "medquad/readme.txt", "insuranceqa/LICENSE", "insuranceqa/README.md",
                     "trecqa/README.md", "wikiqa/README.md"}
    assert all(not s.mirror_only and len(s.commit) == 40 for s in sources)


# ---- the real data -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """All five silos (5 negatives), prepared once into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("qa-cache")))
        return {silo: load_silo(QA, silo) for silo in SILOS}


# silo -> split -> (questions, candidates, positives, questions without a positive, ... without a negative)
REAL_COUNTS = {
    "medquad": {"train": (1734, 10672, 2002, 0, 0), "dev": (217, 1332, 247, 0, 0), "test": (217, 1338, 253, 0, 0)},
    "fiqa": {"train": (267, 2005, 670, 0, 0), "dev": (33, 265, 100, 0, 0), "test": (33, 260, 95, 0, 0)},
    "insuranceqa": {"train": (3229, 4036, 2009, 1318, 1678), "dev": (404, 490, 246, 167, 212),
                    "test": (404, 516, 266, 153, 216)},
    "wikiqa": {"train": (873, 8672, 1040, 0, 16), "dev": (126, 1130, 140, 0, 4), "test": (243, 2350, 293, 0, 6)},
    "trecqa": {"train": (93, 4717, 348, 10, 5), "dev": (81, 1148, 222, 3, 13), "test": (95, 1517, 284, 6, 21)},
}


@needs_qa
def test_real_counts(real):
    counts = {silo: {split: (len(qs), sum(len(q.candidates) for q in qs), sum(sum(q.labels) for q in qs),
                             sum(not any(q.labels) for q in qs), sum(all(q.labels) for q in qs))
                     for split, qs in real[silo].items()} for silo in SILOS}
    assert counts == REAL_COUNTS


@needs_qa
def test_real_questions_are_well_formed_and_in_one_split(real):
    for silo, splits in real.items():
        texts = {s: {q.text.lower() for q in splits[s]} for s in SPLITS}
        assert not (texts["train"] & texts["dev"] or texts["train"] & texts["test"] or texts["dev"] & texts["test"]), silo
        for split, questions in splits.items():
            assert len({q.qid for q in questions}) == len(questions), (silo, split)
            for q in questions:
                assert q.text and q.candidates and len(q.candidates) == len(q.labels), (silo, q.qid)
                assert len(set(q.candidates)) == len(q.candidates), (silo, q.qid)
                assert all(c and c == " ".join(c.split()) for c in q.candidates), (silo, q.qid)
                assert set(q.labels) <= {0, 1}


@needs_qa
def test_real_mined_negatives(real):
    for silo in ("medquad", "fiqa"):
        questions = [q for s in SPLITS for q in real[silo][s]]
        pool = list(dict.fromkeys(c for q in questions for c in _golds(q)))
        index = Bm25Index(pool)
        for q in questions:
            golds, negatives = _golds(q), _negatives(q)
            assert list(q.labels) == [1] * len(golds) + [0] * len(negatives), (silo, q.qid)  # golds first
            assert len(negatives) == 5 and not set(negatives) & set(golds), (silo, q.qid)
            assert set(negatives) <= set(pool), (silo, q.qid)
        for q in questions[::50]:  # the negatives are the top BM25 non-gold answers, in rank order
            scores = index.scores(q.text)
            rest = sorted((scores[i] for i, t in enumerate(pool) if t not in q.candidates), reverse=True)
            mined = [scores[pool.index(t)] for t in _negatives(q)]
            assert mined == sorted(mined, reverse=True) and mined[-1] >= rest[0], (silo, q.qid)


@needs_qa
def test_real_spot_checks(real):
    medquad = real["medquad"]["train"][0]
    assert (medquad.qid, medquad.text) == ("5_NIDDK_QA/0000001-1", "What is (are) Acromegaly ?")
    assert medquad.candidates[0].startswith("Acromegaly is a hormonal disorder that results from too much "
                                            "growth hormone (GH) in the body.")
    assert "  " not in medquad.candidates[0] and "&quot;" not in medquad.candidates[0]
    assert real["wikiqa"]["train"][0].text == "how are glacier caves formed ?"
    assert real["wikiqa"]["train"][0].labels == (0, 0, 0, 1, 0)
    trec = real["trecqa"]["train"][0]
    assert trec.text == 'Who is the author of the book , " The Iron Lady : A Biography of Margaret Thatcher " ?'
    assert trec.candidates[0] == "the IRON LADY ; A Biography of Margaret Thatcher by Hugo Young ( Farrar , Straus & Giroux )"
    fiqa = {q.qid: q for s in SPLITS for q in real["fiqa"][s]}
    assert fiqa["14"].text == "What are 'business fundamentals'?"
    assert fiqa["14"].candidates[0].startswith("From http://financial-dictionary.thefreedictionary.com/")


@needs_qa
def test_real_loads_are_deterministic_cold_and_cached(real, own_cache):
    for silo in ("medquad", "fiqa", "insuranceqa"):  # the mined and the randomly split silos
        assert load_silo(QA, silo) == real[silo]  # prepared afresh into this test's cache
        assert load_silo(QA, silo) == real[silo]  # and read back from it
    assert len(list((own_cache / "prepared" / "matching").glob("*.json.gz"))) == 3


@needs_qa
def test_real_files_match_the_manifest(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verify_data_dir(SILOS, QA)
    # the shared data root keeps this task's files under qa/: found without naming that folder
    datafetch.ensure("matching", tmp_path / "copy", mirror=QA.parent, progress=False)
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file())
    assert copied == sorted(s.path for s in datafetch.read_manifest(Path(mdata.__file__).parent / "sources.tsv"))
    assert set(required_files(SILOS)) <= set(copied)
