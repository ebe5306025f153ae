"""The instruct task's data: the benchmark silos' converters on the pinned files (skipped without
../shared/data), GSM8K's final number, and own silos (Alpaca rows, mapped CSV columns, chat)."""
import json
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from fedsilo import datafetch
from fedsilo.datafetch import DataChangedWarning, DataError
from fedsilo.runs.init import guess_silo
from fedsilo.sources.load import group_key
from fedsilo.tasks.instruct import data as idata
from fedsilo.tasks.instruct.data import (
    BENCHMARK,
    PUBMEDQA_OPTIONS,
    SPLIT_COUNTS,
    SPLITS,
    gold_number,
    inspect_silo,
    load_benchmark,
    load_own,
    load_silo,
    required_files,
    verify_data_dir,
)
from fedsilo.tasks.instruct.plugin import InstructSettings
from fedsilo.tasks.instruct.records import Record, alpaca
from fedsilo.tasks.instruct.source import InstructSource

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (SHARED / "instruct").is_dir() or not (SHARED / "nmt").is_dir(),
                                reason=f"real instruct data not found under {SHARED}")
MANIFEST = Path(idata.__file__).parent / "sources.tsv"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Prepared splits go to a per-test data root, never the user's cache."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _settings(**sources) -> InstructSettings:
    return InstructSettings(sources=sources)


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _splits(folder: Path, name: str, rows: dict, **keys) -> InstructSource:
    """An own source of one file per split, `rows[split]` written as JSONL."""
    for split, split_rows in rows.items():
        _jsonl(folder / f"{split}.{name}", split_rows)
    return InstructSource(path=str(folder), files={s: f"{s}.{name}" for s in SPLITS}, **keys)


# ---- the pinned files ----------------------------------------------------------------------

@pytest.fixture(scope="session")
def real(tmp_path_factory):
    """The task's files copied from the mirror (verified), and every benchmark silo loaded once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("instruct-cache")))
        root = datafetch.ensure("instruct", tmp_path_factory.mktemp("instruct"), mirror=SHARED, progress=False)
        yield root, {silo: load_benchmark(root, silo) for silo in BENCHMARK}


@needs_data
def test_ensure_copies_and_verifies_every_pinned_file(tmp_path, monkeypatch):
    def no_download(src, target):
        raise AssertionError(f"{src.path} was to be downloaded, not copied from the mirror")
    monkeypatch.setattr(datafetch, "_download", no_download)
    dest = datafetch.ensure("instruct", tmp_path / "data", mirror=SHARED, progress=False)
    pins = datafetch.read_manifest(MANIFEST)
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert copied == sorted(s.path for s in pins)
    assert all(datafetch._is_verified(dest / s.path, s) for s in pins)
    assert set(required_files(BENCHMARK)) < set(copied)  # the licences come along, unread
    assert all(len(s.commit) == 40 and not s.mirror_only for s in pins)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verify_data_dir(BENCHMARK, dest)


@needs_data
def test_split_counts_are_the_documented_ones(real):
    root, splits = real
    assert {silo: {s: len(v) for s, v in splits[silo].items()} for silo in BENCHMARK} == SPLIT_COUNTS
    lines = {name: len((root / "gsm8k" / name).read_text().splitlines()) for name in ("train.jsonl", "test.jsonl")}
    assert lines == {"train.jsonl": 7473, "test.jsonl": 1319}
    gsm = splits["gsm8k"]
    assert len(gsm["train"]) + len(gsm["dev"]) == lines["train.jsonl"] and len(gsm["test"]) == lines["test.jsonl"]
    assert sum(len(v) for v in splits["codealpaca"].values()) == 4535


@needs_data
def test_gsm8k_dev_is_drawn_from_training_and_test_is_the_official_one(real):
    root, splits = real
    train = [json.loads(line)["question"] for line in (root / "gsm8k/train.jsonl").read_text().splitlines()]
    test = [json.loads(line)["question"] for line in (root / "gsm8k/test.jsonl").read_text().splitlines()]
    prompts = {s: [r.turns[-1][1] for r in v] for s, v in splits["gsm8k"].items()}
    assert prompts["test"] == [q.strip() for q in test]
    assert not set(prompts["train"]) & set(prompts["dev"])
    assert sorted(prompts["train"] + prompts["dev"]) == sorted(q.strip() for q in train)
    for r in (r for v in splits["gsm8k"].values() for r in v):
        assert r.answer == gold_number(r.response) and "<<" not in r.response and r.turns[0][0] == "user"


@needs_data
def test_gold_number_on_real_answers(real):
    """Five answers read by eye in the files, and what their last line says."""
    root, splits = real
    train = (root / "gsm8k/train.jsonl").read_text().splitlines()
    test = (root / "gsm8k/test.jsonl").read_text().splitlines()
    seen = {  # (file, line): the number after '####' as written there
        ("train", 1): ("#### 72", "72"),               # Natalia's clips
        ("train", 346): ("#### 1,080", "1080"),        # Adam's pay after taxes
        ("train", 645): ("#### 109,200,000", "109200000"),  # the bus system over 13 weeks
        ("train", 5716): ("#### -7", "-7"),            # Bucyrus' average temperature
        ("test", 490): ("#### -10", "-10"),            # the average highest temperature
    }
    by_question = {r.turns[-1][1]: r for v in splits["gsm8k"].values() for r in v}
    for (name, n), (last_line, number) in seen.items():
        row = json.loads((train if name == "train" else test)[n - 1])
        assert row["answer"].splitlines()[-1] == last_line
        assert gold_number(row["answer"]) == number
        assert by_question[row["question"].strip()].answer == number
    golds = [gold_number(json.loads(line)["answer"]) for line in train + test]
    assert all(g.lstrip("-").isdigit() for g in golds)  # no decimal gold answer in the pinned files


def test_gold_number_forms():
    assert gold_number("She pays 2.5 * 3 = 7.5 dollars.\n#### 7.5") == "7.5"
    assert gold_number("#### 1,000") == "1000"
    assert gold_number("It drops by 3,250.\n####  -3,250 ") == "-3250"
    assert gold_number("a #### b\n#### 4") == "4"  # the last mark is the answer's
    with pytest.raises(ValueError, match="no '####'"):
        gold_number("The answer is 4.")
    with pytest.raises(ValueError, match="no final number"):
        gold_number("#### four")


@needs_data
def test_pubmedqa_test_is_the_official_500_with_their_labels(real):
    root, splits = real
    pqal = json.loads((root / "pubmedqa/ori_pqal.json").read_text())
    truth = json.loads((root / "pubmedqa/test_ground_truth.json").read_text())
    assert len(truth) == 500
    prompt = {pmid: f"Abstract: {chr(10).join(d['CONTEXTS'])}\nQuestion: {d['QUESTION']}\nAnswer:"
              for pmid, d in pqal.items()}
    test = {r.turns[0][1]: r for r in splits["pubmedqa"]["test"]}
    assert set(test) == {prompt[pmid] for pmid in truth}
    for pmid, label in truth.items():
        record = test[prompt[pmid]]
        assert record.response == label and record.options == PUBMEDQA_OPTIONS
        assert PUBMEDQA_OPTIONS[record.label] == label
    rest = [r.turns[0][1] for s in ("train", "dev") for r in splits["pubmedqa"][s]]
    assert sorted(rest) == sorted(prompt[pmid] for pmid in pqal if pmid not in truth)


@needs_data
def test_codealpaca_puts_no_instruction_in_two_splits(real):
    root, splits = real
    split_of = {r: s for s, v in splits["codealpaca"].items() for r in v}
    rows = json.loads((root / "codealpaca/new_codealpaca.json").read_text())
    seen: dict[str, str] = {}
    for row in rows:
        record = alpaca(row["instruction"], row["input"], row["output"].strip())
        split = split_of[record]  # every record of the file is in a split
        assert seen.setdefault(group_key(row["instruction"]), split) == split
    assert len(rows) == len(split_of) == 4535


@needs_data
def test_news_is_detokenised_english_text(real):
    root, splits = real
    news = splits["news"]
    assert all(r.is_plain_text for v in news.values() for r in v)
    assert news["train"][0].response.startswith(  # the file: "... that , with ... Parliament &apos;s legislative"
        "It is not acceptable that, with the help of the national bureaucracies, Parliament's legislative")
    assert not any("&apos;" in r.response or "&quot;" in r.response or " , " in r.response
                   for v in news.values() for r in v)
    assert news["dev"][0].response == "Parliament Does Not Support Amendment Freeing Tymoshenko"  # src-val's line 1
    texts = [r.response for v in news.values() for r in v]
    assert len(texts) == len(set(texts))


@needs_data
def test_inspect_a_benchmark_silo(real):
    root, splits = real
    check = inspect_silo(_settings(), "pubmedqa", root)
    assert check.counts == SPLIT_COUNTS["pubmedqa"] and not check.blocking and not check.overlap
    assert set(check.files) == {str(root / f) for f in required_files(["pubmedqa"])}


# ---- benchmark files that are not the pinned ones -------------------------------------------

def test_unknown_silo_and_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match="unknown instruct benchmark silo 'alpaca'"):
        required_files(["alpaca"])
    with pytest.raises(DataError, match=r"instruct data file not found: .*gsm8k/train.jsonl"):
        verify_data_dir(["gsm8k"], tmp_path)


def _gsm8k(root: Path, n: int, last: str = "") -> Path:
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1:,}"}
            for i in range(n)]
    _jsonl(root / "gsm8k/train.jsonl", rows + ([last] if last else []))
    _jsonl(root / "gsm8k/test.jsonl", rows[:2])
    return root


def test_a_changed_gsm8k_file_loads_with_a_warning_and_its_bad_line_is_named(tmp_path):
    root = _gsm8k(tmp_path / "data", 500)
    with pytest.warns(DataChangedWarning, match="gsm8k/train.jsonl"):
        verify_data_dir(["gsm8k"], root)
    splits = load_benchmark(root, "gsm8k")
    assert {s: len(v) for s, v in splits.items()} == {"train": 27, "dev": 473, "test": 2}
    assert splits["test"][1] == Record((("user", "What is 1 + 1?"),), "1 + 1 = 2\n#### 2", answer="2")
    assert load_benchmark(root, "gsm8k") == splits  # read back from the cache
    _gsm8k(root, 500, last=json.dumps({"question": "How many?", "answer": "Four."}))
    with pytest.raises(DataError, match=r"gsm8k/train.jsonl:501: no '####'"):
        load_benchmark(root, "gsm8k")
    _gsm8k(root, 10)
    with pytest.raises(DataError, match="10 training questions; the gsm8k silo's held-out draw needs more than 473"):
        load_benchmark(root, "gsm8k")


# ---- own silos -----------------------------------------------------------------------------

def test_an_alpaca_jsonl_silo(tmp_path):
    row = {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"}
    source = _splits(tmp_path / "alpaca", "jsonl", {
        "train": [row, {"instruction": "Say hi.", "input": "", "output": "Hi!"}],
        "dev": [{"instruction": "Say bye.", "output": "Bye!", "system": "Be polite."}],
        "test": [{"instruction": " Count to 2. ", "input": " ", "output": "1 2"}]}, fields={"response": "output"})
    splits = load_own("alpaca", source)
    assert splits == {
        "train": [Record((("user", "Add the numbers.\n\n2, 3"),), "5"), Record((("user", "Say hi."),), "Hi!")],
        "dev": [Record((("system", "Be polite."), ("user", "Say bye.")), "Bye!")],
        "test": [Record((("user", "Count to 2."),), "1 2")]}


def test_a_csv_silo_with_mapped_fields(tmp_path):
    path = tmp_path / "desk.csv"
    path.write_text('prompt,context,answer,persona,notes\n'
                    'Reset my password.,,"Open Settings,\nthen Security.",,x\n'
                    'Which plan?,Team of 5,Team plan.,,y\n'
                    'Cancel it.,,Done.,A terse agent.,z\n', encoding="utf-8")
    source = InstructSource(path=str(path), split={"dev": 0.1, "test": 0.1, "seed": 0}, fields={
        "instruction": "prompt", "input": "context", "response": "answer", "system": "persona"})
    splits = load_own("desk", source)
    assert [len(v) for v in splits.values()] == [1, 1, 1]  # three instructions: one per split
    assert sorted((r for v in splits.values() for r in v), key=lambda r: r.response) == [
        Record((("system", "A terse agent."), ("user", "Cancel it.")), "Done."),
        Record((("user", "Reset my password."),), "Open Settings,\nthen Security."),
        Record((("user", "Which plan?\n\nTeam of 5"),), "Team plan.")]


def test_a_chat_silo(tmp_path):
    talk = [{"role": "system", "content": "You are a nurse."}, {"role": "user", "content": "I have a cough."},
            {"role": "assistant", "content": "Since when?"}, {"role": "user", "content": "Two days."},
            {"role": "assistant", "content": " Rest and drink water. "}]
    short = [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."}]
    source = _splits(tmp_path / "chat", "jsonl", {"train": [{"conversation": talk, "id": 7}],
                                                  "dev": [{"conversation": short}], "test": [{"conversation": short}]},
                     chat=True, fields={"messages": "conversation"})
    splits = load_own("clinic", source)
    assert load_silo(_settings(clinic=source), "clinic", None) == splits
    assert splits["train"] == [Record((("system", "You are a nurse."), ("user", "I have a cough."),
                                       ("assistant", "Since when?"), ("user", "Two days.")), "Rest and drink water.")]
    assert splits["dev"] == splits["test"] == [Record((("user", "Thanks"),), "You're welcome.")]


def test_malformed_chat_rows_are_named_by_file_and_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"},
                      {"role": "assistant", "content": "Done."}]},
        {"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "   "}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": "Hello."}]},
        {"messages": "Hi"},
        {"messages": [{"role": "user", "content": "Hi"}, "Hello."]},
    ]
    source = _splits(tmp_path / "chat", "jsonl", {"train": [good, *bad], "dev": [good], "test": [good]}, chat=True)
    train = tmp_path / "chat" / "train.jsonl"
    with pytest.raises(DataError) as err:
        load_own("clinic", source)
    assert f"silo clinic: 6 malformed row(s): {train}:2: message 2: role 'tool' is not one of" in str(err.value)
    check = inspect_silo(_settings(clinic=source), "clinic", None)
    assert check.blocking and check.counts == {"train": 1, "dev": 1, "test": 1}
    assert [str(p) for p in check.problems] == [
        f"{train}:2: message 2: role 'tool' is not one of system, user, assistant",
        f"{train}:3: the last message is the user's; it must be the assistant's (the response the loss covers)",
        f"{train}:4: message 1 (user): empty content",
        f"{train}:5: no user message before the assistant's response",
        f"{train}:6: the messages are one text, not a list of {{role, content}} objects",
        f"{train}:7: key 'messages' (messages) holds an item that is not an object"]
    skipping = source.model_copy(update={"bad_rows": "skip"})
    with pytest.warns(UserWarning, match="6 malformed row"):
        assert load_own("clinic", skipping)["train"] == [Record((("user", "Hi"),), "Hello.")]


def test_inspect_an_own_silo_finds_overlap(tmp_path):
    row = {"instruction": "Say hi.", "response": "Hi!"}
    source = _splits(tmp_path / "own", "jsonl", {"train": [row, row], "dev": [row], "test": [
        {"instruction": "Say bye.", "response": "Bye!"}]})
    check = inspect_silo(_settings(own=source), "own", None)
    assert check.counts == {"train": 2, "dev": 1, "test": 1} and not check.blocking
    assert list(check.duplicates) == ["train"] and list(check.overlap) == ["train/dev"]
    assert check.kind == "jsonl" and check.key_name == "prompt"


def test_chat_sources_are_jsonl_with_the_messages_role_only(tmp_path):
    with pytest.raises(ValidationError, match="chat = true reads JSONL rows"):
        InstructSource(path=str(tmp_path / "talk.csv"), chat=True, split={})
    with pytest.raises(ValidationError, match="'instruction' is not a role of this task's examples; roles: messages"):
        InstructSource(path=str(tmp_path / "talk.jsonl"), chat=True, split={}, fields={"instruction": "q"})
    assert InstructSource.ROLES.required == ("instruction", "response")  # what `fedsilo init` maps


def test_init_recognises_alpaca_and_common_column_names(tmp_path):
    _jsonl(tmp_path / "alpaca" / "train.jsonl", [{"instruction": "a", "input": "", "output": "b"}])
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "data.csv").write_text("prompt,completion,system_prompt\nq,a,s\n")
    fields = {name: guess_silo(tmp_path / name, InstructSource.ROLES, "instruct", tmp_path).entry.get("fields")
              for name in ("alpaca", "qa")}
    assert fields == {"alpaca": {"response": "output"},
                      "qa": {"instruction": "prompt", "response": "completion", "system": "system_prompt"}}
