"""A deployment cleans up after itself: SIGTERM stops every process it started, per-silo data copies
are never stale, one run directory has one writer, and a dead SuperLink or bad silo data is one
error line naming the cause.

The real deployments run `python -m fedsilo` as a user does and wait on events (a round in
rounds.jsonl, a process appearing), never on wall-clock budgets; the guards only keep a broken
Flower from hanging the suite.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsilo import commands
from fedsilo.cli import main
from fedsilo.engines.flower import deploy
from fedsilo.runs import flower as server_app
from fedsilo.engines.flower.deploy import LocalDeployment, log_tail
from fedsilo.rundir.lock import RunLock, RunLocked, held_for
from tests.synth import tiny_config, write_silos

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
ROOT = Path(__file__).resolve().parents[1]
GUARD = 1800  # seconds; far beyond any machine's pace


def write_experiment(tmp_path: Path, rounds: int) -> Path:
    from fedsilo.config import to_toml, validate

    config = tmp_path / "exp.toml"
    config.write_text(to_toml(validate(tiny_config(write_silos(tmp_path / "data"), federation={"rounds": rounds}))))
    return config


# ------------------------------------------------------------------ the silos' files, where they are


def test_silo_nodes_point_each_supernode_at_its_files_where_they_are(tmp_path):
    """No copy: a benchmark silo's SuperNode gets the data folder, an own silo's also its source's path."""
    from fedsilo.config import validate
    from fedsilo.engines.flower.deploy import silo_nodes

    own = tmp_path / "own.csv"
    raw = tiny_config(write_silos(tmp_path / "data"))
    raw["task"]["silos"] = ["yelp", "mine"]
    raw["task"]["sources"] = {"mine": {"path": str(own), "fields": {"sql": "query"},
                                       "schema_file": str(tmp_path / "s.sql"), "split": {}}}
    cfg = validate(raw)
    assert silo_nodes(cfg.task, tmp_path / "data") == {
        "yelp": {"data-dir": str(tmp_path / "data")},
        "mine": {"data-dir": str(tmp_path / "data"), "silo-path": str(own)}}
    only_own = validate({**raw, "task": {**raw["task"], "silos": ["mine"]}})
    assert silo_nodes(only_own.task, None) == {"mine": {"silo-path": str(own)}}


class FakeDeployment:
    """Stands in for LocalDeployment in the CLI: records each run's silo files and lock, starts nothing."""
    runs: list = []

    def __init__(self, workdir, silos, warm=True):
        self.silos, self.lock = silos, ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def run(self, config, out, resume=False, progress=True):
        files = {s: {p.name: p.read_text() for p in Path(node["data-dir"]).glob(f"{s}*")}
                 for s, node in self.silos.items()}
        FakeDeployment.runs.append({"files": files, "lock_held": held_for(out, self.lock)})


def test_deploy_cli_reads_the_data_where_it_is_and_hands_over_its_lock(tmp_path, monkeypatch, capsys):
    """A second `fedsilo deploy` after the data changed sees the change (nothing is copied, so
    nothing is stale); each run is submitted with the token of the lock the command holds."""
    FakeDeployment.runs = []
    monkeypatch.setattr(deploy, "LocalDeployment", FakeDeployment)
    monkeypatch.setattr(commands, "_report", lambda out, show=True: Path(out) / "report.md")
    config = write_experiment(tmp_path, rounds=1)
    argv = ["deploy", str(config), "--out", str(tmp_path / "run"), "--no-progress"]
    data = tmp_path / "data"
    (data / "yelp-notes.txt").write_text("stale")
    assert main(argv) == 0, capsys.readouterr().err
    corrected = json.dumps(json.loads((data / "yelp.json").read_text()), indent=1)  # still valid data
    (data / "yelp.json").write_text(corrected)
    (data / "yelp-notes.txt").unlink()
    assert main(argv) == 0, capsys.readouterr().err
    first, second = FakeDeployment.runs
    assert set(first["files"]["yelp"]) == {"yelp.json", "yelp-schema.csv", "yelp-notes.txt"}
    assert set(second["files"]["yelp"]) == {"yelp.json", "yelp-schema.csv"}
    assert second["files"]["yelp"]["yelp.json"] == corrected
    assert first["lock_held"] and second["lock_held"]


# ------------------------------------------------------------ one run directory, one writer


def test_a_run_directory_in_use_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """deploy, run and run --engine flower-sim: exit 2 and one line naming the directory, before
    any Flower process or simulation worker starts."""
    import flwr.simulation

    def started(*a, **k):
        raise AssertionError("started although the run directory is in use")

    monkeypatch.setattr(deploy, "LocalDeployment", started)
    monkeypatch.setattr(flwr.simulation, "run_simulation", started)
    config, out = write_experiment(tmp_path, rounds=1), tmp_path / "run"
    with RunLock(out):
        for argv in (["deploy"], ["run"], ["run", "--engine", "flower-sim"]):
            assert main([*argv, str(config), "--out", str(out), "--no-progress"]) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(f"fedsilo: error: {out} is in use") and err.count("\n") == 1, (argv, err)


def test_a_forked_child_does_not_keep_the_run_locked(tmp_path):
    """flock is shared with forked children; they close their copy, so a run that dies without
    unlocking (SIGKILL) frees its directory even while a child of it (a worker) lives on."""
    import os
    import signal

    out = tmp_path / "run"
    read, write = os.pipe()
    taker = os.fork()
    if taker == 0:  # takes the lock, forks a child that lives on, and dies without unlocking
        lock = RunLock(out).acquire()  # noqa: F841 (held until the exit)
        child = os.fork()
        if child == 0:
            signal.pause()
        os.write(write, str(child).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 32))
    os.waitpid(taker, 0)
    try:
        with RunLock(out):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_serve_locks_unless_its_submitter_holds_the_lock(tmp_path, monkeypatch):
    """The ServerApp of `fedsilo deploy` trusts the command's token; any other (flower-sim, a
    direct `flwr run`) holds the lock itself, and fails if someone else does."""
    out, served = tmp_path / "run", []

    def fake_serve(grid, cfg, out, resume, show_progress):
        with pytest.raises(RunLocked):  # the directory is locked while the run goes on
            RunLock(out).acquire()
        served.append(out)

    monkeypatch.setattr(server_app, "_serve", fake_serve)
    server_app.serve(None, None, out, False)
    with RunLock(out) as lock:
        server_app.serve(None, None, out, False, lock_token=lock.token)
        with pytest.raises(RunLocked):
            server_app.serve(None, None, out, False, lock_token="someone else's")
    assert served == [out, out]


def test_submit_hands_the_lock_token_to_the_serverapp(tmp_path):
    from flwr.common.config import parse_config_args

    class Recording(LocalDeployment):
        def _start(self, name, cmd):
            self.cmd = cmd

    dep = Recording(tmp_path / "fl", {}, lock="abc123")
    dep.workdir.mkdir()
    dep.submit(tmp_path / "exp.toml", tmp_path / "run")
    assert parse_config_args([dep.cmd[dep.cmd.index("--run-config") + 1]])["lock"] == "abc123"
    assert 'lock = ""' in (dep.workdir / "app" / "pyproject.toml").read_text()


# ---------------------------------------------------------------- the cause, in one line


def test_a_silos_failure_names_the_silo_and_the_cause(tmp_path):
    """A ClientApp's exception reaches flwr-run.log in Flower's wording; the error line says which
    silo failed and why, as the user would write it."""
    dep = LocalDeployment(tmp_path, {"yelp": {"data-dir": str(tmp_path / "yelp")}})
    (tmp_path / "supernode-yelp.log").write_text("INFO :      SuperNode ID: 1084\n")
    (tmp_path / "flwr-run.log").write_text(
        "Traceback (most recent call last):\n"
        "fedsilo.config.ConfigError: SuperNode 1084 failed to start: <class 'fedsilo.datafetch.DataError'>:"
        "<'/d/yelp.json: invalid JSON: Expecting value: line 1 column 1 (char 0)'>\n"
        "ERROR :     Exit Code: 201\n")
    first = dep.name_nodes("ended" + log_tail(tmp_path / "flwr-run.log")).splitlines()[0]
    assert first == (f"ended: ConfigError: SuperNode 1084 (silo yelp, log: {tmp_path / 'supernode-yelp.log'}) "
                     "failed to start: DataError: /d/yelp.json: invalid JSON: Expecting value: line 1 column 1 "
                     f"(char 0); last lines of {tmp_path / 'flwr-run.log'}:")


class SilentGrid:
    """Three SuperNodes connected; the one holding `yelp` never answers the describe query."""

    def __init__(self):
        self.sent = []

    def get_node_ids(self):
        return [11, 12, 13]

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

        self.sent, self.timeout, replies = list(messages), timeout, []
        for msg, silo in zip(self.sent, ["restaurants", "academic"]):
            msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
            reply = Message(RecordDict({"silo": ConfigRecord({"name": silo}),
                                        "metrics": MetricRecord({"n_examples": 5})}), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
            replies.append(reply)
        return replies


def test_a_supernode_that_never_describes_its_silo_is_named_with_the_timeout(tmp_path, monkeypatch):
    """Not "no SuperNode holds" every silo: which node was silent, and for how long it was waited on."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedsilo.config import ConfigError, validate
    from fedsilo.engines.flower.engine import FlowerEngine

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    cfg = validate(tiny_config(tmp_path, flower={"connect_timeout": 7.0}))
    grid = SilentGrid()
    with pytest.raises(ConfigError) as err:
        FlowerEngine(grid, cfg, run_key="k")
    assert len(grid.sent) == 3 and grid.timeout == 7.0
    assert str(err.value) == ("no SuperNode answered for silo(s) ['yelp']: SuperNode(s) [13] sent no description of "
                              "their silo within flower.connect_timeout (7.0s)")


# ------------------------------------------------------------------- real processes


def start_cli(cwd: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    """`python -m fedsilo ARGV` in `cwd`, stderr to a file; fedsilo importable by Flower's processes."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1",  # as Flower's processes get
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    err = cwd / f"stderr-{argv[0]}.txt"
    with open(err, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "fedsilo", *argv], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=fh)
    return proc, err


def wait_for(done, proc: subprocess.Popen, err: Path, what: str) -> None:
    guard = time.monotonic() + GUARD
    while not done():
        assert proc.poll() is None, f"the command ended before {what}:\n{err.read_text()[-3000:]}"
        assert time.monotonic() < guard, f"no {what} after {GUARD}s:\n{err.read_text()[-3000:]}"
        time.sleep(0.2)


def rounds_done(run: Path) -> int:
    path = run / "rounds.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def ended(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()


def assert_nothing_left(dep: LocalDeployment) -> None:
    """No process with the deployment's FLWR_HOME (zombies drop their environment at once)."""
    guard = time.monotonic() + 120
    while (left := dep.pids()) and time.monotonic() < guard:
        time.sleep(0.5)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_sigterm_to_deploy_stops_every_process_it_started(tmp_path, capsys):
    """Once round 1 is logged: a second deploy on the same --out is refused (the command holds the
    lock across processes), then SIGTERM (what `timeout` sends) ends the command with 143, one
    line, and no Flower process left."""
    config = write_experiment(tmp_path, rounds=50)
    proc, err = start_cli(tmp_path, "deploy", "exp.toml", "--out", "run", "--no-progress")
    run, dep = tmp_path / "run", LocalDeployment(tmp_path / "run-flower" / "processes", {})
    try:
        wait_for(lambda: rounds_done(run) >= 1, proc, err, "round 1")
        assert main(["deploy", str(config), "--out", str(run), "--no-progress"]) == 2
        assert capsys.readouterr().err.startswith(f"fedsilo: error: {run} is in use")
        assert len(dep.pids()) >= 4  # a SuperLink, 3 SuperNodes and the run's own processes
        proc.send_signal(signal.SIGTERM)
        assert ended(proc) == 143, err.read_text()[-3000:]
        assert_nothing_left(dep)
    except BaseException:
        dep.stop()  # what a failed test would leave behind
        raise
    text = err.read_text()
    assert text.splitlines()[-1].startswith("fedsilo: terminated (SIGTERM)") and "Traceback" not in text


def test_a_killed_superlink_is_one_error_line_and_leaves_no_process(tmp_path):
    """kill -9 of the SuperLink while the ServerApp runs: exit 2, one `fedsilo: error:` line naming
    the SuperLink and its log, and every other process of the deployment stopped."""
    write_experiment(tmp_path, rounds=50)
    proc, err = start_cli(tmp_path, "deploy", "exp.toml", "--out", "run", "--no-progress")
    dep = LocalDeployment(tmp_path / "run-flower" / "processes", {})
    try:
        wait_for(lambda: any("flwr-serverapp" in cmdline(p) for p in dep.pids()), proc, err, "a ServerApp")
        link = next(p for p in dep.pids() if "flower-superlink" in cmdline(p))
        os.kill(link, signal.SIGKILL)
        assert ended(proc) == 2
        assert_nothing_left(dep)
    except BaseException:
        dep.stop()  # what a failed test would leave behind
        raise
    lines = err.read_text().splitlines()
    errors = [ln for ln in lines if ln.startswith("fedsilo: error:")]
    assert errors == [f"fedsilo: error: the SuperLink (pid {link}) was killed by SIGKILL; see {dep.log('superlink')}"]
    assert lines[-1] == errors[0] and "Traceback" not in "\n".join(lines)


def test_sigterm_ends_an_in_process_run_cleanly(tmp_path):
    """`fedsilo run` under `timeout`: exit 143 with one line; every logged round is complete."""
    write_experiment(tmp_path, rounds=100)
    proc, err = start_cli(tmp_path, "run", "exp.toml", "--out", "run", "--no-progress")
    try:
        wait_for(lambda: rounds_done(tmp_path / "run") >= 1, proc, err, "round 1")
        proc.send_signal(signal.SIGTERM)
        assert ended(proc) == 143, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in err.read_text().splitlines() if ln.strip()]
    assert lines[-1].startswith("fedsilo: terminated (SIGTERM)") and not any("Traceback" in ln for ln in lines)
    assert all(json.loads(ln)["round"] for ln in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines())
