"""Linguistic-acceptability and sentence-form sources: `glue-cola` (CoLA public raw files), the ten
`blimp-*` tasks CrossFit defines (blimp/data jsonl), `crows_pairs` (CrowS-Pairs csv) and
`google_wellformed_query` (query-wellformedness tsv), each as CrossFit's task script writes it.
Before `clean`, CrossFit's files come out byte for byte (checksums in its tasks/_md5sum.py): the
test files and few-shot train/dev samples of all of them, except CoLA's test file.

- CoLA: in_domain_train is GLUE's (HF's) train; GLUE's dev (HF's validation, CrossFit's test) is
  in_domain_dev followed by out_of_domain_dev (527 + 516), so both are the test pool.
- BLiMP and CrowS-Pairs: CrossFit puts the two sentences of a pair in a random order, one
  `np.random.random() > 0.5` draw per pair in file order after `np.random.seed(42)` (here a
  `RandomState(42)`, the same stream without touching numpy's global state), and labels which
  position holds the grammatical (BLiMP) or the more stereotyping (CrowS) sentence; both sources
  have one split, so CrossFit's 80/20 split follows. The 10 BLiMP paradigms are the ones in
  CrossFit's METRICS (its blimp.py draws 10 of 67 with numpy; all 10 files are in the copy).
- google_wellformed_query: CrossFit binarises the mean rating of five raters: below 0.4 is
  "not well-formed", above 0.6 "well-formed", the rest dropped; HF's ratings are float32, so a
  rating of 0.6 counts as above 0.6 (and CrossFit's files hold it so). train.tsv and dev.tsv are
  HF's train and validation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..catalog import Pools, Record, register
from ..reading import Source, label
from .pairs import fields, read_jsonl, read_tsv, record, split_one_file

# --- CoLA ---------------------------------------------------------------------------------------------

COLA_DIR = "CoLA-baselines/acceptability_corpus/cola_public/raw"
COLA_LABELS = {"0": "unacceptable", "1": "acceptable"}


def cola_records(path: Path) -> list[Record]:
    """Columns (no header): source, label, original mark, sentence."""
    with Source(path) as src:
        return [record(row[3], label(COLA_LABELS, row[1])) for row in read_tsv(src, header=False)]


@register("glue-cola", group="classification", metric="mcc", per_class=True,
          files=(f"{COLA_DIR}/in_domain_train.tsv", f"{COLA_DIR}/in_domain_dev.tsv",
                 f"{COLA_DIR}/out_of_domain_dev.tsv"),
          license="CoLA terms (sentences from published linguistics works; research use)")
def glue_cola(root: Path) -> Pools:
    test = [r for name in ("in_domain_dev.tsv", "out_of_domain_dev.tsv") for r in cola_records(root / COLA_DIR / name)]
    return Pools(cola_records(root / COLA_DIR / "in_domain_train.tsv"), test,
                 note="test pool: in-domain (527) + out-of-domain (516) dev, as GLUE's dev.tsv (HF validation, "
                      "1,043); CrossFit's test-file checksum differs from this copy's (an older cola_public release?), "
                      "its few-shot train/dev samples match")


# --- Randomly ordered pairs: BLiMP, CrowS-Pairs ----------------------------------------------------------

def shuffled_pairs(pairs: list[tuple[str, str]]) -> list[Record]:
    """(first, second) pairs in CrossFit's random order; the label names where `first` ended up."""
    rng = np.random.RandomState(42)
    out = []
    for first, second in pairs:
        if rng.random_sample() > 0.5:
            out.append(record(fields(("sentence 1", first), ("sentence 2", second)), "sentence 1"))
        else:
            out.append(record(fields(("sentence 1", second), ("sentence 2", first)), "sentence 2"))
    return out


BLIMP_PARADIGMS = (
    "anaphor_gender_agreement", "anaphor_number_agreement", "determiner_noun_agreement_with_adj_irregular_1",
    "ellipsis_n_bar_1", "ellipsis_n_bar_2", "existential_there_quantifiers_1",
    "irregular_past_participle_adjectives", "sentential_negation_npi_licensor_present",
    "sentential_negation_npi_scope", "wh_questions_object_gap",
)


def blimp_file(paradigm: str) -> str:
    return f"blimp/data/{paradigm}.jsonl"


def blimp_pools(root: Path, paradigm: str) -> Pools:
    with Source(root / blimp_file(paradigm)) as src:
        pairs = [(r["sentence_good"], r["sentence_bad"]) for r in read_jsonl(src)]
        return split_one_file(shuffled_pairs(pairs), f"BLiMP {paradigm}")


def _register_blimp(paradigm: str) -> None:
    @register(f"blimp-{paradigm}", group="other", metric="acc", per_class=True, files=(blimp_file(paradigm),),
              license="CC-BY-4.0")
    def convert(root: Path) -> Pools:
        return blimp_pools(root, paradigm)


for _paradigm in BLIMP_PARADIGMS:
    _register_blimp(_paradigm)


CROWS = "crows-pairs/data/crows_pairs_anonymized.csv"


@register("crows_pairs", group="other", metric="acc", per_class=True, files=(CROWS,), license="CC-BY-SA-4.0")
def crows_pairs(root: Path) -> Pools:
    with Source(root / CROWS) as src:
        pairs = [(r["sent_more"], r["sent_less"]) for r in src.csv(header=True)]
        return split_one_file(shuffled_pairs(pairs), "CrowS-Pairs (HF: test only)")


# --- Query well-formedness --------------------------------------------------------------------------------

WELLFORMED_DIR = "query-wellformedness"


def wellformed_records(path: Path) -> list[Record]:
    """Columns (no header): query, mean rating. HF stores the rating as float32, so CrossFit's
    `rating < 0.4` / `rating > 0.6` see 0.4 as 0.4000000060 (dropped) and 0.6 as 0.6000000238
    (well-formed): only 0.4 and 0.5 are left out."""
    out = []
    with Source(path) as src:
        for query, rating in read_tsv(src, header=False):
            value = float(np.float32(rating))
            if value < 0.4:
                out.append(record(query.strip(), "not well-formed"))
            elif value > 0.6:
                out.append(record(query.strip(), "well-formed"))
    return out


@register("google_wellformed_query", group="classification", metric="acc", per_class=True,
          files=(f"{WELLFORMED_DIR}/train.tsv", f"{WELLFORMED_DIR}/dev.tsv"), license="CC-BY-SA-4.0")
def google_wellformed_query(root: Path) -> Pools:
    return Pools(wellformed_records(root / WELLFORMED_DIR / "train.tsv"),
                 wellformed_records(root / WELLFORMED_DIR / "dev.tsv"))
