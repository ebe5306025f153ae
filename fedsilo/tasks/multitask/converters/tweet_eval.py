"""The eleven `tweet_eval-*` tasks of CrossFit's tweet_eval.py, from cardiffnlp/tweeteval's datasets
folder (the files HF's `tweet_eval` script reads).

Each task is `<split>_text.txt` with one tweet a line and `<split>_labels.txt` with its label id a
line; the label words are CrossFit's (they differ from mapping.txt's names for hate, irony and
offensive, e.g. "non-hate" for mapping.txt's "not-hate"; the ids are the same). As CrossFit does, the
text is `clean`ed and a tweet that is empty after it is dropped (7 train and 1 validation tweet of
`hate`). Files are split on "\\n" only, as HF's `readlines` does, so that a line separator such as
U+2028 inside a tweet could not shift the texts against the labels.

Pools: train for the train pool and val (HF's validation) for the test pool, as in CrossFit. The copy
of `sentiment` has no `train_text.txt`, so its train pool is its labelled test split (12,284 tweets),
which CrossFit never reads; its test pool is still the validation split.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from fedsilo.datafetch import DataError

from ..catalog import Pools, Record, clean, register
from ..reading import Source, label

DATA = "tweeteval/datasets"
LICENSE = "per-task source licences and Twitter's terms (TweetEval adds no restriction)"

EMOJI = ("\u2764", "\U0001f60d", "\U0001f602", "\U0001f495", "\U0001f525", "\U0001f60a", "\U0001f60e",
         "\u2728", "\U0001f499", "\U0001f618", "\U0001f4f7", "\U0001f1fa\U0001f1f8", "\u2600", "\U0001f49c",
         "\U0001f609", "\U0001f4af", "\U0001f601", "\U0001f384", "\U0001f4f8", "\U0001f61c")
STANCE = ("none", "against", "favor")

# CrossFit's subset name -> (folder under DATA, label word per id)
SUBSETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "emoji": ("emoji", EMOJI),
    "emotion": ("emotion", ("anger", "joy", "optimism", "sadness")),
    "hate": ("hate", ("non-hate", "hate")),
    "irony": ("irony", ("non-irony", "irony")),
    "offensive": ("offensive", ("non-offensive", "offensive")),
    "sentiment": ("sentiment", ("negative", "neutral", "positive")),
    **{f"stance_{t}": (f"stance/{t}", STANCE) for t in ("abortion", "atheism", "climate", "feminist", "hillary")},
}
NO_TRAIN_TEXT = {"sentiment": "test"}  # subset -> the labelled split that stands in for train


def read_split(root: Path, folder: str, split: str, words: tuple[str, ...]) -> list[Record]:
    """One split's (tweet, label word) records, empty tweets dropped as CrossFit does."""
    texts_path, labels_path = (root / DATA / folder / f"{split}_{kind}.txt" for kind in ("text", "labels"))
    texts = list(Source(texts_path).lines())
    with Source(labels_path) as src:
        labels = [label(words, int(line)) for line in src.lines()]
    if len(texts) != len(labels):
        raise DataError(f"{texts_path}: {len(texts)} tweets but {len(labels)} labels in {labels_path.name}")
    cleaned = ((clean(text), word) for text, word in zip(texts, labels))
    return [Record(text, (word,)) for text, word in cleaned if text]


def _convert(root: Path, folder: str, words: tuple[str, ...], train_split: str) -> Pools:
    note = "" if train_split == "train" else (
        f"no train_text.txt in the copy: train pool = the labelled {train_split} split, "
        "test pool = validation as in CrossFit")
    return Pools(read_split(root, folder, train_split, words), read_split(root, folder, "val", words), note)


def _files(folder: str, train_split: str) -> list[str]:
    return [f"{DATA}/{folder}/{split}_{kind}.txt" for split in (train_split, "val") for kind in ("text", "labels")]


def _register_all() -> None:
    for subset, (folder, words) in SUBSETS.items():
        train = NO_TRAIN_TEXT.get(subset, "train")
        register(f"tweet_eval-{subset}", group="classification", metric="macro_f1", per_class=True,
                 files=_files(folder, train), license=LICENSE)(
            partial(_convert, folder=folder, words=words, train_split=train))


_register_all()
