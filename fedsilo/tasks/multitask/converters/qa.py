"""QA sources: multiple choice (codah, dream, cosmos_qa, aqua_rat), temporal yes/no (mc_taco) and short
answer (numer_sense, proto_qa), in CrossFit's text-to-text form (its tasks/<name>.py).

Inputs and outputs are CrossFit's strings: the choices follow the input as " (A) ... (B) ...", the answer
is the correct choice's text, the parts are joined with CrossFit's " [SEP] " (so "[SEP]  (A)" keeps
CrossFit's double space). Every raw field is `clean`ed before it is joined.

Pools follow CrossFit's splits where the raw copy has them (codah: fold_0's train and dev; dream: train
and dev; mc_taco and numer_sense: CrossFit's own 80/20 split of one file, which `split_80_20` redoes).
Where the copy lacks the split CrossFit trains on, the note says what stands in:
- cosmos_qa: only valid.csv (CrossFit's test pool) is here, so it is split 80/20;
- aqua_rat: train.json is not here; dev.json stays the test pool (CrossFit's) and test.json, unused by
  CrossFit, is the train pool;
- proto_qa: CrossFit splits data/train/train.jsonl 80/20; that file is not here, so dev.scraped.jsonl
  (scraped from the same Family Feud sites) is split 80/20 instead. dev.crowdsourced.jsonl (51 questions,
  another answer style) and test.questions.jsonl (no answers) are not used. CrossFit keeps every raw
  answer as a reference; here they are ordered by their count (most given first, ties in file order) so
  that the training target is the most common answer.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..catalog import Pools, Record, clean, register, split_80_20
from ..reading import Source

_LETTERS = "ABCDE"

CODAH = "CODAH/data/cv_split/fold_0"
DREAM = "dream/data"
COSMOS = "cosmosqa/data/valid.csv"
AQUA = "AQuA"
MCTACO = "MCTACO/dataset/dev_3783.tsv"
NUMER = "NumerSense/data/train.masked.tsv"
PROTO = "protoqa-data/data/dev/dev.scraped.jsonl"


def _choices(texts: Sequence[str], letters: str = _LETTERS) -> str:
    """CrossFit's choice string: " (A) first (B) second ..." (with its leading space)."""
    return "".join(f" ({letter}) {clean(text)}" for letter, text in zip(letters[:len(texts)], texts, strict=True))


def _tsv(src: Source) -> Iterator[list[str]]:
    """Rows of a tab-separated file, read as HF's scripts read them (csv quoting on)."""
    return src.csv(delimiter="\t")


def _index(items: Sequence[Any], i: int, what: str) -> Any:
    """items[i], refusing an index outside them (a negative one would silently count from the end)."""
    if not 0 <= i < len(items):
        raise ValueError(f"{what} {i} is not one of the {len(items)} choices")
    return items[i]


# --- multiple choice -------------------------------------------------------------------------------

def _codah(path: Path) -> list[Record]:
    """Columns: category, prompt, four candidates, index of the correct one (HF codah's reading)."""
    records = []
    with Source(path) as src:
        for row in _tsv(src):
            prompt, candidates, answer = row[1], row[2:-1], int(row[-1])
            records.append(Record(clean(prompt) + _choices(candidates),
                                  (clean(_index(candidates, answer, "answer")),)))
    return records


@register("codah", group="qa", metric="macro_f1", per_class=False,
          files=(f"{CODAH}/train.tsv", f"{CODAH}/dev.tsv"), license="ODC-By-1.0")
def codah(root: Path) -> Pools:
    """HF's codah/fold_0, as CrossFit loads it: train.tsv is its train, dev.tsv its validation."""
    return Pools(_codah(root / CODAH / "train.tsv"), _codah(root / CODAH / "dev.tsv"))


def _dream(path: Path) -> list[Record]:
    """One record per question (HF dream), the whole dialogue joined by spaces."""
    records = []
    with Source(path) as src:
        dialogues = src.json()
        for turns, questions, _id in src.track((f": dialogue {i}", d) for i, d in enumerate(dialogues)):
            dialogue = " ".join(clean(t) for t in turns)
            for q in questions:
                text = clean(q["question"]) + " [SEP] " + dialogue + " [SEP] " + _choices(q["choice"])
                records.append(Record(text, (clean(q["answer"]),)))
    return records


@register("dream", group="qa", metric="acc", per_class=False,
          files=(f"{DREAM}/train.json", f"{DREAM}/dev.json"), license="non-commercial research only")
def dream(root: Path) -> Pools:
    return Pools(_dream(root / DREAM / "train.json"), _dream(root / DREAM / "dev.json"))


def _cosmos(path: Path) -> list[Record]:
    records = []
    with Source(path) as src:
        for row in src.csv(header=True):
            answers = [row[f"answer{i}"] for i in range(4)]
            text = clean(row["question"]) + " [SEP] " + clean(row["context"]) + " [SEP] " + _choices(answers)
            records.append(Record(text, (clean(_index(answers, int(row["label"]), "label")),)))
    return records


@register("cosmos_qa", group="qa", metric="acc", per_class=False, files=(COSMOS,),
          license="CC-BY-4.0 (per the paper; no licence file)")
def cosmos_qa(root: Path) -> Pools:
    train, test = split_80_20(_cosmos(root / COSMOS))
    return Pools(train, test, "only valid.csv (CrossFit's test pool) is in the copy: split 80/20")


def _aqua(path: Path) -> list[Record]:
    """Options are "A)text": CrossFit writes " (A) text" and answers with the correct option's text."""
    records = []
    with Source(path) as src:
        for problem in src.jsonl():
            options = problem["options"]
            letters = "".join(o[0] for o in options)
            texts = [o[2:] for o in options]
            if len(problem["correct"]) != 1 or problem["correct"] not in letters:
                raise ValueError(f"correct = {problem['correct']!r} is not one of the options {letters!r}")
            answer = texts[letters.index(problem["correct"])]
            records.append(Record(clean(problem["question"]) + _choices(texts, letters), (clean(answer),)))
    return records


@register("aqua_rat", group="qa", metric="acc", per_class=False,
          files=(f"{AQUA}/test.json", f"{AQUA}/dev.json"), license="Apache-2.0")
def aqua_rat(root: Path) -> Pools:
    return Pools(_aqua(root / AQUA / "test.json"), _aqua(root / AQUA / "dev.json"),
                 "train.json is not in the copy: test.json is the train pool; dev.json is the test pool "
                 "(CrossFit's)")


# --- yes / no --------------------------------------------------------------------------------------

def _mctaco(path: Path) -> list[Record]:
    """Columns: sentence, question, candidate answer, yes/no, category; the label word is CrossFit's."""
    with Source(path) as src:
        return [Record(clean(s) + " [SEP] " + clean(q) + " [SEP] " + clean(a), (label,))
                for s, q, a, label, _category in _tsv(src)]


@register("mc_taco", group="qa", metric="acc", per_class=True, files=(MCTACO,), license="none stated")
def mc_taco(root: Path) -> Pools:
    """CrossFit splits HF's validation (dev_3783.tsv) 80/20 itself; test_9442.tsv is not used."""
    train, test = split_80_20(_mctaco(root / MCTACO))
    return Pools(train, test)


# --- short answer ----------------------------------------------------------------------------------

def _numer_sense(path: Path) -> list[Record]:
    with Source(path) as src:
        return [Record(clean(sentence).replace("<mask>", "[MASK]"), (clean(target),))
                for sentence, target in _tsv(src)]


@register("numer_sense", group="qa", metric="em", per_class=False, files=(NUMER,), license="MIT")
def numer_sense(root: Path) -> Pools:
    """CrossFit splits HF's train (train.masked.tsv) 80/20 itself."""
    train, test = split_80_20(_numer_sense(root / NUMER))
    return Pools(train, test)


def _proto_answers(raw: dict[str, int]) -> tuple[str, ...]:
    """Every raw answer, most given first (a stable sort keeps ties in file order), cleaned, once."""
    ranked = sorted(raw, key=lambda answer: -raw[answer])
    return tuple(dict.fromkeys(a for a in map(clean, ranked) if a))


def _proto(path: Path) -> list[Record]:
    records = []
    with Source(path) as src:
        for q in src.jsonl():
            answers = _proto_answers(q["answers"]["raw"])
            if answers:
                records.append(Record(clean(q["question"]["normalized"]), answers))
    return records


@register("proto_qa", group="other", metric="em", per_class=False, files=(PROTO,), license="CC-BY-4.0")
def proto_qa(root: Path) -> Pools:
    train, test = split_80_20(_proto(root / PROTO))
    return Pools(train, test, "train.jsonl (CrossFit's source) is not in the copy: dev.scraped.jsonl, "
                              "scraped from the same sites, is split 80/20; references ordered by count")
