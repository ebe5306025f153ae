"""Reading the five German→English translation silos (one domain each) from ``data/nmt``.

The paper's OPUS PHP/Ubuntu/OpenSubtitles corpora are not public here, so public stand-ins are used:

- ``news``: WMT training data as sampled by OpenNMT-py (10k pairs; Europarl/news-commentary/web
  text, English→German, Moses-tokenised with ``&apos;``-style escapes: reversed and detokenised).
  The paper evaluates the news engine on newstest sets: test is newstest2021 de-en; dev is
  generaltest2022 de-en, the only other de-en set here, which mixes news with e-commerce,
  social-media and conversational text.
- ``ted``: 5k training pairs that are LOWERCASED (English side PTB-tokenised, ``-lrb-``); the
  cased IWSLT 2014 dev/test sets are lowercased too, so the whole silo is lowercase text.
- ``tatoeba``: short everyday sentences (en<TAB>de; a junk first line ``1<TAB>2``).
- ``docs``: Salesforce help text (JSON id→text, aligned by id; inline XML tags kept as text).
- ``ui``: Debian 12 message catalogs (gzip TSV ``catalog de en``; format codes such as ``%s`` kept).

Every German source and English target is detokenised where the file is tokenised, then
normalised with sacremoses' ``MosesPunctNormalizer`` (``de`` / ``en``), the form sacreBLEU scores.
Domains without a given dev/test set are split at random (fixed seed, independent of any run
seed) by German source, so no source is in two splits. Preparing all five domains costs seconds of
regex work, so prepared splits are cached under the data root, keyed by the input files' contents.
"""
from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fedsilo.datafetch import DataError, require_files, warn_if_unpinned
from fedsilo.sources.check import Item, SiloCheck, inspect_items
from fedsilo.sources.load import Loaded, load_accepted, load_rows

from ..prepared import cache_path, package_version, read_cache, write_cache
from .plugin import DISPLAY, DOMAINS, TranslationSettings

__all__ = [
    "DOMAINS", "DISPLAY", "SPLITS", "SPLIT_COUNTS", "PREPARE_VERSION", "DataError", "Pair",
    "load_domain", "load_silo", "own_pairs", "normalised", "items", "inspect_silo", "required_files", "verify_data_dir", "split_size",
]

SPLITS = ("train", "dev", "test")

PREPARE_VERSION = 2
"""Bump when preparation changes what it produces: it is part of the cache key."""

SPLIT_COUNTS: dict[str, dict[str, int]] = {
    "news": {"train": 9957, "dev": 1980, "test": 1000},
    "ted": {"train": 4936, "dev": 566, "test": 1098},
    "tatoeba": {"train": 45568, "dev": 2217, "test": 2215},
    "docs": {"train": 1600, "dev": 200, "test": 200},
    "ui": {"train": 32591, "dev": 2018, "test": 2025},
}
"""Pairs per domain and split on the pinned files (asserted by the tests)."""

MAX_HELD_OUT = 2000
"""Dev and test size (in German sources) for domains split at random, as in the paper."""

_NEWS = "wmt_news/opennmt_py_wmt_sample"
_TED_TRAIN = "ted/kevinduh_hfmt/example.de-en.train"
_TED_EVAL = "ted/duyvuleo_iwslt2015_topics/ted-talk-iwslt2014.{}.sents.tsv"
_FILES = {
    "news": [f"{_NEWS}/tgt-train.txt", f"{_NEWS}/src-train.txt",
             "wmt_news/generaltest2022/generaltest2022.de-en.src.de",
             "wmt_news/generaltest2022/generaltest2022.de-en.ref.A.en",
             "wmt_news/newstest2021/newstest2021.de-en.src.de",
             "wmt_news/newstest2021/newstest2021.de-en.ref.A.en"],
    "ted": [f"{_TED_TRAIN}.de", f"{_TED_TRAIN}.en", _TED_EVAL.format("dev"), _TED_EVAL.format("test")],
    "tatoeba": ["tatoeba/deu.txt"],
    "docs": ["salesforce_docs/ende_de_dev.json", "salesforce_docs/ende_en_dev.json"],
    "ui": ["debian_l10n/debian_bookworm_mo.de-en.tsv.gz"],
}

# PTB bracket tokens in the TED training English (the only PTB escapes it uses).
_PTB = {"-lrb-": "(", "-rrb-": ")", "-lsb-": "[", "-rsb-": "]", "-lcb-": "{", "-rcb-": "}"}

_Raw = list[tuple[str, str]]  # (German, English) after preparation


@dataclass(frozen=True)
class Pair:
    """One sentence pair: German ``source`` and English ``target``, normalised and detokenised."""

    domain: str
    source: str
    target: str
    where: str = field(default="", compare=False)  # an own silo's file:line ("" for the benchmark's)


def load_silo(settings: TranslationSettings, domain: str, data_dir: Path | None) -> dict[str, list[Pair]]:
    """A silo's pairs per split: its own source's files (malformed rows refused or skipped as the
    source says), else the benchmark domain's from `data_dir`."""
    source = settings.own_source(domain)
    if source is None:
        return load_domain(data_dir, domain)
    return load_accepted(domain, source, lambda loaded: (normalised(own_pairs(loaded)), []))


def own_pairs(loaded: Loaded) -> dict[str, list[Pair]]:
    """Rows as pairs, text as written (stripped): what `fedsilo data check` shows, to be found in the file."""
    return {split: [Pair(loaded.name, r.values["source"], r.values["target"], r.where) for r in rows]
            for split, rows in loaded.splits.items()}


def normalised(splits: dict[str, list[Pair]]) -> dict[str, list[Pair]]:
    """Own pairs as a run takes them: punctuation-normalised as the benchmark domains are (German
    „ “ – become " " -, which the tokenizer knows), references too, so an own domain is trained and
    scored in the form every other domain is."""
    nm = _Normaliser()
    return {split: [Pair(p.domain, nm.norm("de", p.source), nm.norm("en", p.target), p.where) for p in pairs]
            for split, pairs in splits.items()}


def items(pairs: Iterable[Pair]) -> list[Item]:
    """Pairs as `fedsilo data check` compares them: grouped by source."""
    return [Item(p.where, p.source, (p.source, p.target)) for p in pairs]


def inspect_silo(settings: TranslationSettings, domain: str, data_dir: Path | None) -> SiloCheck:
    """`fedsilo data check`'s view of one silo (every malformed row listed, none refused here)."""
    source = settings.own_source(domain)
    if source is None:
        splits = load_domain(data_dir, domain)
        return inspect_items(domain, "benchmark", "pairs", {s: items(v) for s, v in splits.items()}, "source",
                             files=[Path(data_dir) / f for f in required_files([domain])])
    loaded = load_rows(domain, source)
    pairs = own_pairs(loaded)
    check = inspect_items(domain, source.format_name, "pairs", {s: items(v) for s, v in pairs.items()},
                          "source", loaded.problems, source.bad_rows == "skip", loaded.files)
    as_run = normalised(pairs)
    changed = [p.where for split in SPLITS for p, q in zip(pairs[split], as_run[split]) if p != q]
    if changed:
        check.notes.append(f"{len(changed)} pair(s) punctuation-normalised for the run as the benchmark domains are "
                           f"(e.g. „ “ – as \" \" -; references too), first {changed[0]}")
    return check


def required_files(domains: Iterable[str]) -> list[str]:
    """Paths, relative to the data folder, that ``domains`` need (in domain order, no repeats)."""
    out: list[str] = []
    for domain in domains:
        _check_domain(domain)
        out += [f for f in _FILES[domain] if f not in out]
    return out


def load_domain(data_dir: str | Path, domain: str) -> dict[str, list[Pair]]:
    """One domain's pairs keyed "train"/"dev"/"test", from the cache when the inputs are unchanged."""
    _check_domain(domain)
    data_dir = Path(data_dir)
    require_files("translation", data_dir, _FILES[domain])
    cache = _cache_path(domain, [data_dir / name for name in _FILES[domain]])
    splits = _read_cache(cache)
    if splits is None:
        splits = _PREPARE[domain](data_dir)
        _write_cache(cache, domain, splits)
    return {split: [Pair(domain, s, t) for s, t in splits[split]] for split in SPLITS}


def verify_data_dir(domains: Iterable[str], data_dir: Path) -> None:
    """An explicit ``task.data_dir``, checked as the cache is: the files the benchmark ``domains``
    need exist, and files that differ from the pinned ones are warned about. Records are checked as
    they load."""
    data_dir = Path(data_dir)
    names = required_files(domains)
    require_files("translation", data_dir, names)
    warn_if_unpinned("translation", data_dir, names)


def split_size(n_sources: int) -> int:
    """Dev (and test) size for a randomly split domain of ``n_sources`` distinct German sources:
    10% rounded half up, at most :data:`MAX_HELD_OUT`, so small domains keep most for training."""
    return min(MAX_HELD_OUT, (n_sources + 5) // 10)


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise DataError(f"unknown translation domain {domain!r}; expected one of {', '.join(DOMAINS)}")


# ---- preparation per domain ----------------------------------------------------------------

class _Normaliser:
    """Moses detokenisation and punctuation normalisation, memoised (targets repeat a lot)."""

    def __init__(self) -> None:
        from sacremoses import MosesDetokenizer, MosesPunctNormalizer  # only needed when preparing
        self._detok = {lang: MosesDetokenizer(lang=lang) for lang in ("de", "en")}
        self._punct = {lang: MosesPunctNormalizer(lang=lang) for lang in ("de", "en")}
        self._seen: dict[tuple[str, str], str] = {}

    def norm(self, lang: str, text: str) -> str:
        key = (lang, text)
        if key not in self._seen:
            self._seen[key] = self._punct[lang].normalize(text.strip()).strip()
        return self._seen[key]

    def detok(self, lang: str, text: str, ptb: bool = False) -> str:
        tokens = text.split()
        if ptb:
            tokens = [_PTB.get(t, t) for t in tokens]
        return self._detok[lang].detokenize(tokens)


def _news(data_dir: Path) -> dict[str, _Raw]:
    """OpenNMT-py's sample is English→German: its tgt (German) becomes our source."""
    nm = _Normaliser()
    de, en = _read_parallel(data_dir, *_FILES["news"][:2])
    train = [(nm.norm("de", nm.detok("de", d)), nm.norm("en", nm.detok("en", e))) for d, e in zip(de, en)]
    held_out = {}
    for split, (de_name, en_name) in (("dev", _FILES["news"][2:4]), ("test", _FILES["news"][4:6])):
        de, en = _read_parallel(data_dir, de_name, en_name)
        held_out[split] = [(nm.norm("de", d), nm.norm("en", e)) for d, e in zip(de, en)]
    return _finish({"train": train, **held_out})


def _ted(data_dir: Path) -> dict[str, _Raw]:
    """The training pairs are lowercased, so every split is lowercased for the silo to be one domain."""
    nm = _Normaliser()
    de, en = _read_parallel(data_dir, *_FILES["ted"][:2])
    out = {"train": [(nm.norm("de", nm.detok("de", d, ptb=True)).lower(),
                      nm.norm("en", nm.detok("en", e, ptb=True)).lower()) for d, e in zip(de, en)]}
    for split, name in (("dev", _FILES["ted"][2]), ("test", _FILES["ted"][3])):
        path = data_dir / name
        rows = _read_tsv(path, _read_lines(path), columns=4, what="talkid, topics, de, en")
        out[split] = [(nm.norm("de", r[2]).lower(), nm.norm("en", r[3]).lower()) for _, r in rows]
    return _finish(out)


def _tatoeba(data_dir: Path) -> dict[str, _Raw]:
    """``en<TAB>de`` per line (a third attribution column, as in manythings.org's files, is ignored)."""
    nm = _Normaliser()
    path = data_dir / _FILES["tatoeba"][0]
    lines = _read_lines(path)
    skip = 1 if lines[:1] == ["1\t2"] else 0  # this copy's junk first line
    rows = _read_tsv(path, lines[skip:], columns=2, what="English<TAB>German", first_line=1 + skip,
                     extra_ok=True)
    return _random_split("tatoeba", [(nm.norm("de", r[1]), nm.norm("en", r[0])) for _, r in rows])


def _docs(data_dir: Path) -> dict[str, _Raw]:
    """Two JSON files mapping the same ids to German and English text (English file order)."""
    nm = _Normaliser()
    de_path, en_path = (data_dir / name for name in _FILES["docs"])
    de, en = _read_json_texts(de_path), _read_json_texts(en_path)
    for path, have, other_path, other in ((de_path, de, en_path, en), (en_path, en, de_path, de)):
        missing = [k for k in other if k not in have]
        if missing:
            raise DataError(f"{path}: {len(missing)} id(s) of {other_path.name} missing, e.g. {missing[0]!r}")
    return _random_split("docs", [(nm.norm("de", de[k]), nm.norm("en", en[k])) for k in en])


def _ui(data_dir: Path) -> dict[str, _Raw]:
    """gzip TSV ``catalog de en``; surrounding spaces of a message are layout, not text."""
    nm = _Normaliser()
    path = data_dir / _FILES["ui"][0]
    try:
        packed = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        raw = gzip.decompress(packed)
    except OSError as e:  # gzip.BadGzipFile
        raise DataError(f"{path}: not a readable gzip file ({e})") from None
    except (EOFError, zlib.error) as e:
        raise DataError(f"{path}: truncated or corrupt gzip data ({e})") from None
    lines = _split_lines(path, raw)
    if not lines or lines[0].split("\t") != ["catalog", "de", "en"]:
        raise DataError(f"{path}: line 1: expected the header 'catalog<TAB>de<TAB>en', "
                        f"got {lines[0] if lines else 'an empty file'!r}")
    rows = _read_tsv(path, lines[1:], columns=3, what="catalog<TAB>de<TAB>en", first_line=2)
    return _random_split("ui", [(nm.norm("de", r[1]), nm.norm("en", r[2])) for _, r in rows])


_PREPARE: dict[str, Callable[[Path], dict[str, _Raw]]] = {
    "news": _news, "ted": _ted, "tatoeba": _tatoeba, "docs": _docs, "ui": _ui}


# ---- splitting and de-duplication ----------------------------------------------------------

def _dedupe(pairs: _Raw) -> _Raw:
    """Drop pairs with an empty side and repeats of an exact pair (first kept, order kept)."""
    return list(dict.fromkeys(p for p in pairs if p[0] and p[1]))


def _finish(splits: dict[str, _Raw]) -> dict[str, _Raw]:
    """Given splits: dedupe each, then drop dev pairs whose source is in test and train pairs whose
    source is in dev or test, so evaluation never sees a training source."""
    out = {split: _dedupe(splits[split]) for split in SPLITS}
    held: set[str] = {s for s, _ in out["test"]}
    out["dev"] = [p for p in out["dev"] if p[0] not in held]
    held |= {s for s, _ in out["dev"]}
    out["train"] = [p for p in out["train"] if p[0] not in held]
    return out


def _groups(pairs: _Raw) -> list[_Raw]:
    """Pairs linked by a shared German source or a shared English target, in file order: Tatoeba
    gives one English sentence several German translations, so splitting by source alone would put
    40% of test references among the training targets."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in pairs:
        a, b = root("s\0" + s), root("t\0" + t)
        if a != b:
            parent[b] = a
    groups: dict[str, _Raw] = {}
    for pair in pairs:
        groups.setdefault(root("s\0" + pair[0]), []).append(pair)
    return list(groups.values())


def _random_split(domain: str, pairs: _Raw) -> dict[str, _Raw]:
    """Dev and test of at least :func:`split_size` German sources each, drawn with a fixed
    per-domain seed as whole groups (pairs sharing a source or a target, see :func:`_groups`), so no
    source and no reference is in two splits; order within a split follows the file."""
    pairs = _dedupe(pairs)
    k = split_size(len({s for s, _ in pairs}))
    groups = _groups(pairs)
    order = random.Random(f"translation/{domain}/split").sample(range(len(groups)), len(groups))
    split_of: dict[tuple[str, str], str] = {}
    sources = {"test": set(), "dev": set()}
    for g in order:
        split = next((x for x in ("test", "dev") if len(sources[x]) < k), "train")
        for pair in groups[g]:
            split_of[pair] = split
        if split != "train":
            sources[split] |= {s for s, _ in groups[g]}
    out: dict[str, _Raw] = {split: [] for split in SPLITS}
    for pair in pairs:
        out[split_of[pair]].append(pair)
    return out


# ---- reading files -------------------------------------------------------------------------

def _read_lines(path: Path) -> list[str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    return _split_lines(path, raw)


def _split_lines(path: Path, raw: bytes) -> list[str]:
    """Lines as ``wc -l`` counts them (only ``\\n`` ends a line; a trailing ``\\r`` is dropped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _read_parallel(data_dir: Path, de_name: str, en_name: str) -> tuple[list[str], list[str]]:
    """Line-aligned German and English files; differing line counts are a DataError."""
    de, en = _read_lines(data_dir / de_name), _read_lines(data_dir / en_name)
    if len(de) != len(en):
        raise DataError(f"{data_dir / de_name} has {len(de)} lines but its parallel file "
                        f"{data_dir / en_name} has {len(en)}")
    return de, en


def _read_tsv(path: Path, lines: list[str], columns: int, what: str, first_line: int = 1,
              extra_ok: bool = False) -> list[tuple[int, list[str]]]:
    """(line number, fields) per line; a line with fewer (or, unless ``extra_ok``, more) fields
    than ``columns`` is a DataError naming the line."""
    rows = []
    for n, line in enumerate(lines, start=first_line):
        fields = line.split("\t")
        if len(fields) < columns or (len(fields) > columns and not extra_ok):
            raise DataError(f"{path}: line {n}: expected {columns} tab-separated fields ({what}), "
                            f"got {len(fields)}")
        rows.append((n, fields))
    return rows


def _read_json_texts(path: Path) -> dict[str, str]:
    """The ``text`` object (id → sentence) of a Salesforce localization-xml-mt file."""
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON: {e}") from None
    texts = data.get("text") if isinstance(data, dict) else None
    if not isinstance(texts, dict) or not all(isinstance(v, str) for v in texts.values()):
        raise DataError(f"{path}: expected a JSON object whose 'text' maps ids to strings")
    return texts


# ---- cache of prepared splits --------------------------------------------------------------

def _cache_path(domain: str, paths: list[Path]) -> Path:
    """The key covers the inputs, :data:`PREPARE_VERSION` and the sacremoses version."""
    return cache_path("translation", domain, paths, [str(PREPARE_VERSION), package_version("sacremoses")])


def _read_cache(path: Path) -> dict[str, _Raw] | None:
    """The cached splits, or None when absent or not a well-formed cache file (then rebuilt)."""
    try:
        data = read_cache(path)
        splits = data["splits"]
        if data["version"] != PREPARE_VERSION or set(splits) != set(SPLITS):
            return None
        out = {split: [(s, t) for s, t in splits[split]] for split in SPLITS}
    except (ValueError, TypeError, KeyError):
        return None
    if not all(isinstance(x, str) for rows in out.values() for pair in rows for x in pair):
        return None
    return out


def _write_cache(path: Path, domain: str, splits: dict[str, _Raw]) -> None:
    write_cache(path, {"version": PREPARE_VERSION, "domain": domain, "splits": {k: splits[k] for k in SPLITS}})
