"""Sentence-pair and domain classification sources, and the record helpers the sibling modules
`superglue` and `linguistic` share.

Covers `glue-mrpc` (dataset-sts's MSR paraphrase corpus), `sick` (SemEval-2014 SICK),
`medical_questions_pairs` (Curai's mqp.csv), `climate_fever` (climate-fever.jsonl) and the three
ADE-Corpus-V2 tasks (`ade_corpus_v2-classification`, `-dosage`, `-effect`), each as CrossFit's
task script writes it (`tasks/<name>.py`, `map_hf_dataset_to_list`), from the same raw files the
Hugging Face loaders read (before `clean`, the MQP, CLIMATE-FEVER and ADE tasks give CrossFit's
test files and few-shot samples byte for byte, by the checksums in its tasks/_md5sum.py):

- MRPC: HF's GLUE copy is GLUE's re-tokenised text ("Dominick 's", "$ 2.5 billion") split into
  train/validation by GLUE's list of dev ids, neither of which is in the raw copy. The raw MSR text
  is kept as it is; the train pool is dataset-sts's train file (MSR train less its last 500 pairs,
  which dataset-sts moved to a val file that is not here) and the test pool MSR's labelled test
  file (HF's "test" split) in place of GLUE's 408 dev pairs.
- SICK: the SemEval-2014 release (train 4,500 / trial 500) where HF reads the later full SICK.txt
  (train 4,439 / trial 495); train and trial are the train and test pools as in HF.
- mqp.csv, climate-fever.jsonl and the ADE files have one split only: CrossFit's 80/20 split
  (`split_80_20`), read in the order the HF loaders read them.
- medical_questions_pairs keeps CrossFit's label words as CrossFit assigns them: its map is
  {0: "Similar", 1: "Dissimilar"} while mqp.csv's label 1 means a similar pair, so CrossFit's (and
  so the FewFedWeight paper's) "Dissimilar" stands for similar pairs. Reproduced, not corrected.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..catalog import Pools, Record, clean, register, split_80_20
from ..reading import Source, label

SEP = " [SEP] "


def record(text: str, *outputs: str) -> Record:
    """A record with every field through CrossFit's `clean` (the invariants tests/mtreal.py checks)."""
    return Record(clean(text), tuple(clean(o) for o in outputs))


def fields(*named: tuple[str, str]) -> str:
    """CrossFit's usual pair layout: "name 1: text 1 [SEP] name 2: text 2 ..."."""
    return SEP.join(f"{name}: {text}" for name, text in named)


def read_lines(src: Source) -> Iterator[str]:
    """A text file's lines without line ends (a UTF-8 BOM dropped), split where `for line in file`
    splits (universal newlines; not `splitlines`, which also splits at U+2028 and the like)."""
    return src.lines("utf-8-sig", universal=True)


def read_tsv(src: Source, header: bool = True) -> Iterator[list[str]]:
    """Tab-split rows, no quoting (quotes in MSR and SICK sentences are text)."""
    rows = (line.split("\t") for line in read_lines(src))
    if header:
        next(rows, None)
    return rows


def read_jsonl(src: Source) -> Iterator[Any]:
    return src.jsonl("utf-8-sig")


def split_one_file(records: list[Record], source: str) -> Pools:
    """CrossFit's 80/20 split of a source that has a single split."""
    train, test = split_80_20(records)
    return Pools(train, test, note=f"{source} has one split only: CrossFit's 80/20 split (numpy seed 42)")


# --- MRPC -------------------------------------------------------------------------------------------

MRPC_DIR = "dataset-sts/data/para/msr"
MRPC_LABELS = {"0": "not_equivalent", "1": "equivalent"}


def mrpc_records(path: Path) -> list[Record]:
    """Columns: Quality, #1 ID, #2 ID, #1 String, #2 String."""
    with Source(path) as src:
        return [record(fields(("sentence 1", row[3]), ("sentence 2", row[4])), label(MRPC_LABELS, row[0]))
                for row in read_tsv(src)]


@register("glue-mrpc", group="classification", metric="acc", per_class=True,
          files=(f"{MRPC_DIR}/msr-para-train.tsv", f"{MRPC_DIR}/msr-para-test.tsv"),
          license="MSR Shared Source (research, non-commercial)")
def glue_mrpc(root: Path) -> Pools:
    return Pools(mrpc_records(root / MRPC_DIR / "msr-para-train.tsv"),
                 mrpc_records(root / MRPC_DIR / "msr-para-test.tsv"),
                 note="train pool: dataset-sts MSR train (MSR train less its last 500 pairs, = part of GLUE "
                      "train+dev); test pool: MSR's labelled test set (GLUE/HF 'test') in place of GLUE's dev "
                      "ids, which are not in the copy; raw MSR text, not GLUE's re-tokenised text")


# --- SICK -------------------------------------------------------------------------------------------

SICK_DIR = "dataset-sts/data/sts/sick2014"


def sick_records(path: Path) -> list[Record]:
    """Columns: pair_ID, sentence_A, sentence_B, relatedness_score, entailment_judgment."""
    with Source(path) as src:
        return [record(fields(("sentence 1", row[1]), ("sentence 2", row[2])), row[4].lower())
                for row in read_tsv(src)]


@register("sick", group="classification", metric="macro_f1", per_class=True,
          files=(f"{SICK_DIR}/SICK_train.txt", f"{SICK_DIR}/SICK_trial.txt"),
          license="CC-BY-NC-SA-3.0 (non-commercial)")
def sick(root: Path) -> Pools:
    return Pools(sick_records(root / SICK_DIR / "SICK_train.txt"), sick_records(root / SICK_DIR / "SICK_trial.txt"),
                 note="SemEval-2014 SICK train (4,500) / trial (500) as train / test pools; HF's SICK.txt "
                      "split has 4,439 / 495")


# --- Medical question pairs ---------------------------------------------------------------------------

MQP = "medical-question-pair-dataset/mqp.csv"
MQP_LABELS = {"0": "Similar", "1": "Dissimilar"}  # CrossFit's map, applied to mqp.csv's label (1 = similar)


@register("medical_questions_pairs", group="classification", metric="acc", per_class=True, files=(MQP,),
          license="none stated")
def medical_questions_pairs(root: Path) -> Pools:
    with Source(root / MQP) as src:
        records = [record(fields(("question 1", q1), ("question 2", q2)), label(MQP_LABELS, word))
                   for _dr, q1, q2, word in src.csv()]
    pools = split_one_file(records, "mqp.csv")
    return Pools(pools.train, pools.test, note=pools.note + "; CrossFit's label words kept as CrossFit maps "
                                                           "them: 'Dissimilar' = mqp label 1 = similar pair")


# --- CLIMATE-FEVER ------------------------------------------------------------------------------------

CLIMATE = "climate-fever-dataset/dataset/climate-fever.jsonl"
CLIMATE_LABELS = {"SUPPORTS": "Supports", "REFUTES": "Refutes", "NOT_ENOUGH_INFO": "Not enough info",
                  "DISPUTED": "Disputed"}


@register("climate_fever", group="classification", metric="macro_f1", per_class=True, files=(CLIMATE,),
          license="none stated in repo")
def climate_fever(root: Path) -> Pools:
    with Source(root / CLIMATE) as src:
        records = [record(row["claim"], label(CLIMATE_LABELS, row["claim_label"])) for row in read_jsonl(src)]
    return split_one_file(records, "climate-fever.jsonl (HF: test only)")


# --- ADE-Corpus-V2 ------------------------------------------------------------------------------------

ADE_DIR = "AdverseDrugReaction/ADE-Corpus-V2"
ADE_AE, ADE_NEG, ADE_DOSE = f"{ADE_DIR}/DRUG-AE.rel", f"{ADE_DIR}/ADE-NEG.txt", f"{ADE_DIR}/DRUG-DOSE.rel"
ADE_LICENSE = "none stated (ADE corpus, Gurulingappa et al. 2012)"


def ade_relations(src: Source) -> Iterator[list[str]]:
    """Pipe-separated: PubMed id, sentence, effect or dose, 2 offsets, drug, 2 offsets (HF splits on every "|")."""
    return (line.strip().split("|") for line in read_lines(src))


def ade_negatives(src: Source) -> Iterator[str]:
    """"<PubMed id> NEG <sentence>": the sentence is everything after the second space."""
    return (" ".join(line.strip().split(" ")[2:]) for line in read_lines(src))


@register("ade_corpus_v2-classification", group="classification", metric="macro_f1", per_class=True,
          files=(ADE_AE, ADE_NEG), license=ADE_LICENSE)
def ade_classification(root: Path) -> Pools:
    with Source(root / ADE_AE) as src:
        related = [record(value[1], "Related") for value in ade_relations(src)]
    with Source(root / ADE_NEG) as src:
        unrelated = [record(text, "Not Related") for text in ade_negatives(src)]
    return split_one_file(related + unrelated, "ADE-Corpus-V2 (DRUG-AE.rel then ADE-NEG.txt, as HF)")


def ade_extraction(root: Path, rel: str) -> Pools:
    """CrossFit's ade_dosage/ade_effect: "sentence [SEP] drug" -> the dose or the adverse effect."""
    with Source(root / rel) as src:
        records = [record(value[1] + SEP + value[5], value[2]) for value in ade_relations(src)]
    return split_one_file(records, rel.rsplit("/", 1)[-1])


@register("ade_corpus_v2-dosage", group="other", metric="em", per_class=False, files=(ADE_DOSE,),
          license=ADE_LICENSE)
def ade_dosage(root: Path) -> Pools:
    return ade_extraction(root, ADE_DOSE)


@register("ade_corpus_v2-effect", group="other", metric="em", per_class=False, files=(ADE_AE,),
          license=ADE_LICENSE)
def ade_effect(root: Path) -> Pools:
    return ade_extraction(root, ADE_AE)
