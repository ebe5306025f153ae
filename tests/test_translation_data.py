import gzip
import json
import warnings
from pathlib import Path

import pytest

from fedsilo import datafetch
from fedsilo.datafetch import DataChangedWarning, DataError
from fedsilo.tasks.translation import data as tdata
from fedsilo.tasks.translation.data import (
    DISPLAY,
    DOMAINS,
    SPLIT_COUNTS,
    SPLITS,
    Pair,
    load_domain,
    required_files,
    split_size,
    verify_data_dir,
)

# The real data beside the project; tests that need it skip without it.
NMT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "nmt"
needs_nmt = pytest.mark.skipif(not NMT.is_dir(), reason=f"real translation data not found at {NMT}")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Prepared splits go to a per-test data root, never the user's cache."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _lines(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


def _news(root: Path, en_train=("I don &apos;t know .",), de_train=("Ich weiß es nicht .",),
          dev=(("Guten Morgen.", "Good morning."),), test=(("Gute Nacht.", "Good night."),)) -> Path:
    base = "wmt_news/opennmt_py_wmt_sample"
    _write(root, f"{base}/src-train.txt", _lines(*en_train))
    _write(root, f"{base}/tgt-train.txt", _lines(*de_train))
    for name, pairs in (("generaltest2022", dev), ("newstest2021", test)):
        _write(root, f"wmt_news/{name}/{name}.de-en.src.de", _lines(*(d for d, _ in pairs)))
        _write(root, f"wmt_news/{name}/{name}.de-en.ref.A.en", _lines(*(e for _, e in pairs)))
    return root


def _ted(root: Path, train=(("(applaus) ich bin dave.", "-lrb- applause -rrb- i 'm dave ."),),
         dev=(("Und ich sagte: Weiter!", "And I said: Carry on!"),),
         test=(("Das Flugzeug fliegt.", "The Plane flies."),)) -> Path:
    _write(root, "ted/kevinduh_hfmt/example.de-en.train.de", _lines(*(d for d, _ in train)))
    _write(root, "ted/kevinduh_hfmt/example.de-en.train.en", _lines(*(e for _, e in train)))
    for split, pairs in (("dev", dev), ("test", test)):
        _write(root, f"ted/duyvuleo_iwslt2015_topics/ted-talk-iwslt2014.{split}.sents.tsv",
               _lines(*(f"928\ttech,issues\t{d}\t{e}" for d, e in pairs)))
    return root


def _tatoeba(root: Path, pairs, header: bool = True) -> Path:
    text = ("1\t2\r\n" if header else "") + "".join(f"{en}\t{de}\r\n" for en, de in pairs)
    _write(root, "tatoeba/deu.txt", text)
    return root


def _docs(root: Path, en: dict, de: dict) -> Path:
    for lang, texts in (("en", en), ("de", de)):
        _write(root, f"salesforce_docs/ende_{lang}_dev.json",
               json.dumps({"lang": lang, "type": "x", "text": texts}, ensure_ascii=False))
    return root


def _ui(root: Path, rows, header: str = "catalog\tde\ten") -> Path:
    path = root / "debian_l10n/debian_bookworm_mo.de-en.tsv.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(_lines(header, *("\t".join(r) for r in rows)).encode()))
    return root


def _pairs(split) -> list[tuple[str, str]]:
    return [(p.source, p.target) for p in split]


# ---- reading and normalising each domain ---------------------------------------------------

def test_api_names():
    assert DOMAINS == ("news", "ted", "tatoeba", "docs", "ui") and SPLITS == ("train", "dev", "test")
    assert set(DISPLAY) == set(DOMAINS) == set(SPLIT_COUNTS)
    assert required_files(["tatoeba", "docs"]) == [
        "tatoeba/deu.txt", "salesforce_docs/ende_de_dev.json", "salesforce_docs/ende_en_dev.json"]


def test_news_is_reversed_and_detokenised(tmp_path):
    _news(tmp_path, en_train=("I don &apos;t know .", "I don 't know either .",
                              "&quot; Two soldiers came , &quot; he said &amp; left ."),
          de_train=("Ich weiß es nicht .", "Ich weiß es auch nicht .",
                    "&quot; Zwei Soldaten kamen &quot; , sagte er und ging ."))
    out = load_domain(tmp_path, "news")
    assert _pairs(out["train"]) == [
        ("Ich weiß es nicht.", "I don't know."),
        ("Ich weiß es auch nicht.", "I don't know either."),
        ('"Zwei Soldaten kamen", sagte er und ging.', '"Two soldiers came," he said & left.'),
    ]
    assert out["train"][0] == Pair("news", "Ich weiß es nicht.", "I don't know.")
    assert _pairs(out["dev"]) == [("Guten Morgen.", "Good morning.")]
    assert _pairs(out["test"]) == [("Gute Nacht.", "Good night.")]


def test_held_out_sets_are_normalised_not_detokenised(tmp_path):
    _news(tmp_path, dev=(("„Hallo“,  sagte sie…", "“Hello”,  she said…"),))
    assert _pairs(load_domain(tmp_path, "news")["dev"]) == [('"Hallo", sagte sie...', '"Hello," she said...')]


def test_ted_is_lowercase_with_ptb_brackets_mapped(tmp_path):
    _ted(tmp_path, train=(("(applaus) ich bin dave.", "-lrb- applause -rrb- i 'm dave ."),
                          ("siehe [1].", "see -lsb- 1 -rsb- , and -lcb- x -rcb- .")))
    out = load_domain(tmp_path, "ted")
    assert _pairs(out["train"]) == [("(applaus) ich bin dave.", "(applause) i'm dave."),
                                    ("siehe [1].", "see [1], and {x}.")]
    assert _pairs(out["dev"]) == [("und ich sagte: weiter!", "and i said: carry on!")]
    assert _pairs(out["test"]) == [("das flugzeug fliegt.", "the plane flies.")]


def test_tatoeba_junk_header_and_crlf_dropped(tmp_path):
    _tatoeba(tmp_path, [("Go.", "Geh."), ("Hi.", "Hallo!")])
    out = load_domain(tmp_path, "tatoeba")
    assert _pairs(out["train"]) == [("Geh.", "Go."), ("Hallo!", "Hi.")]  # n = 2: nothing held out
    assert out["dev"] == out["test"] == []


def test_tatoeba_without_header_keeps_first_line(tmp_path):
    _tatoeba(tmp_path, [("Go.", "Geh.")], header=False)
    assert _pairs(load_domain(tmp_path, "tatoeba")["train"]) == [("Geh.", "Go.")]


def test_docs_aligned_by_id_and_tags_kept(tmp_path):
    en = {"a": "Click <uicontrol>Save</uicontrol>.", "b": "Done."}
    de = {"b": "Fertig.", "a": "Klicken Sie auf <uicontrol>Speichern</uicontrol>."}
    _docs(tmp_path, en, de)
    assert _pairs(load_domain(tmp_path, "docs")["train"]) == [
        ("Klicken Sie auf <uicontrol>Speichern</uicontrol>.", "Click <uicontrol>Save</uicontrol>."),
        ("Fertig.", "Done.")]


def test_ui_gzip_tsv_stripped_format_codes_kept(tmp_path):
    _ui(tmp_path, [("Linux-PAM", " von %.*s", " from %.*s"), ("apt", "%s schlug fehl ", "%s failed "),
                   ("apt", "Fehler\\n", "Error\\n")])
    assert _pairs(load_domain(tmp_path, "ui")["train"]) == [
        ("von %.*s", "from %.*s"), ("%s schlug fehl", "%s failed"), ("Fehler\\n", "Error\\n")]


# ---- splits and de-duplication -------------------------------------------------------------

def test_split_size_rounds_half_up_and_caps():
    assert [split_size(n) for n in (0, 4, 5, 14, 15, 25, 2000, 19_994, 19_995, 50_000)] == \
        [0, 0, 1, 1, 2, 3, 200, 1999, 2000, 2000]


def _many(n_sources: int) -> list[tuple[str, str]]:
    """(en, de) pairs: every third German source has a second English translation."""
    pairs = []
    for i in range(n_sources):
        pairs.append((f"Sentence {i}.", f"Satz {i}."))
        if i % 3 == 0:
            pairs.append((f"Phrase {i}.", f"Satz {i}."))
    return pairs


def test_random_split_by_source_deterministic_and_sized(tmp_path, monkeypatch):
    _tatoeba(tmp_path, _many(95))
    first = load_domain(tmp_path, "tatoeba")
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "other-cache"))  # prepared afresh
    assert load_domain(tmp_path, "tatoeba") == first
    sources = {split: {p.source for p in first[split]} for split in SPLITS}
    targets = {split: {p.target for p in first[split]} for split in SPLITS}
    assert split_size(95) == 10
    # whole groups (pairs sharing a target come in twos here): at least k, at most one group more
    assert all(10 <= len(sources[s]) <= 11 for s in ("dev", "test"))
    for seen in (sources, targets):  # no source and no reference in two splits
        assert not (seen["train"] & seen["dev"] or seen["train"] & seen["test"] or seen["dev"] & seen["test"])
    assert sum(len(first[s]) for s in SPLITS) == 95 + 32  # no pair lost
    for split in SPLITS:  # file order within a split
        order = [int(p.source.split()[1][:-1]) for p in first[split]]
        assert order == sorted(order)


def test_random_split_does_not_depend_on_the_run_seed(tmp_path, monkeypatch):
    import random
    _tatoeba(tmp_path, _many(60))
    random.seed(1)
    a = load_domain(tmp_path, "tatoeba")
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "other-cache"))  # prepared afresh
    random.seed(2)
    assert load_domain(tmp_path, "tatoeba") == a


def test_duplicates_and_empty_pairs_removed_across_splits(tmp_path):
    _news(tmp_path,
          en_train=("Kept .", "Kept .", "In dev .", "In test .", "", "Empty German ."),
          de_train=("Behalten .", "Behalten .", "Guten Morgen .", "Gute Nacht .", "Leer .", ""),
          dev=(("Guten Morgen.", "Good morning."), ("Guten Morgen.", "Good morning."),
               ("Gute Nacht.", "Good night, dev.")),
          test=(("Gute Nacht.", "Good night."),))
    out = load_domain(tmp_path, "news")
    assert _pairs(out["train"]) == [("Behalten.", "Kept.")]
    assert _pairs(out["dev"]) == [("Guten Morgen.", "Good morning.")]
    assert _pairs(out["test"]) == [("Gute Nacht.", "Good night.")]


# ---- bad data ------------------------------------------------------------------------------

def test_line_count_mismatch(tmp_path):
    _news(tmp_path, en_train=("One .", "Two ."), de_train=("Eins .",))
    with pytest.raises(DataError, match=r"tgt-train\.txt has 1 lines but its parallel file .*src-train\.txt has 2"):
        load_domain(tmp_path, "news")


def test_docs_missing_id(tmp_path):
    _docs(tmp_path, {"a": "A.", "b": "B."}, {"a": "A."})
    with pytest.raises(DataError, match=r"ende_de_dev\.json: 1 id\(s\) of ende_en_dev\.json missing, e\.g\. 'b'"):
        load_domain(tmp_path, "docs")


def test_docs_invalid_json(tmp_path):
    _docs(tmp_path, {"a": "A."}, {"a": "A."})
    _write(tmp_path, "salesforce_docs/ende_en_dev.json", '{"text": {"a": ')
    with pytest.raises(DataError, match=r"ende_en_dev\.json: invalid JSON"):
        load_domain(tmp_path, "docs")


def test_ui_not_gzip(tmp_path):
    _write(tmp_path, "debian_l10n/debian_bookworm_mo.de-en.tsv.gz", "catalog\tde\ten\n")
    with pytest.raises(DataError, match=r"debian_bookworm_mo\.de-en\.tsv\.gz: not a readable gzip file"):
        load_domain(tmp_path, "ui")


def test_ui_truncated_gzip(tmp_path):
    _ui(tmp_path, [("apt", "Datei", "File")] * 50)
    path = tmp_path / "debian_l10n/debian_bookworm_mo.de-en.tsv.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match=r"debian_bookworm_mo\.de-en\.tsv\.gz: truncated or corrupt gzip"):
        load_domain(tmp_path, "ui")


def test_ui_bad_header_and_row(tmp_path):
    _ui(tmp_path, [("apt", "Datei", "File")], header="de\ten")
    with pytest.raises(DataError, match=r"tsv\.gz: line 1: expected the header"):
        load_domain(tmp_path, "ui")
    _ui(tmp_path, [("apt", "Datei", "File"), ("apt", "nur Deutsch")])
    with pytest.raises(DataError, match=r"tsv\.gz: line 3: expected 3 tab-separated fields"):
        load_domain(tmp_path, "ui")


def test_ted_tsv_wrong_columns(tmp_path):
    _ted(tmp_path)
    _write(tmp_path, "ted/duyvuleo_iwslt2015_topics/ted-talk-iwslt2014.test.sents.tsv", "1\ttech\tnur Deutsch\n")
    with pytest.raises(DataError, match=r"test\.sents\.tsv: line 1: expected 4 tab-separated fields"):
        load_domain(tmp_path, "ted")


def test_not_utf8(tmp_path):
    _tatoeba(tmp_path, [("Go.", "Geh.")])
    (tmp_path / "tatoeba/deu.txt").write_bytes(b"Go.\tGeh\xe9.\n")
    with pytest.raises(DataError, match=r"deu\.txt: not UTF-8"):
        load_domain(tmp_path, "tatoeba")


def test_missing_file_and_unknown_domain(tmp_path):
    with pytest.raises(DataError, match=r"translation data file not found: .*tatoeba/deu\.txt"):
        load_domain(tmp_path, "tatoeba")
    with pytest.raises(DataError, match="unknown translation domain 'php'"):
        load_domain(tmp_path, "php")


def test_verify_data_dir(tmp_path):
    _tatoeba(tmp_path, [("Go.", "Geh.")])
    with pytest.raises(DataError, match=r"translation data file not found: .*ende_de_dev\.json"):
        verify_data_dir(["tatoeba", "docs"], tmp_path)
    with pytest.warns(DataChangedWarning, match=r"not the pinned benchmark files.*tatoeba/deu\.txt"):
        verify_data_dir(["tatoeba"], tmp_path)


# ---- the prepared-splits cache -------------------------------------------------------------

def test_cache_is_used_rebuilt_when_corrupt_and_keyed_by_content(tmp_path, own_cache, monkeypatch):
    _tatoeba(tmp_path, [("Go.", "Geh.")])
    first = load_domain(tmp_path, "tatoeba")
    (cached,) = (own_cache / "prepared" / "translation").glob("tatoeba-*.json.gz")
    assert len(cached.name) == len("tatoeba-") + 64 + len(".json.gz")

    def refuse(data_dir):
        raise AssertionError("prepared again")
    prepare = tdata._PREPARE["tatoeba"]
    monkeypatch.setitem(tdata._PREPARE, "tatoeba", refuse)
    assert load_domain(tmp_path, "tatoeba") == first  # from the cache
    monkeypatch.setitem(tdata._PREPARE, "tatoeba", prepare)

    cached.write_bytes(b"not gzip")
    assert load_domain(tmp_path, "tatoeba") == first  # corrupt: ignored and rewritten
    assert json.loads(gzip.decompress(cached.read_bytes()))["splits"]["train"] == [["Geh.", "Go."]]

    _tatoeba(tmp_path, [("Hi.", "Hallo!")])  # new content, new key
    assert _pairs(load_domain(tmp_path, "tatoeba")["train"]) == [("Hallo!", "Hi.")]
    assert len(list(cached.parent.glob("tatoeba-*.json.gz"))) == 2


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    _tatoeba(tmp_path, [("Go.", "Geh.")])
    (tmp_path / "blocked").write_text("a file where the cache folder would go")
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "blocked"))
    assert _pairs(load_domain(tmp_path, "tatoeba")["train"]) == [("Geh.", "Go.")]


def test_manifest_lists_exactly_the_needed_files():
    sources = datafetch.read_manifest(Path(datafetch.__file__).parent / "tasks" / "translation" / "sources.tsv")
    assert sorted(s.path for s in sources) == sorted(required_files(DOMAINS))
    (debian,) = [s for s in sources if s.mirror_only]
    assert debian.path.startswith("debian_l10n/") and debian.commit == "-"


# ---- the real data -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """All five domains, prepared once into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("nmt-cache")))
        return {d: load_domain(NMT, d) for d in DOMAINS}


@needs_nmt
def test_real_split_counts(real):
    assert {d: {s: len(real[d][s]) for s in SPLITS} for d in DOMAINS} == SPLIT_COUNTS


@needs_nmt
def test_real_no_source_in_two_splits_and_no_empty_or_duplicate_pairs(real):
    for domain, splits in real.items():
        sources = {s: {p.source for p in splits[s]} for s in SPLITS}
        assert not (sources["train"] & sources["dev"]), domain
        assert not (sources["train"] & sources["test"]), domain
        assert not (sources["dev"] & sources["test"]), domain
        if domain in ("tatoeba", "docs", "ui"):  # split here: references are disjoint too
            targets = {s: {p.target for p in splits[s]} for s in SPLITS}
            assert not (targets["train"] & (targets["dev"] | targets["test"])), domain
            assert not (targets["dev"] & targets["test"]), domain
        for split in SPLITS:
            pairs = splits[split]
            assert all(p.source and p.target and p.domain == domain for p in pairs)
            assert len(set(pairs)) == len(pairs), (domain, split)


@needs_nmt
def test_real_spot_checks(real):
    news = real["news"]["train"][0]
    assert news.source.startswith("Es geht nicht an, dass über Ausführungsbestimmungen, deren Inhalt")
    assert news.target.startswith("It is not acceptable that, with the help of the national bureaucracies, "
                                  "Parliament's legislative prerogative")
    assert news.target.endswith("are not laid down in advance.")
    assert real["news"]["test"][0] == Pair("news", "Biker reagiert blitzschnell und verhindert Schlimmeres",
                                           "Biker reacts lightning fast and prevents worse.")
    assert real["ted"]["train"][0] == Pair("ted", "(applaus) david gallo: das ist bill lange. ich bin dave gallo.",
                                           "(applause) david gallo: this is bill lange. i'm dave gallo.")
    assert all(p.source == p.source.lower() and p.target == p.target.lower()
               for s in SPLITS for p in real["ted"][s])
    assert Pair("tatoeba", "Geh.", "Go.") in real["tatoeba"]["train"] + real["tatoeba"]["dev"] + real["tatoeba"]["test"]
    docs = [p for s in SPLITS for p in real["docs"][s]]
    assert sum("<uicontrol>" in p.source and "<uicontrol>" in p.target for p in docs) > 50
    ui = [p for s in SPLITS for p in real["ui"][s]]
    assert sum("%s" in p.source and "%s" in p.target for p in ui) > 1000
    assert not any(p.source != p.source.strip() or p.target != p.target.strip() for p in ui)
    for domain in DOMAINS:
        text = " ".join(p.source + " " + p.target for s in SPLITS for p in real[domain][s][:500])
        assert "&apos;" not in text and "&quot;" not in text and "-lrb-" not in text, domain


@needs_nmt
def test_real_cached_load_is_identical(real, tmp_path):
    assert load_domain(NMT, "docs") == real["docs"]  # prepared afresh into this test's cache
    assert load_domain(NMT, "docs") == real["docs"]  # and read back from it


@needs_nmt
def test_real_files_match_the_manifest(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verify_data_dir(list(DOMAINS), NMT)
    datafetch.ensure("translation", tmp_path / "copy", mirror=NMT, progress=False)
    # the shared data root keeps this task's files under nmt/: found without naming that folder
    datafetch.ensure("translation", tmp_path / "root-copy", mirror=NMT.parent, progress=False)
    assert (tmp_path / "root-copy" / "wmt_news").is_dir()
    assert sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file()) \
        == sorted(required_files(DOMAINS))
