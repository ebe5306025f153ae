"""Hate speech, spam and news-topic tasks: the seven `ethos-*` tasks, `hate_speech_offensive`,
`sms_spam` and `ag_news`.

Sources: intelligence-csd-auth-gr/Ethos-Hate-Speech-Dataset (its `ethos_data` and, in `hs_data`,
Davidson et al.'s hate-speech-and-offensive-language CSV), the UCI SMS Spam Collection, and the AG
News test CSV (Zhang et al. 2015). Each of these has a single split in the copy, so both pools come
from `split_80_20` (CrossFit's own split for ethos, hate_speech_offensive and sms_spam, whose HF
datasets have only a train split):

- ethos-*: CrossFit's ethos.py builds directed_vs_generalized, disability, gender, national_origin,
  race, religion and sexual_orientation (its METRICS lists no ethos-violence, and no binary task)
  from HF's `multilabel` config: the 433 hateful comments of `Ethos_Dataset_Multi_Label.csv`, each
  annotator-share column binarised as score >= 0.5. CrossFit's label words are kept as they are,
  "generalied" included.
- hate_speech_offensive: the CSV's `class` (0 hate speech, 1 offensive language, 2 neither) for the
  tweet, as HF reads it with `csv.reader`.
- sms_spam: this copy has a "Label<TAB>SMS" header line that UCI's file lacks; it is skipped. As in
  HF, the message is the field after the first tab.
- ag_news: CrossFit trains on HF's 120,000 train rows and tests on its 7,600 test rows; only
  test.csv is here, so it is split 80/20. The text is "<title> <description>" as in HF.
"""
from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

from fedsilo.datafetch import DataError

from ..catalog import Pools, Record, clean, register, split_80_20
from ..reading import Source, label

ETHOS = "ethos/ethos_data/Ethos_Dataset_Multi_Label.csv"
HSO = "ethos/hs_data/hate-speech-and-offensive-language.csv"
SMS = "sms-spam-collection/SMSSpamCollection"
AG = "ag_news_csv/test.csv"

ETHOS_DIMENSIONS = ("directed_vs_generalized", "disability", "gender", "national_origin", "race", "religion",
                    "sexual_orientation")
ETHOS_WORDS = {"directed_vs_generalized": ("generalied", "directed")}  # others: ("false", "true")
HSO_CLASSES = {"0": "hate speech", "1": "offensive language", "2": "neither"}
AG_CLASSES = {"1": "World", "2": "Sports", "3": "Business", "4": "Sci/Tech"}


def _split(records: list[Record], note: str = "") -> Pools:
    train, test = split_80_20(records)
    return Pools(train, test, note or "CrossFit's own 80/20 split of the only split")


def _ethos(root: Path, dimension: str) -> Pools:
    words = ETHOS_WORDS.get(dimension, ("false", "true"))
    with Source(root / ETHOS) as src:
        rows = src.csv(delimiter=";")
        header = next(rows, [])
        if dimension not in header:
            raise DataError(f"{root / ETHOS}:1: the header has no column {dimension!r}")
        column = header.index(dimension)
        return _split([Record(clean(row[0]), (words[float(row[column]) >= 0.5],)) for row in rows])


def _register_ethos() -> None:
    for dimension in ETHOS_DIMENSIONS:
        register(f"ethos-{dimension}", group="classification", metric="macro_f1", per_class=True,
                 files=[ETHOS], license="GPL-3.0")(partial(_ethos, dimension=dimension))


_register_ethos()


@register("hate_speech_offensive", group="classification", metric="macro_f1", per_class=True, files=[HSO],
          license="MIT (Davidson et al.; copy inside the GPL-3.0 Ethos repository)")
def hate_speech_offensive(root: Path) -> Pools:
    with Source(root / HSO) as src:
        rows = src.csv()
        next(rows, None)  # the header
        return _split([Record(clean(row[6]), (label(HSO_CLASSES, row[5]),)) for row in rows])


@register("sms_spam", group="classification", metric="macro_f1", per_class=True, files=[SMS],
          license="research only (UCI SMS Spam Collection)")
def sms_spam(root: Path) -> Pools:
    with Source(root / SMS) as src:
        return _split([Record(clean(f[1]), ("ham" if f[0] == "ham" else "spam",)) for f in _sms_fields(src.lines())])


def _sms_fields(lines: Iterator[str]) -> Iterator[list[str]]:
    """Each message's tab-separated fields, without this copy's "Label<TAB>SMS" header line."""
    for n, line in enumerate(lines):
        if n or not line.startswith("Label\t"):
            yield line.split("\t")


@register("ag_news", group="classification", metric="macro_f1", per_class=True, files=[AG],
          license="non-commercial research (AG's corpus)")
def ag_news(root: Path) -> Pools:
    with Source(root / AG) as src:
        records = [Record(clean(f"{title} {description}"), (label(AG_CLASSES, word),))
                   for word, title, description in src.csv()]
    return _split(records, note="only HF's test split (7,600) is in the copy: 80/20 split of it "
                                "(CrossFit: train 120,000 / test 7,600)")
