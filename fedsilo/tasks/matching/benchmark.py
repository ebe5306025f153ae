"""Reading the five benchmark answer-selection silos (one domain each) from ``data/qa``.

The paper's FedQA set (PrivacyQA, BioASQ, FiQA, InsuranceQA, MedQuAD) is not public as one set, so
public stand-ins are used:

- ``medquad``: medical; MedQuAD's NIDDK, NINDS and CDC XML files. Question-answer pairs only: a
  question (pairs with the same text are one question) has all its answers as gold.
- ``fiqa``: financial; FiQA task 2 questions and their gold document ids. Only ``test_answers.csv``
  holds answer texts, so only the questions with a gold answer there are kept.
- ``insuranceqa``: insurance; one lemmatised file of (question, answer, 0/1) rows with random
  negatives, mostly one or two candidates per question.
- ``wikiqa``: open domain; castorini's copy (lower-cased, tokenised, candidate lists included).
- ``trecqa``: news; Wang et al.'s TREC set (tokenised, candidate lists included).

The tokenised sets keep their spacing, but Penn Treebank escapes (-LRB-, and `` '' for quotes)
become the characters they stand for; all text is whitespace-normalised.

MedQuAD and FiQA have no negatives: as in the paper, each question gets the ``negatives`` answers
of its silo that BM25 ranks highest for it (Lucene's BM25, as the paper's Elasticsearch) and that are
not one of its gold texts. WikiQA and TrecQA keep their splits; the others are split 80/10/10 by
question at random (fixed seed, independent of any run seed). Parsing and mining take seconds, so
the prepared splits are cached under the data root, keyed by the input files' contents.
"""
from __future__ import annotations

import csv
import functools
import io
import itertools
import random
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from fedsilo.datafetch import DataError, read_manifest, require_files, warn_if_unpinned

from ..prepared import cache_path, ignored, package_version, read_cache, write_cache
from .plugin import SILOS
from .questions import SPLITS, Asked, Question, judged_question, mine_negatives

__all__ = ["PREPARE_VERSION", "load_silo", "required_files", "verify_data_dir"]

PREPARE_VERSION = 1
"""Bump when preparation changes what it produces: it is part of the cache key."""

_MANIFEST = Path(__file__).resolve().parent / "sources.tsv"
_MEDQUAD_FOLDERS = ("5_NIDDK_QA", "6_NINDS_QA", "9_CDC_QA")
_WIKIQA_FILES = ("id.txt", "a.toks", "b.toks", "sim.txt")  # line i of each: one judged candidate
_FILES = {
    "fiqa": ["fiqa/FiQA_train_question_final.tsv", "fiqa/FiQA_train_question_doc_final.tsv",
             "fiqa/test_answers.csv"],
    "insuranceqa": ["insuranceqa/test.csv"],
    "wikiqa": [f"wikiqa/{split}/{name}" for split in SPLITS for name in _WIKIQA_FILES],
    "trecqa": [f"trecqa/{split}.csv" for split in SPLITS],
}

# Penn Treebank escapes in the tokenised TrecQA and WikiQA text.
_PTB = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}",
        "``": '"', "''": '"'}


def required_files(silos: Iterable[str]) -> list[str]:
    """Paths, relative to the data folder, that ``silos`` read (in silo order, no repeats)."""
    out: list[str] = []
    for silo in silos:
        _check_silo(silo)
        out += [f for f in _files(silo) if f not in out]
    return out


def load_silo(data_dir: str | Path, silo: str, negatives: int = 5) -> dict[str, list[Question]]:
    """One silo's questions keyed "train"/"dev"/"test", from the cache when the inputs are unchanged.
    ``negatives`` is the number of BM25-mined negatives per question where the source has none."""
    _check_silo(silo)
    if negatives < 0:
        raise ValueError(f"negatives must be >= 0, got {negatives}")
    data_dir = Path(data_dir)
    require_files("matching", data_dir, _files(silo))
    cache = _cache_path(silo, negatives, data_dir)
    splits = _read_cache(cache)
    if splits is None:
        splits = _PREPARE[silo](data_dir, negatives)
        _write_cache(cache, silo, negatives, splits)
    return splits


def verify_data_dir(silos: Sequence[str], data_dir: Path) -> None:
    """An explicit ``task.data_dir``, checked as the cache is: the files ``silos`` read exist, and
    files that differ from the pinned ones are warned about. Records are checked as they load."""
    data_dir = Path(data_dir)
    names = required_files(silos)
    require_files("matching", data_dir, names)
    warn_if_unpinned("matching", data_dir, names)


def _check_silo(silo: str) -> None:
    if silo not in SILOS:
        raise DataError(f"unknown matching silo {silo!r}; expected one of {', '.join(SILOS)}")


def _files(silo: str) -> list[str]:
    return _medquad_files() if silo == "medquad" else _FILES[silo]


@functools.cache
def _medquad_files() -> list[str]:
    """The XML files of the three MedQuAD collections, as the manifest pins them (a fixed list, so
    a file missing from a data folder is an error, not a silently smaller silo)."""
    return sorted(src.path for src in read_manifest(_MANIFEST)
                  if src.path.endswith(".xml") and src.path.split("/")[1] in _MEDQUAD_FOLDERS)


# ---- preparation per silo ------------------------------------------------------------------

_Splits = dict[str, list[Question]]


def _medquad(data_dir: Path, negatives: int) -> _Splits:
    """QAPairs with an answer, grouped by question text; BM25 negatives from every answer."""
    pairs = [pair for name in _medquad_files() for pair in _medquad_pairs(data_dir / name)]
    pool = list(dict.fromkeys(answer for _, _, answer in pairs))
    return _random_split("medquad", mine_negatives(_gather(pairs), pool, negatives))


def _medquad_pairs(path: Path) -> list[tuple[str, str, str]]:
    """(qid, question, answer) per QAPair with a non-empty answer; qid is ``collection/file-n`` for
    the file's n-th QAPair (MedQuAD's own qids restart in every collection)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:  # its message names the line and column
        raise DataError(f"{path}: invalid XML: {e}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    out = []
    for n, pair in enumerate(root.iter("QAPair"), start=1):
        question, answer = _element_text(pair, "Question"), _element_text(pair, "Answer")
        if not question:
            raise DataError(f"{path}: QAPair {n} (pid {pair.get('pid')!r}) has no question text")
        if answer:  # some MedQuAD collections had their answers removed for copyright
            out.append((f"{path.parent.name}/{path.stem}-{n}", question, answer))
    return out


def _element_text(parent: ET.Element, tag: str) -> str:
    """The normalised text of ``parent``'s first ``tag`` child, "" when it has none."""
    element = parent.find(tag)
    return _norm("".join(element.itertext())) if element is not None else ""


def _fiqa(data_dir: Path, negatives: int) -> _Splits:
    """Questions with at least one gold document whose text ``test_answers.csv`` holds; gold = those
    texts. BM25 negatives from every text of that file (the only answer texts there are)."""
    q_path, rel_path, ans_path = (data_dir / name for name in _FILES["fiqa"])
    texts = {docid: _norm(text) for _, (docid, text) in _read_tsv(ans_path, columns=2)}
    golds: dict[str, list[str]] = {}
    for _, (_, qid, docid) in _read_tsv(rel_path, columns=3, header=("", "qid", "docid")):
        if docid in texts:
            golds.setdefault(qid, []).append(texts[docid])
    pairs = [(qid, _norm(question), answer)
             for _, (_, qid, question, _) in _read_tsv(q_path, columns=4, header=("", "qid", "question", "timestamp"))
             for answer in golds.get(qid, [])]
    return _random_split("fiqa", mine_negatives(_gather(pairs), list(dict.fromkeys(texts.values())), negatives))


def _insuranceqa(data_dir: Path, negatives: int) -> _Splits:
    """Rows grouped by question (wherever they are in the file); qid = the line of its first row."""
    path = data_dir / _FILES["insuranceqa"][0]
    asked: dict[str, tuple[str, list[tuple[str, int]]]] = {}
    for n, (question, answer, label) in _read_csv(path, ("question", "answer", "label")):
        asked.setdefault(_norm(question), (str(n), []))[1].append((_norm(answer), _label(path, n, label)))
    return _random_split("insuranceqa", [judged_question(qid, text, judged) for text, (qid, judged) in asked.items()])


def _wikiqa(data_dir: Path, negatives: int) -> _Splits:
    """castorini's layout: line i of id.txt, a.toks, b.toks, sim.txt is (question id, question,
    candidate, label); one question per id, in file order."""
    out = {}
    for split in SPLITS:
        paths = [data_dir / "wikiqa" / split / name for name in _WIKIQA_FILES]
        columns = [_read_lines(path) for path in paths]
        for path, column in zip(paths[1:], columns[1:]):
            if len(column) != len(columns[0]):
                raise DataError(f"{path} has {len(column)} lines but its parallel file {paths[0]} "
                                f"has {len(columns[0])}")
        asked: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        for n, (qid, question, answer, label) in enumerate(zip(*columns), start=1):
            question = _unptb(question)
            text, judged = asked.setdefault(qid, (question, []))
            if text != question:
                raise DataError(f"{paths[1]}: line {n}: question id {qid} had another question text before")
            judged.append((_unptb(answer), _label(paths[3], n, label)))
        out[split] = [judged_question(qid, text, judged) for qid, (text, judged) in asked.items()]
    return _disjoint(out)


def _trecqa(data_dir: Path, negatives: int) -> _Splits:
    """``qtext,label,atext`` rows, a question's rows consecutive; qid = the line of its first row."""
    out = {}
    for split in SPLITS:
        path = data_dir / "trecqa" / f"{split}.csv"
        rows = _read_csv(path, ("qtext", "label", "atext"))
        out[split] = []
        for question, run in itertools.groupby(rows, key=lambda row: row[1][0]):
            run = list(run)
            judged = [(_unptb(answer), _label(path, n, label)) for n, (_, label, answer) in run]
            out[split].append(judged_question(str(run[0][0]), _unptb(question), judged))
    return _disjoint(out)


_PREPARE: dict[str, Callable[[Path, int], _Splits]] = {
    "medquad": _medquad, "fiqa": _fiqa, "insuranceqa": _insuranceqa, "wikiqa": _wikiqa, "trecqa": _trecqa}


# ---- text, questions and splits ----------------------------------------------------------------

def _norm(text: str) -> str:
    """Whitespace runs (XML indentation, FiQA's double spaces) as one space, none at the ends."""
    return " ".join(text.split())


def _unptb(text: str) -> str:
    """Treebank bracket and quote tokens as the characters they stand for (tokens stay spaced)."""
    return " ".join(_PTB.get(token, token) for token in text.split())


def _gather(pairs: Iterable[tuple[str, str, str]]) -> list[Asked]:
    """(qid, question, gold answer) pairs as questions, by question text: the first qid, every
    distinct answer as gold, in first-seen order."""
    asked: dict[str, tuple[str, list[str]]] = {}
    for qid, question, answer in pairs:
        golds = asked.setdefault(question, (qid, []))[1]
        if answer not in golds:
            golds.append(answer)
    return [(qid, question, golds) for question, (qid, golds) in asked.items()]


def _held_out_size(n_questions: int) -> int:
    """Dev (and test) size: 10% rounded half up."""
    return (n_questions + 5) // 10


def _random_split(silo: str, questions: list[Question]) -> _Splits:
    """10% test, 10% dev, the rest train, drawn with a fixed per-silo seed. Questions whose texts
    differ only in case go to one split, so no question is in two; file order within a split."""
    keys = list(dict.fromkeys(q.text.lower() for q in questions))
    k = _held_out_size(len(keys))
    drawn = random.Random(f"matching/{silo}/split").sample(keys, len(keys))
    split_of = {key: "test" if i < k else "dev" if i < 2 * k else "train" for i, key in enumerate(drawn)}
    out: _Splits = {split: [] for split in SPLITS}
    for q in questions:
        out[split_of[q.text.lower()]].append(q)
    return out


def _disjoint(splits: _Splits) -> _Splits:
    """Given splits, less dev questions that test asks too and train questions that dev or test ask
    (case-insensitively), so evaluation never sees a training question."""
    held = {q.text.lower() for q in splits["test"]}
    dev = [q for q in splits["dev"] if q.text.lower() not in held]
    held |= {q.text.lower() for q in dev}
    return {"train": [q for q in splits["train"] if q.text.lower() not in held], "dev": dev, "test": splits["test"]}


# ---- reading files -------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _read_lines(path: Path) -> list[str]:
    """Lines as ``wc -l`` counts them (only ``\\n`` ends a line; a trailing ``\\r`` is dropped)."""
    lines = _read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _read_tsv(path: Path, columns: int, header: tuple[str, ...] | None = None) -> list[tuple[int, list[str]]]:
    """(line number, fields) per line after the ``header`` line, if any; a line with another number
    of fields than ``columns`` is a DataError naming it."""
    lines = _read_lines(path)
    if header is not None:
        if not lines or tuple(lines[0].split("\t")) != header:
            raise DataError(f"{path}: line 1: expected the header {'<TAB>'.join(header)!r}, "
                            f"got {lines[0] if lines else 'an empty file'!r}")
        lines = lines[1:]
    rows = []
    for n, line in enumerate(lines, start=2 if header else 1):
        fields = line.split("\t")
        if len(fields) != columns:
            raise DataError(f"{path}: line {n}: expected {columns} tab-separated fields, got {len(fields)}")
        rows.append((n, fields))
    return rows


def _read_csv(path: Path, header: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """(line number, fields) per record after the header; another number of fields than the header
    has is a DataError naming the line."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    try:
        first = next(reader, None)
        if first is None or tuple(first) != header:
            raise DataError(f"{path}: line 1: expected the header {','.join(header)!r}, got "
                            f"{','.join(first) if first else 'an empty file'!r}")
        rows = []
        for row in reader:
            if len(row) != len(header):
                raise DataError(f"{path}: line {reader.line_num}: expected {len(header)} comma-separated "
                                f"fields ({','.join(header)}), got {len(row)}")
            rows.append((reader.line_num, row))
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: {e}") from None
    return rows


def _label(path: Path, line: int, value: str) -> int:
    if value.strip() not in ("0", "1"):
        raise DataError(f"{path}: line {line}: expected the label 0 or 1, got {value!r}")
    return int(value)


# ---- cache of prepared splits --------------------------------------------------------------

def _cache_path(silo: str, negatives: int, data_dir: Path) -> Path:
    """The key covers the inputs, ``negatives``, :data:`PREPARE_VERSION` and the bm25s version (it mines)."""
    return cache_path("matching", silo, [data_dir / name for name in _files(silo)],
                      [str(PREPARE_VERSION), str(negatives), package_version("bm25s")])


def _read_cache(path: Path) -> _Splits | None:
    """The cached splits, or None when absent or not a well-formed cache file (then rebuilt, with a
    warning naming it: a bad cache entry is never reported as bad data)."""
    data = read_cache(path)
    if data is None:
        return None
    try:
        splits = data["splits"]
        if data["version"] != PREPARE_VERSION or set(splits) != set(SPLITS):
            return ignored(path, f"not version {PREPARE_VERSION}'s prepared splits")
        return {split: [_from_json(row) for row in splits[split]] for split in SPLITS}
    except (ValueError, TypeError, KeyError) as err:
        return ignored(path, f"not a prepared-splits file ({type(err).__name__}: {err})")


def _from_json(row: list) -> Question:
    """A cached ``[qid, text, candidates, labels]``; ValueError when it is not one."""
    qid, text, candidates, labels = row
    if not (all(isinstance(x, str) for x in (qid, text, *candidates)) and len(candidates) == len(labels)
            and all(y in (0, 1) and isinstance(y, int) for y in labels)):
        raise ValueError("not a cached question")
    return Question(qid, text, tuple(candidates), tuple(labels))


def _write_cache(path: Path, silo: str, negatives: int, splits: _Splits) -> None:
    payload = {"version": PREPARE_VERSION, "silo": silo, "negatives": negatives,
               "splits": {split: [[q.qid, q.text, list(q.candidates), list(q.labels)] for q in splits[split]]
                          for split in SPLITS}}
    write_cache(path, payload, level=1)  # fast: mined negatives repeat long answers
