"""Conditional-generation sources: e2e_nlg_cleaned, wiki_split and aeslc, in CrossFit's text-to-text form
(its tasks/<name>.py). Inputs are kept whole, however long (the task truncates when it encodes).

CrossFit trains on each source's HF train split and tests on its validation split. None of these copies
holds the train split, so the validation split stays the test pool (CrossFit's) and a split CrossFit
does not use stands in as the train pool:
- e2e_nlg_cleaned: e2e-cleaning's cleaned-data (the HF e2e_nlg_cleaned files): devel-fixed.no-ol.csv is
  the test pool, test-fixed.csv the train pool. CrossFit writes one line per (MR, reference); here an MR
  is one record holding all its references in file order (the metrics take the best of them), so one
  MR is never both a train and a test example of the same pool. The original e2e-dataset is not needed;
- wiki_split: validation.tsv is the test pool, tune.tsv the train pool (test.tsv is not used);
- aeslc: dev/ is the test pool, test/ the train pool, read from the tar as HF's aeslc reads its files
  (body up to the first empty line, then "@subject" and the subject line; the @ann annotations, unused
  by CrossFit, are not used).
"""
from __future__ import annotations

import gzip
import tarfile
import zlib
from pathlib import Path

from fedsilo.datafetch import DataError

from ..catalog import Pools, Record, clean, register
from ..reading import Source, decode

E2E = "e2e-cleaning/cleaned-data"
WIKI = "wiki-split"
AESLC = "AESLC/enron_subject_line_dev_test.tar.gz"


def _e2e(path: Path) -> list[Record]:
    """One record per meaning representation (first-seen order), its references in file order."""
    refs: dict[str, list[str]] = {}
    with Source(path) as src:
        for row in src.csv(header=True):
            refs.setdefault(clean(row["mr"]), []).append(clean(row["ref"]))
    return [Record(mr, tuple(dict.fromkeys(r for r in rs if r))) for mr, rs in refs.items()]


@register("e2e_nlg_cleaned", group="other", metric="rouge_l", per_class=False,
          files=(f"{E2E}/test-fixed.csv", f"{E2E}/devel-fixed.no-ol.csv"), license="CC-BY-SA-4.0")
def e2e_nlg_cleaned(root: Path) -> Pools:
    return Pools(_e2e(root / E2E / "test-fixed.csv"), _e2e(root / E2E / "devel-fixed.no-ol.csv"),
                 "train-fixed.no-ol.csv is not in the copy: test-fixed.csv is the train pool, "
                 "devel-fixed.no-ol.csv the test pool (CrossFit's); one record per MR with all its references")


def _wiki_split(path: Path) -> list[Record]:
    """Columns: the complex sentence, then its two simple sentences joined by "<::::>" (HF wiki_split)."""
    records = []
    with Source(path) as src:
        for complex_sentence, simple in src.csv(delimiter="\t"):
            first, second = simple.split("<::::>")[:2]
            text = "sentence 1: " + clean(first) + " [SEP] sentence 2: " + clean(second)
            records.append(Record(text, (clean(complex_sentence),)))
    return records


@register("wiki_split", group="generation", metric="rouge_l", per_class=False,
          files=(f"{WIKI}/tune.tsv", f"{WIKI}/validation.tsv"), license="CC-BY-SA-4.0")
def wiki_split(root: Path) -> Pools:
    return Pools(_wiki_split(root / WIKI / "tune.tsv"), _wiki_split(root / WIKI / "validation.tsv"),
                 "train.tsv is not in the copy: tune.tsv is the train pool, validation.tsv the test pool "
                 "(CrossFit's)")


def _email(text: str) -> tuple[str, str]:
    """HF aeslc's parse: the body runs to the first empty line; the line after it is "@subject", and
    the subject runs to the next empty line."""
    body, rest = text.split("\n\n", 1)
    subject = rest.split("\n", 1)[1].split("\n\n", 1)[0]
    return body, subject


def _aeslc(tar: tarfile.TarFile, split: str) -> list[Record]:
    """The split's *.subject files in name order (HF's sorted glob)."""
    members = sorted((m for m in tar.getmembers()
                      if m.isfile() and m.name.startswith(f"enron_subject_line/{split}/")
                      and m.name.endswith(".subject")), key=lambda m: m.name)
    records = []
    with Source(tar.name) as src:
        for member in src.track((f": {m.name}", m) for m in members):
            body, subject = _email(decode(tar.extractfile(member).read(), "utf-8", src.where))
            records.append(Record("summarize: " + clean(body), (clean(subject),)))
    return records


@register("aeslc", group="generation", metric="rouge_l", per_class=False, files=(AESLC,),
          license="CC-BY-NC-SA-4.0 (non-commercial)")
def aeslc(root: Path) -> Pools:
    try:
        with tarfile.open(root / AESLC) as tar:
            train, test = _aeslc(tar, "test"), _aeslc(tar, "dev")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0].rstrip(":")
        raise DataError(f"{root / AESLC}: not a readable tar archive ({reason})") from None
    return Pools(train, test, "the train split is not in the copy: test/ is the train pool, dev/ the test "
                              "pool (CrossFit's)")
