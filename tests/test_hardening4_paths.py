"""Issue 50, hardening round 4 (paths, docs/reliability.md): a silo name too long for its key files, a
user-named path that is not a regular file (a FIFO, a folder) refused by name before anything opens it,
a refused run that leaves --out as it found it, and `fedsilo ledger` on files that are not ledgers.

A FIFO with no writer blocks its reader for ever: the `fifo` fixture's guard opens, after GUARD seconds,
each FIFO a test made from the other end and closes it again, so that code which still opens one meets an
end of file (or an empty read) and the test fails on its message instead of hanging."""
import json
import os
import threading
from pathlib import Path

import pytest

from fedsilo.cli import main
from fedsilo.config import ConfigError, to_toml, validate
from tests.hostile_server.driver import ScriptedServer, toy_raw
from tests.synth import tiny_config, write_silos
from tests.test_bad_input import fails, toy_file
from tests.test_study import STUDY

GUARD = 20.0  # seconds a test's FIFO stays unanswered: far above any refusal, far below a hung test's patience


@pytest.fixture
def fifo(tmp_path):
    """make(path=None) → a FIFO; a reader or writer still waiting on one after GUARD seconds is let through."""
    made, stop = [], threading.Event()

    def make(path: Path | None = None) -> Path:
        path = Path(path or tmp_path / f"fifo-{len(made)}")
        os.mkfifo(path, 0o600)
        made.append(path)
        return path

    def let_through() -> None:
        if stop.wait(GUARD):
            return
        while not stop.is_set():
            fds = []
            for path in made:
                for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
                    try:
                        fds.append(os.open(path, flags))
                    except OSError:
                        pass
            stop.wait(0.1)
            for fd in fds:
                os.close(fd)

    guard = threading.Thread(target=let_through, daemon=True)
    guard.start()
    yield make
    stop.set()
    guard.join()


def keys_for(tmp_path: Path, capsys, silo: str = "alpha") -> tuple[Path, Path, Path]:
    """(signing key, public key, roster) of one silo, made by the CLI."""
    folder, roster = tmp_path / "keys", tmp_path / "roster.toml"
    assert main(["keys", "new", "--out", str(folder), "--silo", silo]) == 0
    assert main(["keys", "roster", f"{silo}={folder / f'{silo}.pub'}", "--out", str(roster)]) == 0
    capsys.readouterr()
    return folder / f"{silo}.key", folder / f"{silo}.pub", roster


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (a file's bytes; None for a folder): what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


# ---- 1. a silo name too long for its key files ---------------------------------------------------------

def test_a_silo_name_too_long_for_its_key_files_is_refused_before_anything_is_made(tmp_path, capsys):
    out = tmp_path / "keys"
    line = fails(capsys, "keys", "new", "--out", str(out), "--silo", "a" * 300, culprit="255 bytes")
    assert ".key" in line and "300 bytes" in line
    fails(capsys, "keys", "new", "--out", str(out), "--silo", "é" * 126, culprit="255 bytes")  # 126 characters, 252 bytes
    assert not out.exists()
    assert main(["keys", "new", "--out", str(out), "--silo", "a" * 251]) == 0  # "<251 bytes>.key": exactly 255
    assert (out / ("a" * 251 + ".pub")).is_file()


# ---- 2. a FIFO as a key or a roster --------------------------------------------------------------------

def test_a_fifo_given_as_a_public_key_is_refused_by_name(tmp_path, capsys, fifo):
    pub = fifo()
    fails(capsys, "keys", "roster", f"alpha={pub}", "--out", str(tmp_path / "roster.toml"),
          culprit=f"public key: {pub} is a FIFO")
    assert not (tmp_path / "roster.toml").exists()


@pytest.mark.parametrize("key", ["roster", "signing-key", "policy", "ledger"])
def test_a_fifo_in_a_supernodes_node_config_is_refused_by_name(tmp_path, capsys, fifo, key):
    """What the coordinator hears: the node config key and the path, before the silo opens anything."""
    signing, _, roster = keys_for(tmp_path, capsys)
    node = {"roster": str(roster), "signing-key": str(signing), key: str(fifo())}
    heard = ScriptedServer(toy_raw(), "alpha", tmp_path / "state", **node).seen_by_server("query.describe")
    assert f"node config {key}: {node[key]} is a FIFO" in heard, heard


def test_a_fifo_as_a_silos_secret_is_refused_by_name(tmp_path, fifo):
    from fedsilo.engines.flower.client_app import SECRET_FILE, silo_secret
    secret = fifo(tmp_path / SECRET_FILE)
    with pytest.raises(ConfigError, match=f"{secret} is a FIFO"):
        silo_secret({}, tmp_path)


# ---- 3. every user-named file: a FIFO or a folder is refused by name -------------------------------------

def _compare(tmp: Path, place, which: str) -> list[str]:
    for name in ("run", "base"):
        (tmp / name).mkdir()
        if name != which:
            (tmp / name / "results.json").write_text(json.dumps({"task": "toyrank", "test": {"rows": []}}))
    place(tmp / which / "results.json")
    return ["compare", str(tmp / "run"), "--baseline", str(tmp / "base")]


def _study_config(tmp: Path, place) -> list[str]:
    study = tmp / "study.toml"
    study.write_text(STUDY.replace("[study]\n", f'[study]\nconfig = "{place(tmp / "base.toml")}"\n', 1))
    return ["study", str(study), "--out", str(tmp / "out")]


def _init_from_best(tmp: Path, place) -> list[str]:
    (tmp / "old").mkdir()
    place(tmp / "old" / "best.pt")
    return ["run", str(toy_file(tmp)), "--out", str(tmp / "out"), "--set", f'model.init_from="{tmp / "old"}"']


def _roster_out(tmp: Path, place) -> list[str]:
    assert main(["keys", "new", "--out", str(tmp / "keys"), "--silo", "alpha"]) == 0
    pub = tmp / "keys" / "alpha.pub"
    return ["keys", "roster", f"alpha={pub}", "--out", str(place(tmp / "roster.toml")), "--force"]


def _report(tmp: Path, place, name: str) -> list[str]:
    (tmp / "run").mkdir()
    place(tmp / "run" / name)
    return ["report", str(tmp / "run")]


ENTRY_POINTS = {  # each: (tmp_path, place) → argv; place(path) makes the FIFO or folder there
    "run CONFIG": lambda tmp, place: ["run", str(place(tmp / "c.toml")), "--out", str(tmp / "out")],
    "deploy CONFIG": lambda tmp, place: ["deploy", str(place(tmp / "c.toml")), "--out", str(tmp / "out")],
    "data check CONFIG": lambda tmp, place: ["data", "check", str(place(tmp / "c.toml"))],
    "study STUDY": lambda tmp, place: ["study", str(place(tmp / "s.toml")), "--out", str(tmp / "out")],
    "study [study] config": _study_config,
    "run --policy": lambda tmp, place: ["run", str(toy_file(tmp)), "--out", str(tmp / "out"),
                                        "--policy", f"alpha={place(tmp / 'p.toml')}"],
    "deploy --policy": lambda tmp, place: ["deploy", str(toy_file(tmp)), "--out", str(tmp / "out"),
                                           "--policy", f"alpha={place(tmp / 'p.toml')}"],
    "model.init_from best.pt": _init_from_best,
    "ledger show": lambda tmp, place: ["ledger", "show", str(place(tmp / "l.jsonl"))],
    "ledger reset": lambda tmp, place: ["ledger", "reset", str(place(tmp / "l.jsonl")), "--scope", "x"],
    "compare RUN": lambda tmp, place: _compare(tmp, place, "run"),
    "compare --baseline": lambda tmp, place: _compare(tmp, place, "base"),
    "keys roster NAME=PUBFILE": lambda tmp, place: ["keys", "roster", f"alpha={place(tmp / 'a.pub')}",
                                                     "--out", str(tmp / "roster.toml")],
    "keys roster --out --force": _roster_out,
    "report RUN results.json": lambda tmp, place: _report(tmp, place, "results.json"),
    "report RUN rounds.jsonl": lambda tmp, place: _report(tmp, place, "rounds.jsonl"),
    "data check --json OUT": lambda tmp, place: ["data", "check", str(toy_file(tmp)), "--no-lengths",
                                                "--json", str(place(tmp / "check.json"))],
}


@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_user_named_file_that_is_not_a_regular_file_is_refused_by_name(tmp_path, capsys, fifo, entry, kind):
    made = []

    def place(path: Path) -> Path:
        fifo(path) if kind == "fifo" else path.mkdir()
        made.append(path)
        return path

    argv = ENTRY_POINTS[entry](tmp_path, place)
    line = fails(capsys, *argv, culprit=str(made[0]))
    assert ("is a FIFO" if kind == "fifo" else "is a folder") in line, line
    assert not (tmp_path / "out").exists()


def test_a_fifo_as_model_init_from_is_refused_by_name(tmp_path, capsys, fifo):
    source = fifo()
    fails(capsys, "run", str(toy_file(tmp_path)), "--out", str(tmp_path / "out"),
          "--set", f'model.init_from="{source}"', culprit=f"model.init_from: {source} is a FIFO")


# ---- 4. a refused run leaves --out as it found it --------------------------------------------------------

def _damaged_t2s(tmp: Path) -> Path:
    data = write_silos(tmp / "data")
    data.joinpath("yelp.json").write_text("[]")
    path = tmp / "t2s.toml"
    path.write_text(to_toml(validate(tiny_config(data, federation={"rounds": 1}))))
    return path


def _study_with_missing_init(tmp: Path) -> Path:
    study = tmp / "study.toml"
    study.write_text(STUDY.replace("[base.model]\n", f'[base.model]\ninit_from = "{tmp / "gone.pt"}"\n'))
    return study


def _policy(tmp: Path, text: str = "") -> Path:
    (tmp / "policy.toml").write_text(text)
    return tmp / "policy.toml"


REFUSALS = {  # each: tmp_path → (argv without --out, the culprit its one line names)
    "run: a bad config value found at start": lambda tmp: (
        ["run", str(toy_file(tmp)), "--set", f'model.init_from="{tmp / "gone.pt"}"'], "model.init_from"),
    "run: a data error at start": lambda tmp: (["run", str(_damaged_t2s(tmp))], "no train / dev / test examples"),
    "run: a policy for no silo of the run": lambda tmp: (["run", str(toy_file(tmp)), "--policy",
                                                          f"zeta={_policy(tmp)}"], "'zeta' is not a silo"),
    "run: a policy that is no policy": lambda tmp: (["run", str(toy_file(tmp)), "--policy",
                                                     f"alpha={_policy(tmp, 'allow_tensors = 5')}"], "allow_tensors"),
    "study: a variant refused at start": lambda tmp: (["study", str(_study_with_missing_init(tmp))],
                                                      "model.init_from"),
    "deploy: a data error at start": lambda tmp: (["deploy", str(_damaged_t2s(tmp))], "no train / dev / test examples"),
    "deploy: a policy for no silo of the run": lambda tmp: (["deploy", str(toy_file(tmp)), "--policy",
                                                            f"zeta={_policy(tmp)}"], "'zeta' is not a silo"),
    "run --engine flower-sim: a bad config value found at start": lambda tmp: (
        ["run", str(toy_file(tmp)), "--engine", "flower-sim", "--set", f'model.init_from="{tmp / "gone.pt"}"'],
        "model.init_from"),
}


@pytest.mark.parametrize("existed", [False, True], ids=["new-out", "existing-out"])
@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_run_leaves_out_as_it_found_it(tmp_path, capsys, refusal, existed):
    """A folder the run created is gone (its parents too); one that existed holds what it held, no .lock."""
    argv, culprit = REFUSALS[refusal](tmp_path)
    out = tmp_path / "runs" / "x"
    if existed:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("the user's own file")
    fails(capsys, *argv, "--out", str(out), culprit=culprit)
    if existed:
        assert listing(out) == {"notes.txt": b"the user's own file"}
    else:
        assert not (tmp_path / "runs").exists(), listing(tmp_path / "runs")


def test_a_refused_resume_leaves_the_run_as_it_was_and_no_lock(tmp_path, capsys):
    config, out = toy_file(tmp_path), tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    before = listing(out)
    assert ".lock" not in before  # a finished run keeps no lock file either
    fails(capsys, "run", str(config), "--out", str(out), "--resume", "--set", "client.lr=0.5",
          culprit="the config differs")
    assert listing(out) == before


def test_a_lock_let_go_while_another_waits_on_its_file_is_held_by_one_run_only(tmp_path, monkeypatch):
    """Released, the lock takes its file with it: a run that opened the old file just before locks again
    on the one at the path, so that a third run is refused, not let in beside it."""
    import fcntl

    from fedsilo.rundir.lock import RunLock, RunLocked

    out = tmp_path / "run"
    first, flock = RunLock(out).acquire(), fcntl.flock

    def first_lets_go_now(fh, op):  # between the second run's open and its flock
        if first._fh is not None and fh is not first._fh:
            first.release()
        return flock(fh, op)

    monkeypatch.setattr(fcntl, "flock", first_lets_go_now)
    second = RunLock(out).acquire()
    monkeypatch.setattr(fcntl, "flock", flock)
    assert os.fstat(second._fh.fileno()).st_ino == os.stat(second.path).st_ino
    with pytest.raises(RunLocked):
        RunLock(out).acquire()
    second.release()
    assert not second.path.exists()


# ---- 5. the ledger command on what is not a ledger -----------------------------------------------------

NOT_LEDGERS = {"text": b"hello world\n", "binary": b"\xff\xfe\x00\x81 junk\n", "one word, no newline": b"hello",
               "json, not an entry": b'{"a": 1}\n', "a json list": b"[1, 2]\n"}


@pytest.mark.parametrize("command", [["show"], ["reset", "--scope", "x"]], ids=["show", "reset"])
@pytest.mark.parametrize("content", list(NOT_LEDGERS))
def test_a_file_that_is_not_a_ledger_is_one_line_and_left_as_it_was(tmp_path, capsys, content, command):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(NOT_LEDGERS[content])
    fails(capsys, "ledger", command[0], str(path), *command[1:], culprit=str(path))
    assert listing(tmp_path) == {"ledger.jsonl": NOT_LEDGERS[content]}


def test_an_empty_ledger_is_shown_in_one_line_and_a_reset_of_it_refused(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"")
    assert main(["ledger", "show", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: no release recorded\n"
    fails(capsys, "ledger", "reset", str(path), "--scope", "x", culprit="no entry of scope 'x'")
    assert path.read_bytes() == b""


@pytest.mark.parametrize("command", [["show"], ["reset", "--scope", "x"]], ids=["show", "reset"])
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_fifo_or_folder_as_the_ledger_is_named(tmp_path, capsys, fifo, kind, command):
    path = tmp_path / "ledger.jsonl"
    fifo(path) if kind == "fifo" else path.mkdir()
    fails(capsys, "ledger", command[0], str(path), *command[1:],
          culprit=f"{path} is {'a FIFO' if kind == 'fifo' else 'a folder'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl"]
