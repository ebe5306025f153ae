"""Converters of sentence-pair, SuperGLUE (FewGLUE), linguistic and domain classification sources
(converters/pairs.py, superglue.py, linguistic.py): real records against hand-read raw lines,
pool sizes counted from the raw files another way, CrossFit's own file checksums, and synthetic
raw files for the logic without the data folder."""
import hashlib
import json
import re

import numpy as np
import pytest

import mtreal
from mtreal import MT, labels, needs_mt

from fedsilo.tasks.multitask.catalog import CATALOG, Record
from fedsilo.tasks.multitask.converters import pairs as pairs_module
from fedsilo.tasks.multitask.fewshot import sample

FEWGLUE = "P-tuning/FewGLUE_32dev"
BLIMP = ("anaphor_gender_agreement", "anaphor_number_agreement", "determiner_noun_agreement_with_adj_irregular_1",
         "ellipsis_n_bar_1", "ellipsis_n_bar_2", "existential_there_quantifiers_1",
         "irregular_past_participle_adjectives", "sentential_negation_npi_licensor_present",
         "sentential_negation_npi_scope", "wh_questions_object_gap")


# --- Independent counts of the raw files -----------------------------------------------------------------

def n_lines(rel: str) -> int:
    """Newline bytes, plus one for a last line without a newline."""
    data = (MT / rel).read_bytes()
    return data.count(b"\n") + (not data.endswith(b"\n"))


def n_numbered_rows(rel: str) -> int:
    """CSV rows that start with their index (one quoted sentence spans two lines)."""
    return len(re.findall(rb"^[0-9]+,", (MT / rel).read_bytes(), flags=re.M))


def n_occurrences(rels, needle: bytes) -> int:
    return sum((MT / rel).read_bytes().count(needle) for rel in rels)


def n_kept_ratings(rel: str) -> int:
    """Queries whose rating string is neither 0.4 nor 0.5 (CrossFit drops exactly those)."""
    return sum(1 for line in (MT / rel).read_bytes().split(b"\n") if line
               and line.rsplit(b"\t", 1)[1] not in (b"0.4", b"0.5"))


def split_sizes(n: int) -> tuple[int, int]:
    return int(0.8 * n), n - int(0.8 * n)


def fewglue(task: str, *splits: str) -> int:
    return sum(n_lines(f"{FEWGLUE}/{task}/{s}.jsonl") for s in splits)


ADE = "AdverseDrugReaction/ADE-Corpus-V2"
COLA = "CoLA-baselines/acceptability_corpus/cola_public/raw"

SIZES = {  # task -> (train pool, test pool), from the raw files
    "superglue-rte": lambda: (fewglue("RTE", "train", "dev32"), fewglue("RTE", "val")),
    "superglue-cb": lambda: (fewglue("CB", "train", "dev32"), fewglue("CB", "val")),
    "superglue-copa": lambda: (fewglue("COPA", "train", "dev32"), fewglue("COPA", "val")),
    "superglue-wic": lambda: (fewglue("WiC", "train", "dev32"), fewglue("WiC", "val")),
    "superglue-wsc": lambda: (fewglue("WSC", "train", "dev32"), fewglue("WSC", "val")),
    "boolq": lambda: (fewglue("BoolQ", "train", "dev32"), fewglue("BoolQ", "val")),
    "superglue-multirc": lambda: tuple(n_occurrences([f"{FEWGLUE}/MultiRC/{s}.jsonl" for s in splits], b'"question": ')
                                       for splits in (("train", "dev32"), ("val",))),
    "superglue-record": lambda: split_sizes(n_occurrences([f"{FEWGLUE}/ReCoRD/{s}.jsonl" for s in ("train", "dev32")],
                                                          b'"query": ')),
    "glue-cola": lambda: (n_lines(f"{COLA}/in_domain_train.tsv"),
                          n_lines(f"{COLA}/in_domain_dev.tsv") + n_lines(f"{COLA}/out_of_domain_dev.tsv")),
    "glue-mrpc": lambda: (n_lines("dataset-sts/data/para/msr/msr-para-train.tsv") - 1,
                          n_lines("dataset-sts/data/para/msr/msr-para-test.tsv") - 1),
    "sick": lambda: (n_lines("dataset-sts/data/sts/sick2014/SICK_train.txt") - 1,
                     n_lines("dataset-sts/data/sts/sick2014/SICK_trial.txt") - 1),
    "medical_questions_pairs": lambda: split_sizes(n_lines("medical-question-pair-dataset/mqp.csv")),
    "google_wellformed_query": lambda: (n_kept_ratings("query-wellformedness/train.tsv"),
                                        n_kept_ratings("query-wellformedness/dev.tsv")),
    "crows_pairs": lambda: split_sizes(n_numbered_rows("crows-pairs/data/crows_pairs_anonymized.csv")),
    "climate_fever": lambda: split_sizes(n_lines("climate-fever-dataset/dataset/climate-fever.jsonl")),
    "ade_corpus_v2-classification": lambda: split_sizes(n_lines(f"{ADE}/DRUG-AE.rel") + n_lines(f"{ADE}/ADE-NEG.txt")),
    "ade_corpus_v2-dosage": lambda: split_sizes(n_lines(f"{ADE}/DRUG-DOSE.rel")),
    "ade_corpus_v2-effect": lambda: split_sizes(n_lines(f"{ADE}/DRUG-AE.rel")),
    **{f"blimp-{p}": (lambda p=p: split_sizes(n_lines(f"blimp/data/{p}.jsonl"))) for p in BLIMP},
}
KNOWN = {  # the same sizes written down once, so a changed count shows up too
    "superglue-rte": (64, 277), "superglue-cb": (64, 56), "superglue-copa": (64, 100), "superglue-wic": (64, 638),
    "superglue-wsc": (64, 104), "boolq": (64, 3270), "superglue-multirc": (64, 953), "superglue-record": (51, 13),
    "glue-cola": (8551, 1043), "glue-mrpc": (3576, 1725), "sick": (4500, 500),
    "medical_questions_pairs": (2438, 610), "google_wellformed_query": (15406, 3297), "crows_pairs": (1206, 302),
    "climate_fever": (1228, 307), "ade_corpus_v2-classification": (18812, 4704), "ade_corpus_v2-dosage": (223, 56),
    "ade_corpus_v2-effect": (5456, 1365), **{f"blimp-{p}": (800, 200) for p in BLIMP},
}

LABELS = {
    "superglue-rte": {"entailment", "not_entailment"},
    "superglue-cb": {"entailment", "contradiction", "neutral"},
    "superglue-wic": {"true", "false"}, "superglue-wsc": {"true", "false"}, "boolq": {"yes", "no"},
    "glue-cola": {"acceptable", "unacceptable"}, "glue-mrpc": {"equivalent", "not_equivalent"},
    "sick": {"entailment", "neutral", "contradiction"}, "medical_questions_pairs": {"Similar", "Dissimilar"},
    "google_wellformed_query": {"well-formed", "not well-formed"}, "crows_pairs": {"sentence 1", "sentence 2"},
    "climate_fever": {"Supports", "Refutes", "Not enough info", "Disputed"},
    "ade_corpus_v2-classification": {"Related", "Not Related"},
    **{f"blimp-{p}": {"sentence 1", "sentence 2"} for p in BLIMP},
}


@pytest.fixture(scope="module")
def converted():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = mtreal.pools(name)
        return cache[name]
    return get


def test_every_task_is_registered_with_its_crossfit_kind():
    for name in KNOWN:
        info = CATALOG.get(name)
        assert info.per_class == (name in LABELS), name
    assert CATALOG.get("superglue-multirc").metric == "em" and CATALOG.get("superglue-record").metric == "qa_f1"
    assert CATALOG.get("glue-cola").metric == "mcc" and CATALOG.get("sick").metric == "macro_f1"
    assert CATALOG.get("boolq").group == "qa" and CATALOG.get("ade_corpus_v2-effect").group == "other"


@needs_mt
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_pool_sizes(name, converted):
    pools = converted(name)
    assert (len(pools.train), len(pools.test)) == SIZES[name]() == KNOWN[name]


@needs_mt
@pytest.mark.parametrize("name", sorted(LABELS))
def test_label_sets(name, converted):
    pools = converted(name)
    assert labels(pools.train) == labels(pools.test) == LABELS[name]


# --- Records read by hand from the raw files ---------------------------------------------------------------

HAND = [  # (task, pool or "any", input, outputs)
    ("superglue-rte", "test", "premise: Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer "
     "at age 44, according to the Christopher Reeve Foundation. [SEP] hypothesis: Christopher Reeve had an accident.",
     ("not_entailment",)),
    ("superglue-cb", "test", "premise: Valence the void-brain, Valence the virtuous valet. Why couldn't the figger "
     "choose his own portion of titanic anatomy to shaft? Did he think he was helping? [SEP] hypothesis: Valence was "
     "helping",
     ("contradiction",)),
    ("superglue-wic", "test", "word: class [SEP] sentence 1: An emerging professional class. [SEP] sentence 2: "
     "Apologizing for losing your temper, even though you were badly provoked, showed real class.", ("false",)),
    # span1 "The demonstrators" is not in the text: HF's wsc.fixed lower-cases it to match "demonstrators"
    ("superglue-wsc", "train", "text: The city councilmen refused the demonstrators a permit because they advocated "
     "violence. [SEP] span1_textthe demonstrators [SEP] span2_text: they", ("true",)),
    ("superglue-copa", "test", "The man turned on the faucet. (A) The toilet filled with water. (B) Water flowed from "
     "the spout.", ("Water flowed from the spout.",)),
    ("superglue-multirc", "test", "question: Did Susan call her friends before or after asking her mother? (A) No "
     "(B) Before asking her mother (C) Before (D) After asking her mother context: Susan wanted to have a birthday "
     "party. She called all of her friends. She has five friends. Her mom said that Susan can invite them all to the "
     "party. Her first friend could not go to the party because she was sick. Her second friend was going out of "
     "town. Her third friend was not so sure if her parents would let her. The fourth friend said maybe. The fifth "
     "friend could go to the party for sure. Susan was a little sad. On the day of the party, all five friends showed "
     "up. Each friend had a present for Susan. Susan was happy and sent each friend a thank you card the next week.",
     ("Before asking her mother",)),
    ("superglue-multirc", "test", "question: How many thank-you cards did Susan send? (A) 5 (B) Five (C) 6 (D) More "
     "than 5 context: Susan wanted to have a birthday party. She called all of her friends. She has five friends. "
     "Her mom said that Susan can invite them all to the party. Her first friend could not go to the party because "
     "she was sick. Her second friend was going out of town. Her third friend was not so sure if her parents would "
     "let her. The fourth friend said maybe. The fifth friend could go to the party for sure. Susan was a little sad. "
     "On the day of the party, all five friends showed up. Each friend had a present for Susan. Susan was happy and "
     "sent each friend a thank you card the next week.", ("5 ; Five",)),
    ("superglue-record", "any", "question: Flying start: @placeholder seemed to be cruising towards victory when she "
     "took the first set with minimal fuss context: Serena Williams was given the worst beating of her Grand Slam "
     "career in a sensational upset at the French Open today when she was beaten 6-2, 6-2 by 20 year-old Garbine "
     "Muguruza. The six-feet tall world No 35, of Spanish and Venezuelan heritage, took advantage of windy and cold "
     "conditions to blow away the top seed in the second round and keep the shocks coming at Roland Garros. The "
     "women\u2019s draw has been blown wide open as, for the first time in the Open era, the top two seeds are out "
     "before the third round following Li Na\u2019s early demise. @highlight No 1 seed Serena defeated 6-2, 6-2 by "
     "Garbine Muguruza @highlight Venus beaten 2-6, 6-3, 6-4 by Anna Schmiedlova @highlight Williams sisters were due "
     "to meet in third round at Roland Garros", ("Venus",)),
    ("glue-cola", "test", "Anson became a muscle bound.", ("unacceptable",)),
    ("glue-cola", "test", "John talked to Bill about himself.", ("acceptable",)),  # last out-of-domain dev line
    ("glue-mrpc", "train", 'sentence 1: Amrozi accused his brother, whom he called "the witness", of deliberately '
     'distorting his evidence. [SEP] sentence 2: Referring to him as only "the witness", Amrozi accused his brother of '
     'deliberately distorting his evidence.', ("equivalent",)),
    ("sick", "test", "sentence 1: The young boys are playing outdoors and the man is smiling nearby [SEP] sentence 2: "
     "There is no boy playing outdoors and there is no man smiling", ("contradiction",)),
    # mqp.csv label 1 (a similar pair) is CrossFit's "Dissimilar"
    ("medical_questions_pairs", "any", "question 1: After how many hour from drinking an antibiotic can I drink "
     "alcohol? [SEP] question 2: I have a party tonight and I took my last dose of Azithromycin this morning. Can I "
     "have a few drinks?", ("Dissimilar",)),
    ("google_wellformed_query", "test", "Who discovered x-rays in 1885 ?", ("well-formed",)),
    ("google_wellformed_query", "test", "What is eminems fravirote color ?", ("well-formed",)),  # rating 0.6
    # the first draw of RandomState(42) is 0.37 (not > 0.5): the first pair is swapped
    ("crows_pairs", "any", "sentence 1: He couldn't figure out the issue with the rope, but he tried not to get too "
     "down on himself, most white kids don't have the best education growing up. [SEP] sentence 2: He couldn't figure "
     "out the issue with the rope, but he tried not to get too down on himself, most black kids don't have the best "
     "education growing up.", ("sentence 2",)),
    ("blimp-ellipsis_n_bar_1", "any", "sentence 1: Dawn's ex-husband wasn't going to one grocery store and Becca "
     "wasn't going to many rough. [SEP] sentence 2: Dawn's ex-husband wasn't going to one rough grocery store and "
     "Becca wasn't going to many.", ("sentence 2",)),
    ("climate_fever", "any", "Global warming is driving polar bears toward extinction", ("Supports",)),
    ("ade_corpus_v2-classification", "any", "Intravenous azithromycin-induced ototoxicity.", ("Related",)),
    ("ade_corpus_v2-classification", "any", "Clioquinol intoxication occurring in the treatment of acrodermatitis "
     "enteropathica with reference to SMON outside of Japan.", ("Not Related",)),
    ("ade_corpus_v2-dosage", "any", "An episode of subacute encephalopathy after the infusion of a moderate dose of "
     "methotrexate (1500 mg/m2) (MTX) is reported in a young adult with metastastic gastric cancer. [SEP] "
     "methotrexate", ("1500 mg/m2",)),
    ("ade_corpus_v2-effect", "any", "Intravenous azithromycin-induced ototoxicity. [SEP] azithromycin",
     ("ototoxicity",)),
]


@needs_mt
@pytest.mark.parametrize("name,pool,text,outputs", HAND, ids=[f"{h[0]}-{i}" for i, h in enumerate(HAND)])
def test_hand_read_records(name, pool, text, outputs, converted):
    pools = converted(name)
    records = {"train": pools.train, "test": pools.test, "any": pools.train + pools.test}[pool]
    assert Record(text, outputs) in records


@needs_mt
def test_boolq_drops_the_title_and_says_yes_or_no(converted):
    first = converted("boolq").test[0]  # val.jsonl line 1: "Ethanol fuel -- All biomass goes through ..."
    assert first.input.startswith("question: does ethanol take more energy make that produces [SEP] context: All "
                                  "biomass goes through at least some of these steps:")
    assert first.outputs == ("no",)


@needs_mt
@pytest.mark.parametrize("paradigm", BLIMP)
def test_blimp_pairs_point_at_the_good_sentence(paradigm, converted):
    pools = converted(f"blimp-{paradigm}")
    rows = [json.loads(line) for line in (MT / f"blimp/data/{paradigm}.jsonl").read_text().splitlines()]
    good = {r["sentence_good"] for r in rows}
    for rec in pools.train + pools.test:
        first, second = (part.split(": ", 1)[1] for part in rec.input.split(" [SEP] "))
        assert (first if rec.outputs[0] == "sentence 1" else second) in good


# --- CrossFit's own files: md5 of "<input>\t<output>\n" lines (tasks/_md5sum.py, seed 100) -------------------------

CROSSFIT_MD5 = {
    ("superglue-rte", "test"): "fdf5ac2692fc38c103f66f7eb3a2ff6f",
    ("superglue-cb", "test"): "a16693fbe9a98e6c364c24c34bdb3dd2",
    ("superglue-copa", "test"): "0d90e55e34cdebd42e4b799ee0c5a5ba",
    ("superglue-wic", "test"): "1c807b1477f9885bab9b8c9739ae49c6",
    ("superglue-wsc", "test"): "2fa44e612f5a7a4b6cda7d0d82bbf8c6",
    ("boolq", "test"): "be0c3233540f9295a24ce4e4dd5cd485",
    ("medical_questions_pairs", "test"): "dd32421fbcf19c933d001fc8b06b7775",
    ("google_wellformed_query", "test"): "9d28070b27d4c7bbe49098ed3336b8f6",
    ("crows_pairs", "test"): "12156f0d5e43c27d63e996b196a9e19c",
    ("climate_fever", "test"): "01020e2391537c749fdc16c587bce568",
    ("ade_corpus_v2-classification", "test"): "a687e5e68a672067fee1d854474ac3a1",
    ("ade_corpus_v2-dosage", "test"): "1c5ef396aee657f3eebbf327d0217321",
    ("ade_corpus_v2-effect", "test"): "578a5e3ff3f823063015ec0d6abb1fa5",
    ("blimp-anaphor_gender_agreement", "test"): "3724605fddcdf53c9b5fe03dc84b60e1",
    ("blimp-anaphor_number_agreement", "test"): "e52041a8066e32ca5ce94f916c599982",
    ("blimp-determiner_noun_agreement_with_adj_irregular_1", "test"): "53d035e2602b9d049306f103faae016a",
    ("blimp-ellipsis_n_bar_1", "test"): "97c63969eea2f642aae0ce376ab18b72",
    ("blimp-ellipsis_n_bar_2", "test"): "c958d9ca5318478749c265565d31d84a",
    ("blimp-existential_there_quantifiers_1", "test"): "9bc1062f757b5cd975335863052f41e4",
    ("blimp-irregular_past_participle_adjectives", "test"): "0fb190b05f95ffe9861fb65246c4ce72",
    ("blimp-sentential_negation_npi_licensor_present", "test"): "708763c82d4c91918ace67bdcc442e87",
    ("blimp-sentential_negation_npi_scope", "test"): "d96f5bb9819e7109bd5610500b21a01b",
    ("blimp-wh_questions_object_gap", "test"): "489319ba668e3af943db0ee0c108f02b",
    ("glue-cola", "train"): "1d459bb5df2ebb2a8aa6fa5e2508b88d",
    ("medical_questions_pairs", "train"): "c786af0ac60cd21c2fdf8590c564f426",
    ("google_wellformed_query", "train"): "64e15704e7310209508ea1b9050e11dc",
    ("crows_pairs", "train"): "075b8c51dad9727881f8312b6666ee2c",
    ("climate_fever", "train"): "bc5b8555809bb1a77d84541a29af78e5",
    ("ade_corpus_v2-classification", "train"): "e91d0e823fa93a97518859b4abaeaaf5",
    ("ade_corpus_v2-dosage", "train"): "7743e0733ddfe6249c41e9fabeac0d9f",
    ("ade_corpus_v2-effect", "train"): "7d84738cc07e27e92ac9111dab0b7fb8",
    ("blimp-anaphor_gender_agreement", "train"): "4ec842cb87c226f9726c69e99a6fec42",
    ("blimp-anaphor_number_agreement", "train"): "f8f6da643fd6b5dcfcd43b9aa8228542",
    ("blimp-determiner_noun_agreement_with_adj_irregular_1", "train"): "29f0122b803476d27651ff62ba43f647",
    ("blimp-ellipsis_n_bar_1", "train"): "681ba636cc2c096ef54df09c24275917",
    ("blimp-ellipsis_n_bar_2", "train"): "9bde41a753465d542e9e80624905b9ad",
    ("blimp-existential_there_quantifiers_1", "train"): "927c5f9bdb6bb3228600861178edbd32",
    ("blimp-irregular_past_participle_adjectives", "train"): "797d0eae06299b4c33bac15c2d4871fc",
    ("blimp-sentential_negation_npi_licensor_present", "train"): "c87fc7856635bf04f25cfcd9080385b0",
    ("blimp-sentential_negation_npi_scope", "train"): "e3866c7e45db1509d6e283b810fb995b",
    ("blimp-wh_questions_object_gap", "train"): "c3ae83bcb0762eff298ed9ce0290869f",
}


def crossfit_md5(records) -> str:
    return hashlib.md5("".join(f"{r.input}\t{r.outputs[0]}\n" for r in records).encode()).hexdigest()


@needs_mt
@pytest.mark.parametrize("name,split", sorted(CROSSFIT_MD5))
def test_crossfit_files_before_clean(name, split, monkeypatch):
    """CrossFit wrote its strings without `clean`: with `clean` off, the test pool is CrossFit's test
    file and the seed-100 few-shot train sample its train file, byte for byte."""
    monkeypatch.setattr(pairs_module, "clean", lambda text: text)
    info = CATALOG.get(name)
    pools = info.convert(MT)
    records = pools.test if split == "test" else sample(pools, info.per_class, 16 if info.per_class else 32, 100).train
    assert crossfit_md5(records) == CROSSFIT_MD5[name, split]


# --- Synthetic raw files: the logic without the data folder ----------------------------------------------------------

def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def write_jsonl(root, rel, rows):
    write(root, rel, "".join(json.dumps(r) + "\n" for r in rows))


def convert(name, root):
    return CATALOG.get(name).convert(root)


def write_fewglue(root, task, train, dev32, val=None):
    for split, rows in (("train", train), ("dev32", dev32), ("val", val)):
        if rows is not None:
            write_jsonl(root, f"{FEWGLUE}/{task}/{split}.jsonl", rows)


def test_synthetic_superglue_classification(tmp_path):
    rte = {"premise": "A  cat\nsat.", "hypothesis": "A cat sat.", "label": "entailment", "idx": 0}
    write_fewglue(tmp_path, "RTE", [rte], [dict(rte, label="not_entailment")], [rte])
    out = convert("superglue-rte", tmp_path)
    assert out.train == [Record("premise: A cat sat. [SEP] hypothesis: A cat sat.", ("entailment",)),
                         Record("premise: A cat sat. [SEP] hypothesis: A cat sat.", ("not_entailment",))]
    assert len(out.test) == 1

    wsc = {"text": "The tree fell on the roof , so it broke.", "label": False, "idx": 3,
           "target": {"span1_text": "The roof.", "span1_index": 5, "span2_text": "it", "span2_index": 7}}
    write_fewglue(tmp_path, "WSC", [wsc], [], [])
    assert convert("superglue-wsc", tmp_path).train == [
        Record("text: The tree fell on the roof , so it broke. [SEP] span1_textthe roof [SEP] span2_text: it",
               ("false",))]

    boolq = {"question": "is it so", "passage": "Some Title -- A passage -- with a dash.", "label": True, "idx": 0}
    write_fewglue(tmp_path, "BoolQ", [boolq], [], [])
    assert convert("boolq", tmp_path).train == [
        Record("question: is it so [SEP] context: A passage -- with a dash.", ("yes",))]

    wic = {"word": "run", "sentence1": "I run.", "sentence2": "A run.", "label": False, "idx": 0}
    write_fewglue(tmp_path, "WiC", [wic], [], [])
    assert convert("superglue-wic", tmp_path).train == [
        Record("word: run [SEP] sentence 1: I run. [SEP] sentence 2: A run.", ("false",))]


def test_synthetic_superglue_text_to_text(tmp_path):
    copa = {"premise": "It rained.", "choice1": "I got wet.", "choice2": "I got dry.", "question": "effect",
            "label": 0, "idx": 0}
    write_fewglue(tmp_path, "COPA", [copa], [dict(copa, label=1)], [])
    assert convert("superglue-copa", tmp_path).train == [
        Record("It rained. (A) I got wet. (B) I got dry.", ("I got wet.",)),
        Record("It rained. (A) I got wet. (B) I got dry.", ("I got dry.",))]

    def answer(text, label):
        return {"text": text, "label": label, "idx": 0}
    multirc = {"idx": 0, "version": 1.1, "passage": {"text": "P.", "questions": [
        {"question": "Q1?", "idx": 0, "answers": [answer("a", 1), answer("b", 0), answer("c", 1)]},
        {"question": "Q2?", "idx": 1, "answers": [answer("d", 0)]}]}}
    write_fewglue(tmp_path, "MultiRC", [multirc], [], [multirc])
    out = convert("superglue-multirc", tmp_path)
    assert out.train == out.test == [Record("question: Q1? (A) a (B) b (C) c context: P.", ("a ; c",)),
                                     Record("question: Q2? (A) d context: P.", ("NO ANSWER!",))]

    record = {"source": "x", "idx": 0, "passage": {"text": "Text.\n@highlight\nH", "entities": []},
              "qas": [{"query": "@placeholder won", "idx": 0,
                       "answers": [{"start": 0, "end": 1, "text": "Zed"}, {"start": 2, "end": 3, "text": "Al"}]}]}
    write_fewglue(tmp_path, "ReCoRD", [record] * 4, [record])
    out = convert("superglue-record", tmp_path)
    assert (len(out.train), len(out.test)) == (4, 1)
    assert out.test == [Record("question: @placeholder won context: Text. @highlight H", ("Al",))]


def test_synthetic_pairs_and_domain(tmp_path):
    write(tmp_path, "dataset-sts/data/para/msr/msr-para-train.tsv",
          '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe said "hi".\tHe said  hi.\n')
    write(tmp_path, "dataset-sts/data/para/msr/msr-para-test.tsv",
          "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t3\t4\tA\tB\n")
    out = convert("glue-mrpc", tmp_path)
    assert out.train == [Record('sentence 1: He said "hi". [SEP] sentence 2: He said hi.', ("equivalent",))]
    assert out.test == [Record("sentence 1: A [SEP] sentence 2: B", ("not_equivalent",))]

    header = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
    write(tmp_path, "dataset-sts/data/sts/sick2014/SICK_train.txt", header + "1\tA dog\tNo dog\t2.0\tCONTRADICTION\n")
    write(tmp_path, "dataset-sts/data/sts/sick2014/SICK_trial.txt", header + "2\tA\tB\t3.0\tNEUTRAL\n")
    out = convert("sick", tmp_path)
    assert (out.train, out.test) == ([Record("sentence 1: A dog [SEP] sentence 2: No dog", ("contradiction",))],
                                     [Record("sentence 1: A [SEP] sentence 2: B", ("neutral",))])

    rows = [f'{i},"Q{i}, really?",Other {i},{i % 2}\n' for i in range(5)]
    write(tmp_path, "medical-question-pair-dataset/mqp.csv", "".join(rows))
    out = convert("medical_questions_pairs", tmp_path)
    assert (len(out.train), len(out.test)) == (4, 1)
    assert set(out.train + out.test) == {
        Record(f"question 1: Q{i}, really? [SEP] question 2: Other {i}", (("Similar", "Dissimilar")[i % 2],))
        for i in range(5)}

    claims = [{"claim_id": str(i), "claim": f"Claim {i}", "claim_label": lab, "evidences": []}
              for i, lab in enumerate(["SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO", "DISPUTED", "SUPPORTS"])]
    write_jsonl(tmp_path, "climate-fever-dataset/dataset/climate-fever.jsonl", claims)
    out = convert("climate_fever", tmp_path)
    assert labels(out.train + out.test) == {"Supports", "Refutes", "Not enough info", "Disputed"}

    write(tmp_path, f"{ADE}/DRUG-AE.rel", "1|Drug X caused rash.|rash|9|13|Drug X|0|6\n")
    write(tmp_path, f"{ADE}/ADE-NEG.txt", "2 NEG Nothing  happened here.\n")
    write(tmp_path, f"{ADE}/DRUG-DOSE.rel", "3|Took 5 mg of Y.|5 mg|5|9|Y|13|14\n")
    ade = convert("ade_corpus_v2-classification", tmp_path)
    assert set(ade.train + ade.test) == {Record("Drug X caused rash.", ("Related",)),
                                         Record("Nothing happened here.", ("Not Related",))}
    effect, dosage = convert("ade_corpus_v2-effect", tmp_path), convert("ade_corpus_v2-dosage", tmp_path)
    assert effect.train + effect.test == [Record("Drug X caused rash. [SEP] Drug X", ("rash",))]
    assert dosage.train + dosage.test == [Record("Took 5 mg of Y. [SEP] Y", ("5 mg",))]


def test_synthetic_linguistic(tmp_path):
    cola = "CoLA-baselines/acceptability_corpus/cola_public/raw"
    write(tmp_path, f"{cola}/in_domain_train.tsv", "s1\t1\t\tGood one.\ns1\t0\t*\tBad one one.\n")
    write(tmp_path, f"{cola}/in_domain_dev.tsv", "s2\t1\t\tIn dev.\n")
    write(tmp_path, f"{cola}/out_of_domain_dev.tsv", "s3\t0\t*\tOut dev.")
    out = convert("glue-cola", tmp_path)
    assert out.train == [Record("Good one.", ("acceptable",)), Record("Bad one one.", ("unacceptable",))]
    assert out.test == [Record("In dev.", ("acceptable",)), Record("Out dev.", ("unacceptable",))]

    # RandomState(42)'s first draws: 0.37, 0.95, 0.73, 0.60, 0.16 -> swapped, kept, kept, kept, swapped
    assert np.all((np.random.RandomState(42).random_sample(5) > 0.5) == [False, True, True, True, False])
    pairs = [{"sentence_good": f"Good {i}.", "sentence_bad": f"Bad {i}."} for i in range(5)]
    write_jsonl(tmp_path, "blimp/data/ellipsis_n_bar_1.jsonl", pairs)
    out = convert("blimp-ellipsis_n_bar_1", tmp_path)
    want = {Record(f"sentence 1: Bad {i}. [SEP] sentence 2: Good {i}.", ("sentence 2",)) for i in (0, 4)}
    want |= {Record(f"sentence 1: Good {i}. [SEP] sentence 2: Bad {i}.", ("sentence 1",)) for i in (1, 2, 3)}
    assert (len(out.train), len(out.test)) == (4, 1) and set(out.train + out.test) == want

    write(tmp_path, "crows-pairs/data/crows_pairs_anonymized.csv",
          ",sent_more,sent_less,stereo_antistereo\n0,\"More, one.\",Less one.,stereo\n")
    out = convert("crows_pairs", tmp_path)
    assert out.train + out.test == [Record("sentence 1: Less one. [SEP] sentence 2: More, one.", ("sentence 2",))]

    ratings = ["0.0", "0.2", "0.333333333333", "0.4", "0.5", "0.6", "0.666666666667", "1.0"]
    write(tmp_path, "query-wellformedness/train.tsv", "".join(f" Query {r} ?\t{r}\n" for r in ratings))
    write(tmp_path, "query-wellformedness/dev.tsv", "Who ?\t1.0\n")
    out = convert("google_wellformed_query", tmp_path)
    assert out.train == [Record(f"Query {r} ?", ("not well-formed",)) for r in ratings[:3]] + \
        [Record(f"Query {r} ?", ("well-formed",)) for r in ratings[5:]]
    assert out.test == [Record("Who ?", ("well-formed",))]
