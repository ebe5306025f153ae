import json

import pytest
from tokenizers import models

from fedsilo.tasks.translation import tokenizer as tk
from fedsilo.tasks.translation.tokenizer import (
    cache_key,
    fertility,
    fit_tokenizer,
    load_or_fit,
)

SUBJ_DE = ["Der Hund", "Die Katze", "Das Mädchen", "Der Bäcker", "Die Ärztin", "Unser Nachbar"]
VERB_DE = ["läuft über die Brücke", "isst frühmorgens Brötchen", "grüßt die Lehrerin", "öffnet das Fenster",
           "schläft im Garten", "liest die Zeitung"]
SUBJ_EN = ["The dog", "The cat", "The girl", "The baker", "The doctor", "Our neighbour"]
VERB_EN = ["runs across the bridge", "eats rolls early in the morning", "greets the teacher",
           "opens the window", "sleeps in the garden", "reads the newspaper"]
EXTRA = ['Ja, oder? Nein: 3,5 km!', 'Er sagte: "Schön!"', "See <b>a/b</b> (p. 12); s.", "Maße & Gewichte – 10 %"]


def corpus() -> list[str]:
    texts = []
    for sd, se in zip(SUBJ_DE, SUBJ_EN):
        for vd, ve in zip(VERB_DE, VERB_EN):
            texts += [f"{sd} {vd}.", f"{se} {ve}.", f"{sd} {vd}, oder?", f"Why? {se} {ve}!"]
    return texts + EXTRA * 3


@pytest.fixture(scope="module", params=tk.MODELS)
def fitted(request):
    return fit_tokenizer(corpus(), vocab_size=300, model=request.param)


def test_special_tokens(fitted):
    assert (fitted.pad_token_id, fitted.eos_token_id, fitted.unk_token_id) == (0, 1, 2)
    assert fitted.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert 3 < len(fitted) <= 300
    with_eos = fitted("Der Hund läuft.")["input_ids"]
    without = fitted("Der Hund läuft.", add_special_tokens=False)["input_ids"]
    assert with_eos == without + [1] and 1 not in without
    batch = fitted(["Der Hund.", "Die Katze läuft über die Brücke."], padding=True)["input_ids"]
    assert batch[0][-1] == 0 and 1 in batch[0]  # padded after the EOS


@pytest.mark.parametrize("text", [
    "Die Ärztin grüßt das Mädchen, oder? Ja: 12 % (s. Maße)!",
    'Er sagte: "Ja, 3,5 km!"  Nein.',          # a double space survives
    "Der Bäcker öffnet das Fenster , oder ?",  # so does space before punctuation
])
def test_decode_round_trip(fitted, text):
    ids = fitted(text)["input_ids"]
    assert 2 not in ids  # every character was seen in fitting
    assert fitted.decode(ids, skip_special_tokens=True) == text


def test_nfkc_normalises(fitted):
    # the "ﬁ" ligature and a no-break space are NFKC-equal to "fi" and " "
    assert fitted("Die ﬁ")["input_ids"] == fitted("Die fi")["input_ids"]
    assert fitted("Der\u00a0Hund")["input_ids"] == fitted("Der Hund")["input_ids"]


def test_special_token_text_is_text(fitted):
    ids = fitted("a </s> b", add_special_tokens=False)["input_ids"]
    assert 1 not in ids  # a literal "</s>" (an HTML tag, say) is not the EOS token
    assert fitted.decode(ids) == "a </s> b"


def test_fitting_is_deterministic(fitted):
    model = "unigram" if isinstance(fitted.backend_tokenizer.model, models.Unigram) else "bpe"
    again = [fit_tokenizer(corpus(), vocab_size=300, model=model).backend_tokenizer.to_str() for _ in range(3)]
    assert again == [fitted.backend_tokenizer.to_str()] * 3


def test_canonical_unigram_ignores_put_back_order():
    # what the trainer returns: real pieces, then characters put back at min + k * 1e-4, k in hash order
    real = [("▁der", -2.5), ("er", -3.0000000000000004), ("▁", -1.0), ("x", -9.0)]
    chars = ["q", "Ä", "9"]

    def trained(order):
        return [[s, 0.0] for s in tk.SPECIALS] + [[p, s] for p, s in real] + \
            [[c, -9.0 + k * 1e-4] for k, c in enumerate(order)]

    first = tk._canonical_unigram(trained(chars))
    other = tk._canonical_unigram(trained(list(reversed(chars))))
    noisy = tk._canonical_unigram([[p, s + 1e-15 if s else s] for p, s in trained(chars)])

    def vocab(m):
        from tokenizers import Tokenizer
        return json.loads(Tokenizer(m).to_str())["model"]["vocab"]

    assert vocab(first) == vocab(other) == vocab(noisy)
    pieces = [p for p, _ in vocab(first)]
    assert pieces[:3] == list(tk.SPECIALS)
    assert pieces[3:] == ["▁", "▁der", "er", "9", "q", "x", "Ä"]  # by score, then by piece
    assert {s for p, s in vocab(first) if p in chars} == {-9.0}


def test_unseen_characters_are_unk():
    uni = fit_tokenizer(corpus(), vocab_size=300, model="unigram")
    ids = uni("Der Hund ☃☃ läuft", add_special_tokens=False)["input_ids"]
    assert ids.count(2) == 1  # Unigram fuses a run of unknown characters into one <unk>
    f = fertility(uni, ["Der Hund ☃☃ läuft"])
    assert f["words"] == 4 and f["unk_rate"] == pytest.approx(1 / len(ids))
    assert f["pieces_per_word"] == pytest.approx(len(ids) / 4)


def test_fertility_hand_checked():
    bpe = fit_tokenizer(corpus(), vocab_size=300, model="bpe")
    assert bpe.convert_ids_to_tokens(bpe("Der Hund läuft.", add_special_tokens=False)["input_ids"]) == \
        ["▁Der", "▁Hund", "▁läuft", "."]
    assert fertility(bpe, ["Der Hund läuft.", "Der Hund"]) == {"pieces_per_word": 6 / 5, "unk_rate": 0.0, "words": 5}
    # "☃" was never seen: "▁", "<unk>" (EOS is not counted: no special tokens are added)
    assert fertility(bpe, ["Der Hund ☃"]) == {"pieces_per_word": 4 / 3, "unk_rate": 1 / 4, "words": 3}
    with pytest.raises(ValueError, match="without words"):
        fertility(bpe, ["", "  "])


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="unknown tokenizer model 'wordpiece'"):
        fit_tokenizer(corpus(), model="wordpiece")
    with pytest.raises(ValueError, match="vocab_size must be an integer above 3"):
        fit_tokenizer(corpus(), vocab_size=3)
    with pytest.raises(ValueError, match="cannot fit a unigram tokenizer with vocab_size 20 .*all chars"):
        fit_tokenizer(corpus(), vocab_size=20)  # fewer than the corpus's distinct characters
    with pytest.raises(ValueError, match="no text"):
        fit_tokenizer(["", " "])
    with pytest.raises(TypeError, match="text 1 is NoneType"):
        fit_tokenizer(["a", None])


# ---- the cache -----------------------------------------------------------------------------

KEY = {"task": "translation", "domain": "news"}


def test_load_or_fit_caches_by_text_hash(tmp_path, monkeypatch):
    calls = []
    texts = corpus()
    fitted = load_or_fit(lambda: calls.append(1) or texts, KEY, tmp_path, vocab_size=300, model="unigram")
    key = cache_key(texts, KEY, 300, "unigram")
    path = tmp_path / key / "tokenizer.json"
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]

    def no_fit(*a, **k):
        raise AssertionError("refitted although cached")
    monkeypatch.setattr(tk, "fit_tokenizer", no_fit)
    cached = load_or_fit(lambda: texts, KEY, tmp_path, vocab_size=300, model="unigram")
    assert len(calls) == 1
    sample = ["Die Ärztin grüßt das Mädchen.", "Our neighbour reads ☃ the newspaper!"]
    assert cached(sample)["input_ids"] == fitted(sample)["input_ids"]
    assert (cached.pad_token_id, cached.eos_token_id, cached.unk_token_id) == (0, 1, 2)
    assert cached("a </s> b", add_special_tokens=False)["input_ids"].count(1) == 0

    # changed data, settings or key parts: another key (and so a fit, which no_fit refuses)
    for args in [(texts[:-1], KEY, 300, "unigram"), (texts, KEY, 301, "unigram"), (texts, KEY, 300, "bpe"),
                 (texts, {**KEY, "domain": "ted"}, 300, "unigram"), (["ab", "c"], KEY, 300, "unigram")]:
        assert cache_key(*args) != key
    assert cache_key(["ab", "c"], KEY, 300, "unigram") != cache_key(["a", "bc"], KEY, 300, "unigram")
    with pytest.raises(AssertionError, match="refitted"):
        load_or_fit(lambda: texts[:-1], KEY, tmp_path, vocab_size=300, model="unigram")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_ids"])
def test_corrupt_cache_is_refitted(tmp_path, damage):
    texts = corpus()
    fitted = load_or_fit(lambda: texts, KEY, tmp_path, vocab_size=300, model="bpe")
    path = tmp_path / cache_key(texts, KEY, 300, "bpe") / "tokenizer.json"
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not json")
    else:  # a loadable tokenizer whose special tokens are elsewhere
        data = json.loads(good)
        vocab = data["model"]["vocab"]
        data["model"]["vocab"] = {t: (i + 7) % len(vocab) for t, i in vocab.items()}
        path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="unusable cached tokenizer"):
        again = load_or_fit(lambda: texts, KEY, tmp_path, vocab_size=300, model="bpe")
    assert again("Der Hund läuft.")["input_ids"] == fitted("Der Hund läuft.")["input_ids"]
    assert path.read_bytes() == good  # rewritten
    assert not list(path.parent.glob("*.tmp"))


def test_load_or_fit_errors(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        load_or_fit(list, KEY, tmp_path, vocab_size=300)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        load_or_fit(lambda: corpus(), {"path": tmp_path}, tmp_path, vocab_size=300)
    assert not list(tmp_path.iterdir())
