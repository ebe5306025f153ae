"""The QA and conditional-generation converters (converters/qa.py, converters/generation.py): on the real
sources (pool sizes counted here from the raw files, and records looked up by hand in them), and on a
few raw records in each source's format written to tmp_path."""
import csv
import io
import json
import re
import tarfile

import pytest

from fedsilo.tasks.multitask.catalog import CATALOG, Record, split_80_20
from tests.mtreal import MT, labels, needs_mt, pools


def _lines(rel: str) -> int:
    return len((MT / rel).read_bytes().splitlines())  # bytes: only \n, \r split (a last line may lack \n)


def _split(n: int) -> tuple[int, int]:
    return int(n * 0.8), n - int(n * 0.8)


# --- real sources: pool sizes --------------------------------------------------------------------

def _counted(name: str) -> tuple[int, int]:
    """(train, test) pool sizes from the raw files, counted without the converters' parsing."""
    if name == "codah":
        return _lines("CODAH/data/cv_split/fold_0/train.tsv"), _lines("CODAH/data/cv_split/fold_0/dev.tsv")
    if name == "dream":
        return tuple((MT / f"dream/data/{s}.json").read_text().count('"question":') for s in ("train", "dev"))
    if name == "cosmos_qa":
        return _split(_lines("cosmosqa/data/valid.csv") - 1)  # less the header
    if name == "aqua_rat":
        return _lines("AQuA/test.json"), _lines("AQuA/dev.json")
    if name == "mc_taco":
        return _split(_lines("MCTACO/dataset/dev_3783.tsv"))
    if name == "numer_sense":
        return _split(_lines("NumerSense/data/train.masked.tsv"))
    if name == "proto_qa":
        text = (MT / "protoqa-data/data/dev/dev.scraped.jsonl").read_text()
        return _split(sum(1 for line in text.splitlines() if '"raw": {"' in line))
    if name == "e2e_nlg_cleaned":
        def mrs(rel):  # distinct first columns, quoted or not (the header is one of them)
            return len(set(re.findall(r'^("[^"]*"|[^",]*),', (MT / rel).read_text(), re.M))) - 1
        return mrs("e2e-cleaning/cleaned-data/test-fixed.csv"), mrs("e2e-cleaning/cleaned-data/devel-fixed.no-ol.csv")
    if name == "wiki_split":
        return _lines("wiki-split/tune.tsv"), _lines("wiki-split/validation.tsv")
    if name == "aeslc":
        with tarfile.open(MT / "AESLC/enron_subject_line_dev_test.tar.gz") as tar:
            names = tar.getnames()
        return tuple(sum(n.startswith(f"enron_subject_line/{s}/") and n.endswith(".subject") for n in names)
                     for s in ("test", "dev"))
    raise KeyError(name)


SIZES = {  # what _counted finds in the pinned copies (HF's split sizes where HF has the split)
    "codah": (1665, 556), "dream": (6116, 2040), "cosmos_qa": (2388, 597), "aqua_rat": (254, 254),
    "mc_taco": (3026, 757), "numer_sense": (8355, 2089), "proto_qa": (784, 196),
    "e2e_nlg_cleaned": (1847, 1484), "wiki_split": (5000, 5000), "aeslc": (1906, 1960),
}


@needs_mt
@pytest.mark.parametrize("name", sorted(SIZES))
def test_pool_sizes(name):
    out = pools(name)
    assert _counted(name) == SIZES[name]
    assert (len(out.train), len(out.test)) == SIZES[name]


@needs_mt
def test_catalogue_entries():
    want = {  # name: (group, metric, per_class, in the paper's Table 5)
        "codah": ("qa", "macro_f1", False, True), "dream": ("qa", "acc", False, False),
        "cosmos_qa": ("qa", "acc", False, True), "aqua_rat": ("qa", "acc", False, True),
        "mc_taco": ("qa", "acc", True, True), "numer_sense": ("qa", "em", False, True),
        "proto_qa": ("other", "em", False, True), "e2e_nlg_cleaned": ("other", "rouge_l", False, True),
        "wiki_split": ("generation", "rouge_l", False, False), "aeslc": ("generation", "rouge_l", False, True),
    }
    for name, entry in want.items():
        info = CATALOG.get(name)
        assert (info.group, info.metric, info.per_class, info.in_paper) == entry, name
        assert info.license


@needs_mt
def test_mc_taco_labels():
    out = pools("mc_taco")
    assert labels(out.train) == labels(out.test) == {"yes", "no"}


# --- real sources: records looked up by hand -----------------------------------------------------

DREAM_DIALOGUE = (
    "W: Well, I'm afraid my cooking isn't to your taste. M: Actually, I like it very much. W: I'm glad you "
    "enjoy it. Let me serve you some more fish. M: No, thank you. I've had enough fish, but I'd like some "
    "soup. W: Here it is. Help yourself! M: Thanks. I didn't know you were so good at cooking. If only my "
    "wife could learn to cook from you. W: Why not bring your wife next time? I haven't seen her for quite "
    "a while. M: OK, I will. She will be very glad to see you, too. Thank you for the wonderful meal.")

HAND = [  # (task, pool, input, outputs)
    ("codah", "test",  # fold_0/dev.tsv, line 2
     "A boy is running across a field wearing a green shirt. He (A) smiles because his shirt is bright green. "
     "(B) smiles because his shirt is bright red. (C) is trying to move as slowly as possible. (D) tosses and "
     "turns as he tries to fall asleep.", ("smiles because his shirt is bright green.",)),
    ("dream", "train",  # train.json, dialogue 7-200, second question
     "What does the woman ask the man to do? [SEP] " + DREAM_DIALOGUE
     + " [SEP]  (A) Improve cooking skills. (B) Bring his wife next time. (C) Have some soup.",
     ("Bring his wife next time.",)),
    ("cosmos_qa", "train",  # valid.csv, first row
     "Why is this person asking about divorce ? [SEP] Do i need to go for a legal divorce ? I wanted to marry a "
     "woman but she is not in the same religion , so i am not concern of the marriage inside church . I will do "
     "the marriage registered with the girl who i am going to get married . But legally will there be any "
     "complication , like if the other woman comes back one day , will the girl who i am going to get married "
     "now will be in trouble or Is there any complication ? [SEP]  (A) If he gets married in the church he wo "
     "nt have to get a divorce . (B) He wants to get married to a different person . (C) He wants to know if "
     "he does nt like this girl can he divorce her ? (D) None of the above choices .",
     ("He wants to get married to a different person .",)),
    ("aqua_rat", "train",  # test.json, line 2
     "The original price of an item is discounted 22%. A customer buys the item at this discounted price using "
     "a $20-off coupon. There is no tax on the item, and this was the only item the customer bought. If the "
     "customer paid $1.90 more than half the original price of the item, what was the original price of the "
     "item? (A) $61 (B) $65 (C) $67.40 (D) $70 (E) $78.20", ("$78.20",)),
    ("mc_taco", "test",  # dev_3783.tsv, line 5
     "Islam later emerged as the majority religion during the centuries of Ottoman rule, though a significant "
     "Christian minority remained. [SEP] How long has a significant Christian minority remained? [SEP] "
     "a billion weeks", ("no",)),
    ("numer_sense", "train", "Latin verbs have [MASK] principal parts.", ("four",)),  # line 3
    ("proto_qa", "test",  # dev.scraped.jsonl, dev-scraped_q13: {"director": 0, "producer": 34}
     "besides the actors, tell me someone whose name appears at the end of the movie.", ("producer", "director")),
    ("e2e_nlg_cleaned", "train",  # test-fixed.csv, lines 2-3
     "name[Blue Spice], eatType[coffee shop], area[city centre]",
     ("A coffee shop in the city centre area called Blue Spice.", "Blue Spice is a coffee shop in city centre.")),
    ("wiki_split", "train",  # tune.tsv, line 3
     "sentence 1: ' Skycruiser ' seating is available on Boeing 777 - 200s and Boeing 777 - 300s . [SEP] "
     "sentence 2: It features seats that extend to flat beds using integrated passenger seat control , along "
     "with the ICE system and a screen .",
     ("' Skycruiser ' seating is available on the remaining 12 Boeing 777 - 300ERs , Boeing 777 - 200s and "
      "Boeing 777 - 300s feature seat that extend to flat beds using integrated passenger seat control , along "
      "with the ICE system and a screen .",)),
    ("aeslc", "test",  # dev/allen-p_inbox_29.subject
     "summarize: Hi Phillip, This message is to confirm our meeting with you on, Tuesday, October 30th from "
     "9:00 am - 10:00 am, the location will be EB 3267. Attendees will be Monica Brown and Sheri Righi. Let me "
     "know if you have any questions. I can be reached at 713-345-6687. Thanks,",
     ("Confirmation: Risk Management Simulation Meeting 10/30/01",)),
]


@needs_mt
@pytest.mark.parametrize("name,pool,text,outputs", HAND, ids=[h[0] for h in HAND])
def test_record_looked_up_by_hand(name, pool, text, outputs):
    assert Record(text, outputs) in getattr(pools(name), pool)


# --- synthetic raw records in each source's format ----------------------------------------------

def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _convert(name, root):
    return CATALOG.get(name).convert(root)


def test_codah_synthetic(tmp_path):
    _write(tmp_path, "CODAH/data/cv_split/fold_0/train.tsv", 'o\tA dog\tbarks.\tmeows.\t"flies" away.\tswims.\t0\n')
    _write(tmp_path, "CODAH/data/cv_split/fold_0/dev.tsv", "n\tA  cat\\n\tbarks.\tmeows.\tflies.\tswims.\t1\n")
    out = _convert("codah", tmp_path)
    assert out.train == [Record("A dog (A) barks. (B) meows. (C) flies away. (D) swims.", ("barks.",))]
    assert out.test == [Record("A cat (A) barks. (B) meows. (C) flies. (D) swims.", ("meows.",))]


def test_dream_synthetic(tmp_path):
    dialogue = [["M: Hi.", "W: Hello\nthere."],
                [{"question": "Who?", "choice": ["a", "b", "c"], "answer": "b"},
                 {"question": "Why?", "choice": ["x", "y", "z"], "answer": "z"}], "1-1"]
    _write(tmp_path, "dream/data/train.json", json.dumps([dialogue]))
    _write(tmp_path, "dream/data/dev.json", json.dumps([dialogue[:1] + [dialogue[1][:1]] + ["1-2"]]))
    out = _convert("dream", tmp_path)
    first = Record("Who? [SEP] M: Hi. W: Hello there. [SEP]  (A) a (B) b (C) c", ("b",))
    assert out.train == [first, Record("Why? [SEP] M: Hi. W: Hello there. [SEP]  (A) x (B) y (C) z", ("z",))]
    assert out.test == [first]


def test_cosmos_qa_synthetic(tmp_path):
    rows = [[f"id{i}", f"Context {i}\n.", f"Q{i} ?", "a0", "a1", "a2", "a3", str(i % 4)] for i in range(5)]
    buf = io.StringIO()
    csv.writer(buf).writerows([["id", "context", "question", "answer0", "answer1", "answer2", "answer3", "label"]]
                              + rows)
    _write(tmp_path, "cosmosqa/data/valid.csv", buf.getvalue())
    want = [Record(f"Q{i} ? [SEP] Context {i} . [SEP]  (A) a0 (B) a1 (C) a2 (D) a3", (f"a{i % 4}",))
            for i in range(5)]
    out = _convert("cosmos_qa", tmp_path)
    assert (out.train, out.test) == split_80_20(want) and out.note


def test_aqua_rat_synthetic(tmp_path):
    problem = {"question": "1 + 1\n= ?", "options": ["A)1", "B)2", "C)3", "D)4", "E)5"], "rationale": "r",
               "correct": "B"}
    _write(tmp_path, "AQuA/test.json", json.dumps(problem) + "\n")
    _write(tmp_path, "AQuA/dev.json", json.dumps(problem | {"correct": "E"}) + "\n")
    out = _convert("aqua_rat", tmp_path)
    text = "1 + 1 = ? (A) 1 (B) 2 (C) 3 (D) 4 (E) 5"
    assert out.train == [Record(text, ("2",))] and out.test == [Record(text, ("5",))]


def test_mc_taco_synthetic(tmp_path):
    lines = [f"S {i}.\tQ {i}?\tanswer {i}\t{'yes' if i % 2 else 'no'}\tFrequency" for i in range(5)]
    _write(tmp_path, "MCTACO/dataset/dev_3783.tsv", "\n".join(lines) + "\n")
    want = [Record(f"S {i}. [SEP] Q {i}? [SEP] answer {i}", ("yes" if i % 2 else "no",)) for i in range(5)]
    out = _convert("mc_taco", tmp_path)
    assert (out.train, out.test) == split_80_20(want)


def test_numer_sense_synthetic(tmp_path):
    _write(tmp_path, "NumerSense/data/train.masked.tsv",
           "".join(f"a cat has <mask> legs {i}.\tfour\n" for i in range(5)))
    want = [Record(f"a cat has [MASK] legs {i}.", ("four",)) for i in range(5)]
    out = _convert("numer_sense", tmp_path)
    assert (out.train, out.test) == split_80_20(want)


def test_proto_qa_synthetic(tmp_path):
    def question(i, raw):
        return json.dumps({"metadata": {"id": f"q{i}"}, "question": {"original": "X", "normalized": f"name {i}."},
                           "answers": {"raw": raw, "clusters": {}}, "num": {}})
    raws = [{"b": 1, "a": 5, "c": 5}, {"x": 2}, {}, {" ": 3, "y": 1}, {"p": 0, "q": 0}, {"m": 1}]
    _write(tmp_path, "protoqa-data/data/dev/dev.scraped.jsonl",
           "\n".join(question(i, raw) for i, raw in enumerate(raws)) + "\n\n")
    want = [Record("name 0.", ("a", "c", "b")), Record("name 1.", ("x",)), Record("name 3.", ("y",)),
            Record("name 4.", ("p", "q")), Record("name 5.", ("m",))]  # no answers: left out
    out = _convert("proto_qa", tmp_path)
    assert (out.train, out.test) == split_80_20(want)


def test_e2e_synthetic(tmp_path):
    head = "mr,ref,fixed,orig_mr\n"
    _write(tmp_path, "e2e-cleaning/cleaned-data/test-fixed.csv",
           head + '"name[A], food[Thai]","A serves\nThai.",0,x\n"name[B]",B.,1,y\n'
           '"name[A], food[Thai]",Thai at A.,0,x\n')
    _write(tmp_path, "e2e-cleaning/cleaned-data/devel-fixed.no-ol.csv", head + '"name[C]",C is here.,0,z\n')
    out = _convert("e2e_nlg_cleaned", tmp_path)
    assert out.train == [Record("name[A], food[Thai]", ("A serves Thai.", "Thai at A.")), Record("name[B]", ("B.",))]
    assert out.test == [Record("name[C]", ("C is here.",))]


def test_wiki_split_synthetic(tmp_path):
    _write(tmp_path, "wiki-split/tune.tsv", "A and B .\tA . <::::> B .\n")
    _write(tmp_path, "wiki-split/validation.tsv", "C , D .\tC . <::::> D .\n")
    out = _convert("wiki_split", tmp_path)
    assert out.train == [Record("sentence 1: A . [SEP] sentence 2: B .", ("A and B .",))]
    assert out.test == [Record("sentence 1: C . [SEP] sentence 2: D .", ("C , D .",))]


def test_aeslc_synthetic(tmp_path):
    files = {
        "enron_subject_line/dev/b.subject": "Hi,  see\tthe plan.\nThanks,\n\n@subject\nPlan\n\n@ann0\nplan\n",
        "enron_subject_line/dev/a.subject": "Body a.\n\n@subject\nRe: a\n\n@ann0\na\n\n@ann1\nx\n",
        "enron_subject_line/test/c.subject": "Body c.\n\n@subject\nC\n\n@ann0\nc\n",
        "README.md": "not an email",
    }
    path = tmp_path / "AESLC/enron_subject_line_dev_test.tar.gz"
    path.parent.mkdir(parents=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = _convert("aeslc", tmp_path)
    assert out.train == [Record("summarize: Body c.", ("C",))]
    assert out.test == [Record("summarize: Body a.", ("Re: a",)),  # name order, as HF's sorted glob
                        Record("summarize: Hi, see the plan. Thanks,", ("Plan",))]
