"""Reading the instruct task's silos: the three benchmark silos and the generic base's public text
from the task's data folder (``sources.tsv``), an own silo through `fedsilo.sources`.

Splits of the pinned files (dev and test drawn with a fixed seed per silo, independent of any run
seed; order within a split follows the file):

- ``gsm8k`` (OpenAI GSM8K, MIT): test is the official ``test.jsonl`` (1,319); dev is 473 of the
  7,473 training questions, train the other 7,000. The prompt is the question; the response is
  the worked answer without its ``<<48/2=24>>`` calculator annotations (a tool protocol nothing
  here runs), ending in ``#### <number>``; `answer` is that number (`gold_number`).
- ``pubmedqa`` (PubMedQA PQA-L, MIT): test is the official 500 ids of ``test_ground_truth.json``
  (their labels checked against ``final_decision``); of the other 500, dev is 50 and train 450. The
  prompt is lm-evaluation-harness's ``Abstract: {contexts}\\nQuestion: {question}\\nAnswer:`` (the
  contexts joined by newlines); the response is the decision word, scored among ("yes", "no", "maybe").
- ``codealpaca`` (Code Alpaca, CC BY-NC 4.0: research only): 4,535 (instruction, input, output)
  records grouped by instruction (case and spacing aside: 4,534 groups); dev and test are 453
  groups each, so no instruction is in two splits.
- ``news`` (the English side of OpenNMT-py's WMT sample, MIT repository): plain text for
  pre-training the generic base, no silo's own. Moses-detokenised and punctuation-normalised as the
  translation task reads the same file; train is ``src-train.txt`` (empty lines and exact repeats
  dropped), dev and test are the first and second halves of ``src-val.txt`` (25 lines each).

Preparing the news text costs seconds of regex work, so prepared splits are cached under the data
root, keyed by the input files' contents (every benchmark silo alike).
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from fedsilo.datafetch import DataError, read_manifest, require_files, warn_if_unpinned
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.sources.load import all_problems, group_key, load_accepted, load_rows

from ..prepared import cache_path, package_version, read_cache, write_cache
from .plugin import BENCHMARK, DISPLAY, InstructSettings
from .records import Record, alpaca
from .source import InstructSource, converted, own_records

__all__ = [
    "BENCHMARK", "DISPLAY", "LICENCES", "SPLITS", "SPLIT_COUNTS", "PREPARE_VERSION", "PUBMEDQA_OPTIONS",
    "load_silo", "load_benchmark", "load_own", "gold_number", "prompt_text", "items", "inspect_silo", "required_files",
    "fetch_files", "verify_data_dir",
]

LICENCES = {"gsm8k": "MIT", "pubmedqa": "MIT", "codealpaca": "CC BY-NC 4.0 (research only)",
            "news": "MIT (OpenNMT-py's sample), WMT-derived text"}
SPLITS = ("train", "dev", "test")
PUBMEDQA_OPTIONS = ("yes", "no", "maybe")  # lm-evaluation-harness's order: the label is an index into it

PREPARE_VERSION = 1
"""Bump when preparation changes what it produces: it is part of the cache key."""

SPLIT_COUNTS: dict[str, dict[str, int]] = {
    "gsm8k": {"train": 7000, "dev": 473, "test": 1319},
    "pubmedqa": {"train": 450, "dev": 50, "test": 500},
    "codealpaca": {"train": 3629, "dev": 453, "test": 453},
    "news": {"train": 9943, "dev": 25, "test": 25},
}
"""Records per silo and split on the pinned files (asserted by the tests)."""

GSM8K_DEV = 473
PUBMEDQA_DEV = 50
CODEALPACA_HELD_OUT = 453  # instruction groups in dev, and as many in test (10% of 4,534 each)

_NEWS = "nmt/wmt_news/opennmt_py_wmt_sample"
_FILES = {
    "gsm8k": ["gsm8k/train.jsonl", "gsm8k/test.jsonl"],
    "pubmedqa": ["pubmedqa/ori_pqal.json", "pubmedqa/test_ground_truth.json"],
    "codealpaca": ["codealpaca/new_codealpaca.json"],
    "news": [f"{_NEWS}/src-train.txt", f"{_NEWS}/src-val.txt"],
}
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def load_silo(settings: InstructSettings, silo: str, data_dir: Path | None) -> dict[str, list[Record]]:
    """A silo's records per split: its own source's (malformed rows refused or skipped as the source
    says), else the benchmark silo's from `data_dir`."""
    source = settings.own_source(silo)
    return load_benchmark(data_dir, silo) if source is None else load_own(silo, source)


def load_own(name: str, source: InstructSource) -> dict[str, list[Record]]:
    """An own silo's records per split, read by `fedsilo.sources`."""
    return load_accepted(name, source, own_records)


def load_benchmark(data_dir: str | Path, silo: str) -> dict[str, list[Record]]:
    """A benchmark silo's records keyed "train"/"dev"/"test", from the cache when the inputs are unchanged."""
    _check_silo(silo)
    data_dir = Path(data_dir)
    require_files("instruct", data_dir, _FILES[silo])
    paths = [data_dir / name for name in _FILES[silo]]
    versions = [str(PREPARE_VERSION)] + ([package_version("sacremoses")] if silo == "news" else [])
    cache = cache_path("instruct", silo, paths, versions)
    splits = _read_cache(cache)
    if splits is None:
        splits = _PREPARE[silo](data_dir)
        write_cache(cache, {"version": PREPARE_VERSION, "silo": silo,
                            "splits": {s: [_to_json(r) for r in splits[s]] for s in SPLITS}})
    return splits


def gold_number(answer: str) -> str:
    """GSM8K's final number: what follows the last ``####``, thousands commas removed ("1,080" →
    "1080"); a sign and decimals are kept. ValueError when there is no number there."""
    _, mark, tail = answer.rpartition("####")
    number = tail.strip().replace(",", "")
    if not mark or not _NUMBER.fullmatch(number):
        raise ValueError(f"no final number after '####' (got {tail.strip()[:40]!r})" if mark
                         else "no '####' before the final number")
    return number


def prompt_text(record: Record) -> str:
    """What groups a record in `fedsilo data check`: its prompt's text, a plain-text record's text."""
    return "\n".join(content for _, content in record.turns) if record.turns else record.response


def items(pairs: Iterable[tuple[str, Record]]) -> list[Item]:
    """(file:line, record) pairs as `fedsilo data check` compares them: grouped by prompt."""
    return [Item(where, prompt_text(r), (r.turns, r.response)) for where, r in pairs]


def inspect_silo(settings: InstructSettings, silo: str, data_dir: Path | None) -> SiloCheck:
    """`fedsilo data check`'s view of one silo (every malformed row listed, none refused here)."""
    source = settings.own_source(silo)
    if source is None:
        splits = load_benchmark(data_dir, silo)
        return inspect_items(silo, "benchmark", "records", {s: items(("", r) for r in v) for s, v in splits.items()},
                             "text" if silo == "news" else "prompt",
                             files=[Path(data_dir) / f for f in required_files([silo])])
    loaded = load_rows(silo, source)
    pairs, problems = converted(loaded)
    return inspect_items(silo, f"{source.format_name}, chat" if source.chat else source.format_name, "records",
                         {s: items(v) for s, v in pairs.items()}, "prompt", all_problems(loaded, problems),
                         source.bad_rows == "skip", loaded.files)


def required_files(silos: Iterable[str]) -> list[str]:
    """Paths, relative to the data folder, that the benchmark `silos` read (in silo order, no repeats)."""
    out: list[str] = []
    for silo in silos:
        _check_silo(silo)
        out += [f for f in _FILES[silo] if f not in out]
    return out


def fetch_files(silos: Iterable[str]) -> list[str]:
    """The manifest's paths of the benchmark `silos`: their data files and the licence and readme
    beside them (an own silos' run with the built-in tokenizer fetches the news text alone)."""
    folders = {Path(f).parent for f in required_files(silos)}
    manifest = read_manifest(Path(__file__).parent / "sources.tsv")
    return [src.path for src in manifest if Path(src.path).parent in folders]


def verify_data_dir(silos: Iterable[str], data_dir: Path) -> None:
    """An explicit ``task.data_dir``, checked as the cache is: the files the benchmark `silos` need
    exist, and files that differ from the pinned ones are warned about. Records are checked as they load."""
    names = required_files(silos)
    require_files("instruct", Path(data_dir), names)
    warn_if_unpinned("instruct", Path(data_dir), names)


def _check_silo(silo: str) -> None:
    if silo not in BENCHMARK:
        raise DataError(f"unknown instruct benchmark silo {silo!r}; expected one of {', '.join(BENCHMARK)}")


# ---- preparation per silo ------------------------------------------------------------------

def _gsm8k(data_dir: Path) -> dict[str, list[Record]]:
    train, test = (_gsm8k_file(data_dir / name) for name in _FILES["gsm8k"])
    dev = set(_draw("gsm8k", range(len(train)), GSM8K_DEV, "training questions", data_dir / _FILES["gsm8k"][0]))
    return {"train": [r for i, r in enumerate(train) if i not in dev],
            "dev": [r for i, r in enumerate(train) if i in dev], "test": test}


def _gsm8k_file(path: Path) -> list[Record]:
    out = []
    for n, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        row = _json(path, line, f":{n}")
        question, answer = _field(row, "question", f"{path}:{n}"), _field(row, "answer", f"{path}:{n}")
        try:
            gold = gold_number(answer)
        except ValueError as e:
            raise DataError(f"{path}:{n}: {e}") from None
        out.append(alpaca(question, output=_CALCULATOR.sub("", answer).strip(), answer=gold))
    return out


def _pubmedqa(data_dir: Path) -> dict[str, list[Record]]:
    pqal_path, truth_path = (data_dir / name for name in _FILES["pubmedqa"])
    pqal, truth = _json(pqal_path, _read_text(pqal_path)), _json(truth_path, _read_text(truth_path))
    if not isinstance(pqal, dict) or not isinstance(truth, dict):
        raise DataError(f"{pqal_path} and {truth_path}: expected JSON objects keyed by PubMed id")
    records = {}
    for pmid, doc in pqal.items():
        where = f"{pqal_path}: id {pmid}"
        contexts, decision = _field(doc, "CONTEXTS", where, list), _field(doc, "final_decision", where)
        if decision not in PUBMEDQA_OPTIONS:
            raise DataError(f"{where}: final_decision {decision!r} is not one of {', '.join(PUBMEDQA_OPTIONS)}")
        prompt = f"Abstract: {chr(10).join(contexts)}\nQuestion: {_field(doc, 'QUESTION', where)}\nAnswer:"
        records[pmid] = Record((("user", prompt),), decision, options=PUBMEDQA_OPTIONS,
                               label=PUBMEDQA_OPTIONS.index(decision))
    for pmid, label in truth.items():
        if pmid not in records:
            raise DataError(f"{truth_path}: test id {pmid} is not in {pqal_path.name}")
        if records[pmid].response != label:
            raise DataError(f"{truth_path}: test id {pmid} is labelled {label!r} but its final_decision in "
                            f"{pqal_path.name} is {records[pmid].response!r}")
    rest = [pmid for pmid in records if pmid not in truth]
    dev = set(_draw("pubmedqa", rest, PUBMEDQA_DEV, "questions outside the test ids", pqal_path))
    return {"train": [records[p] for p in rest if p not in dev], "dev": [records[p] for p in rest if p in dev],
            "test": [records[p] for p in records if p in truth]}


def _codealpaca(data_dir: Path) -> dict[str, list[Record]]:
    path = data_dir / _FILES["codealpaca"][0]
    rows = _json(path, _read_text(path))
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of {{instruction, input, output}} records")
    records = []
    for i, row in enumerate(rows):
        where = f"{path}: record {i}"
        instruction = _field(row, "instruction", where)
        records.append((group_key(instruction), alpaca(instruction, _field(row, "input", where, empty_ok=True),
                                                        _field(row, "output", where).strip())))
    groups = list(dict.fromkeys(key for key, _ in records))
    drawn = _draw("codealpaca", groups, 2 * CODEALPACA_HELD_OUT, "distinct instructions", path)
    split_of = {key: "test" for key in drawn[:CODEALPACA_HELD_OUT]} | {key: "dev" for key in drawn[CODEALPACA_HELD_OUT:]}
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for key, record in records:
        out[split_of.get(key, "train")].append(record)
    return out


def _news(data_dir: Path) -> dict[str, list[Record]]:
    """English lines as the translation task reads this file (its detokeniser and normaliser)."""
    from ..translation.data import _Normaliser, _read_lines

    nm = _Normaliser()
    train_path, val_path = (data_dir / name for name in _FILES["news"])
    text = lambda line: nm.norm("en", nm.detok("en", line))  # noqa: E731
    val = [t for t in map(text, _read_lines(val_path)) if t]
    dev, test = val[:len(val) // 2], val[len(val) // 2:]
    held = set(val)
    train = [t for t in dict.fromkeys(map(text, _read_lines(train_path))) if t and t not in held]
    return {s: [Record((), t) for t in lines] for s, lines in (("train", train), ("dev", dev), ("test", test))}


_PREPARE: dict[str, Callable[[Path], dict[str, list[Record]]]] = {
    "gsm8k": _gsm8k, "pubmedqa": _pubmedqa, "codealpaca": _codealpaca, "news": _news}


def _draw(silo: str, population, k: int, what: str, path: Path) -> list:
    """`k` of `population`, drawn with the silo's fixed seed (independent of any run seed)."""
    if len(population) <= k:
        raise DataError(f"{path}: {len(population)} {what}; the {silo} silo's held-out draw needs more than {k}")
    return random.Random(f"instruct/{silo}/split").sample(population, k)


# ---- reading files -------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _json(path: Path, text: str, line: str = ""):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}{line}: invalid JSON: {e}") from None


def _field(obj, key: str, where: str, kind: type = str, empty_ok: bool = False):
    """`obj[key]` of type `kind` (a list: of strings), non-empty unless `empty_ok`; else a DataError."""
    value = obj.get(key) if isinstance(obj, dict) else None
    well_formed = isinstance(value, kind) and (kind is not list or all(isinstance(x, str) for x in value))
    if not well_formed or (not empty_ok and not value):
        what = "list of texts" if kind is list else "text"
        raise DataError(f"{where}: expected {'a' if empty_ok else 'a non-empty'} {what} under {key!r}")
    return value


# ---- cache of prepared splits --------------------------------------------------------------

def _to_json(r: Record) -> list:
    return [[list(t) for t in r.turns], r.response, r.answer, list(r.options), r.label]


def _read_cache(path: Path) -> dict[str, list[Record]] | None:
    """The cached splits, or None when absent or not a well-formed cache file (then rebuilt)."""
    try:
        data = read_cache(path)
        if data is None or data["version"] != PREPARE_VERSION or set(data["splits"]) != set(SPLITS):
            return None
        return {s: [Record(tuple((role, text) for role, text in turns), response, answer, tuple(options), label)
                    for turns, response, answer, options, label in data["splits"][s]] for s in SPLITS}
    except (ValueError, TypeError, KeyError):
        return None
