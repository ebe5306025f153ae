"""A real Flower deployment on this machine: one SuperLink, one SuperNode per silo, `flwr run`.

Each SuperNode is pointed at its silo's own files where they are (node config: `silo-path` for an
own silo's source, `data-dir` for the benchmark's folder; nothing is copied) and at a state folder
of its own, as it would be on the silo's own machine; the ServerApp runs under the SuperLink and
never sees them.
Each SuperNode's ClientApps are forked from a warm process by fedsilo's SuperExec
(fedsilo.engines.flower.warm) unless `warm` is off (Flower's own `flwr-clientapp` per message).
`stop` ends every process the deployment started, also the ClientApp/ServerApp subprocesses Flower
starts in process groups of their own (found by the deployment's FLWR_HOME in their environment).
docs/flower.md shows the same on separate machines with TLS and SuperNode authentication.

Flower's processes run with the work folder as their working directory, so every path handed to
them (work folder, app folder, config, run directory, data and state folders) is made absolute.
While a run goes on, `run` prints one line per finished round from the run's `rounds.jsonl`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from fedsilo.errors import DeploymentError

APP_PYPROJECT = """\
[project]
name = "fedsilo-app"
version = "0.1.0"
description = "fedsilo on Flower"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedsilo"

[tool.flwr.app.components]
serverapp = "fedsilo.runs.flower:app"
clientapp = "fedsilo.engines.flower.client_app:app"

[tool.flwr.app.config]
config = ""
out = ""
resume = false
set = ""
lock = ""
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeploymentError(f"process {proc.args[0]} exited with code {proc.returncode} before listening"
                                  + (log_tail(log) if log else ""))
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise DeploymentError(f"nothing listens on 127.0.0.1:{port} after {timeout}s" + (log_tail(log) if log else ""))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CAUSE = re.compile(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt): \S")
_QUALIFIED = re.compile(r"^[\w.]*\.(\w+: )")
_FLOWER_REASON = re.compile(r"<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>")  # a ClientApp's exception as Flower words it


def plain_cause(line: str) -> str:
    """An exception line as a user reads it: `X: msg` for `pkg.mod.X: msg`, and for Flower's
    `<class 'pkg.X'>:<'msg'>` (how a ClientApp's exception reaches the ServerApp)."""
    return _FLOWER_REASON.sub(r"\1: \2", _QUALIFIED.sub(r"\1", line))


def log_tail(log: Path, lines: int = 8) -> str:
    """For an error message: `: <the log's last exception line>; last lines of LOG:` and, indented,
    its last non-empty lines (colour codes removed)."""
    try:
        text = _ANSI.sub("", Path(log).read_text(errors="replace"))
    except OSError:
        return f"; no log at {log}"
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if not kept:
        return f"; {log} is empty"
    cause = next((plain_cause(ln.strip()) for ln in reversed(kept) if _CAUSE.match(ln)), None)
    return (f": {cause}" if cause else "") + f"; last lines of {log}:\n" + "\n".join(
        "    " + ln for ln in kept[-lines:])


def config_value(value: str | Path) -> str:
    """A string for Flower's `--run-config` / `--node-config` (`key=VALUE` pairs, values read as TOML)."""
    text = str(value)
    if '"' not in text:
        return '"' + text.replace("\\", "\\\\") + '"'
    if "'" not in text:
        return "'" + text + "'"
    raise DeploymentError(f"{text!r}: Flower's config strings cannot hold both kinds of quotes")


def total_rounds(config: Path, overrides: list[str] = ()) -> int | None:
    """`federation.rounds` of a run's config (with `--set` overrides), None if it cannot be read."""
    rounds = None
    try:
        rounds = tomllib.loads(Path(config).read_text()).get("federation", {}).get("rounds")
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        pass
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "federation.rounds":
            rounds = value.strip()
    try:
        return int(rounds) if rounds is not None else None
    except ValueError:
        return None


class RoundsPrinter:
    """Follows a run's `rounds.jsonl` while the ServerApp appends to it: `poll` prints one line per
    newly finished round (time, dev score) plus one per silo rejected, missing, fallen back or capped
    in it, and one for a skipped update. With `plain` (`--no-progress`: logs, CI) they are log lines,
    as `fedsilo run --no-progress` prints them: `fedsilo: round R/T done ...`, then the rest as
    `fedsilo: warning: round R: ...`.

    A partly written last line is left until its newline arrives; a rewritten file (a resumed run
    truncates it atomically) is read again from its start, and lines already printed — or present
    before the run started, with `skip_existing` — are not printed again.
    """

    def __init__(self, path: Path, total: int | None = None, stream: TextIO | None = None,
                 skip_existing: bool = True, plain: bool = False) -> None:
        self.path, self.total, self.stream, self.plain = Path(path), total, stream, plain
        self._pos, self._ident, self._seen = 0, None, set()
        if skip_existing:
            self._read_new_lines()

    def _read_new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if (st.st_dev, st.st_ino) != self._ident or st.st_size < self._pos:
                    self._ident, self._pos = (st.st_dev, st.st_ino), 0  # a new or rewritten file
                fh.seek(self._pos)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only complete lines; the rest waits for its newline
        self._pos += end
        fresh = []
        for raw in data[:end].splitlines():
            key = hashlib.sha1(raw).digest()
            if raw.strip() and key not in self._seen:
                self._seen.add(key)
                fresh.append(raw.decode("utf-8", errors="replace"))
        return fresh

    def poll(self) -> list[str]:
        """Print (and return) the lines for rounds finished since the last call."""
        out = []
        for line in self._read_new_lines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # not a record (a complete line is never partly written by the ServerApp)
            if isinstance(record, dict):
                out += self.describe(record)
        stream = self.stream or sys.stderr
        for text in out:
            print(text, file=stream, flush=True)
        return out

    def describe(self, record: dict) -> list[str]:
        """`round 2/6 done in 31.0s, dev score 12.50`, then `  rejected X: why` / `  missing Y: why`."""
        r = record.get("round", "?")
        head = f"round {r}/{self.total}" if self.total else f"round {r}"
        seconds = record.get("seconds")
        if isinstance(seconds, (int, float)):
            head += f" done in {seconds:.1f}s"
        else:
            head += " done"
        dev = record.get("dev")
        if isinstance(dev, dict) and isinstance(dev.get("score"), (int, float)):
            head += f", dev score {dev['score']:.2f}"
        lines = [head]
        clients = record.get("clients")
        for silo, entry in (clients.items() if isinstance(clients, dict) else ()):
            if isinstance(entry, dict) and entry.get("rejected"):
                lines.append(f"  rejected {silo}: {entry['rejected']}")
            if isinstance(entry, dict) and entry.get("fallback"):
                lines.append(f"  fallback {silo}: its weighting statistic was not usable; it took its size share")
            if isinstance(entry, dict) and entry.get("capped"):
                lines.append(f"  capped {silo}: its weight was held (federation.max_weight_ratio / max_client_weight)")
        reasons = record.get("missing_reasons")
        reasons = reasons if isinstance(reasons, dict) else {}
        for silo in record.get("missing") or ():
            why = reasons.get(silo)
            lines.append(f"  missing {silo}: {why}" if why else f"  missing {silo}")
        if record.get("not_robust"):
            lines.append(f"  {record['not_robust']}")
        if record.get("skipped"):
            lines.append(f"  no update applied: {record['skipped']}")
        if self.plain:  # --no-progress: the round's line, then what a user must hear as warnings
            return [f"fedsilo: {head}", *(f"fedsilo: warning: round {r}: {line.strip()}" for line in lines[1:])]
        return lines


def flower_env(home: Path) -> dict[str, str]:
    """The environment of Flower's processes. This Python's own bin folder goes first on PATH: the
    SuperLink starts `flower-superexec` by name, which an unactivated virtual environment (running
    `.venv/bin/fedsilo deploy`) would not otherwise find."""
    env = dict(os.environ)
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_HOME=str(home), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)]))
    return env


PATH_KEYS = {"data-dir", "silo-path", "state-dir", "policy", "roster", "signing-key", "ledger"}  # node config paths


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1 for one workdir; use as a context manager."""
    workdir: Path
    silos: dict[str, dict[str, str]]  # silo name → its node config (silo-path, data-dir), see `silo_nodes`
    port: int = field(default_factory=free_port)
    fleet_port: int | None = None  # where SuperNodes connect, if not the SuperLink's port (a relay)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    lock: str = ""  # the token of the run-directory lock the submitter holds (its ServerApp then takes none)
    warm: bool = True  # ClientApps forked from a warm process (fedsilo.engines.flower.warm), else Flower's own

    def __post_init__(self) -> None:
        # Flower's processes run in the work folder: a relative path would be read from there.
        self.workdir = Path(self.workdir).resolve()
        self.silos = {silo: {k: str(Path(v).resolve()) if k in PATH_KEYS else str(v) for k, v in node.items()}
                      for silo, node in self.silos.items()}

    @property
    def home(self) -> Path:
        return self.workdir / "flwr-home"

    def log(self, name: str) -> Path:
        """The log file of one process: superlink, supernode-SILO, flwr-run."""
        return self.workdir / f"{name}.log"

    def _start(self, name: str, cmd: list[str], log_name: str | None = None) -> subprocess.Popen:
        """Start one process, its output in its own log (or appended to `log_name`'s)."""
        if not log_name:
            self.log(name).write_text("")
        log = open(self.log(log_name or name), "a")  # appending: two processes may share one log
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=flower_env(self.home),
                                start_new_session=True, cwd=self.workdir)
        self.procs[name] = proc
        return proc

    def start(self) -> "LocalDeployment":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        bin_dir = Path(sys.executable).parent
        link = self._start("superlink", [str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                         "--port", str(self.port), "--disable-runtime-dependency-installation"])
        wait_for_port(self.port, 60, link, self.log("superlink"))
        for silo, node in self.silos.items():
            self.start_supernode(silo, node)
        return self

    def pids(self) -> list[int]:
        """Every live process of this deployment, Flower's own subprocesses included."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if f"FLWR_HOME={self.home}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found

    def start_supernode(self, silo: str, node: dict[str, str]) -> subprocess.Popen:
        state = self.workdir / "state" / silo
        state.mkdir(parents=True, exist_ok=True)
        node_config = " ".join([f"silo={config_value(silo)}", *(f"{k}={config_value(v)}" for k, v in node.items()),
                                f"state-dir={config_value(state)}"])
        runtime_port = free_port()
        node = self._start(f"supernode-{silo}", [
            str(Path(sys.executable).parent / "flower-supernode"), "--insecure",
            "--superlink", f"127.0.0.1:{self.fleet_port or self.port}", "--port", str(runtime_port),
            "--node-config", node_config, *(["--isolation", "process"] if self.warm else [])])
        if self.warm:  # the SuperExec that starts this SuperNode's ClientApps, ending when it ends
            self._start(f"superexec-{silo}", [sys.executable, "-m", "fedsilo.engines.flower.warm", "--insecure",
                                              "--runtime-api-address", f"127.0.0.1:{runtime_port}",
                                              "--parent-pid", str(node.pid)], log_name=f"supernode-{silo}")
        return node

    def write_app(self) -> Path:
        app = self.workdir / "app"
        app.mkdir(exist_ok=True)
        (app / "pyproject.toml").write_text(APP_PYPROJECT)
        return app

    def submit(self, config: Path, out: Path, overrides: list[str] = (), resume: bool = False) -> subprocess.Popen:
        """`flwr run` the fedsilo app with this config, streaming the run's log to `flwr-run.log`."""
        run_config = (f"config={config_value(Path(config).resolve())} out={config_value(Path(out).resolve())} "
                      f"resume={'true' if resume else 'false'} set={config_value(';'.join(overrides))}"
                      + (f" lock={config_value(self.lock)}" if self.lock else ""))
        cmd = [str(Path(sys.executable).parent / "flwr"), "run", str(self.write_app()), "local",
               "--run-config", run_config, "--stream"]
        return self._start("flwr-run", cmd)

    def run(self, config: Path, out: Path, overrides: list[str] = (), resume: bool = False,
            timeout: float | None = None, progress: bool = True, stream: TextIO | None = None) -> None:
        """Submit and wait until the run has written its results and its ServerApp has ended.

        A line per finished round goes to `stream` (stderr by default): without `progress`
        (`--no-progress`) as plain log lines, with no "run submitted" line before them. A run that
        ends without results, or whose SuperLink dies, raises `DeploymentError` naming the cause.
        """
        out = Path(out).resolve()
        printer = RoundsPrinter(out / "rounds.jsonl", total_rounds(config, overrides), stream, plain=not progress)
        proc = self.submit(config, out, overrides, resume)
        if progress:
            rounds = f"{printer.total} rounds, " if printer.total else ""
            print(f"run submitted: {rounds}a line as each round finishes (Flower's log: {self.log('flwr-run')})",
                  file=stream or sys.stderr, flush=True)
        results = out / "results.json"
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not results.exists():
                printer.poll()
                self._check_superlink(results)
                if proc.poll() is not None and not results.exists():
                    time.sleep(1)  # the stream may end just before the file lands
                    self._check_superlink(results)  # the run's end may be a consequence
                    if not results.exists():
                        raise DeploymentError(self.name_nodes(
                            "the Flower run ended without results" + log_tail(self.log("flwr-run"))))
                if deadline and time.monotonic() > deadline:
                    raise TimeoutError(f"no results in {out} after {timeout}s; see {self.workdir}/*.log")
                time.sleep(0.5)
            # The ServerApp goes on after results.json (its report, its trackers): `flwr run --stream` ends
            # when Flower marks the run finished, i.e. when the ServerApp has returned; a dead SuperLink ends it too.
            link = self.procs.get("superlink")
            while proc.poll() is None and (link is None or link.poll() is None):
                printer.poll()
                time.sleep(0.5)
        finally:
            printer.poll()  # the last rounds, also when the run failed

    def _check_superlink(self, results: Path) -> None:
        """Without the SuperLink no run can go on: say so rather than wait for `flwr run`."""
        link = self.procs.get("superlink")
        if link is None or link.poll() is None or results.exists():
            return
        code = link.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise DeploymentError(f"the SuperLink (pid {link.pid}) {how}; see {self.log('superlink')}")

    def name_nodes(self, text: str) -> str:
        """`SuperNode 1234 (silo yelp, log: …)` for the node ids in `text` (each SuperNode logs its id)."""
        for silo in self.silos:
            log = self.log(f"supernode-{silo}")
            try:
                ids = set(re.findall(r"SuperNode ID: (\d+)", log.read_text(errors="replace")))
            except OSError:
                continue
            for node in ids:
                named = f"SuperNode {node} (silo {silo}, log: {log})"
                text = re.sub(rf"SuperNode {node}\b", lambda _, named=named: named, text)
        return text

    def kill(self, name: str) -> None:
        """End one process (and its children) abruptly, as a crashed machine would."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def _live(self) -> set[int]:
        """The processes started here that have not ended, and every other one with this FLWR_HOME."""
        return {p.pid for p in self.procs.values() if p.poll() is None} | set(self.pids())

    def stop(self, grace: float = 10.0) -> None:
        """End every process of this deployment: SIGTERM, then SIGKILL what is left after `grace` s.

        Flower's ServerApp and ClientApps (and the SuperExecs starting them) may sit in process
        groups of their own, so each process is signalled by pid, found again on every pass (one
        may start another while the others end)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            signalled: set[int] = set()
            deadline = time.monotonic() + grace
            while (live := self._live()) and time.monotonic() < deadline:
                for pid in live - signalled:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                signalled |= live
                time.sleep(0.2)

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:  # a failed start (or SIGTERM during it) leaves nothing running either
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def silo_nodes(task, data_dir: Path | None) -> dict[str, dict[str, str]]:
    """Each silo's node config, pointing at its files where they are: an own silo's source path
    (`silo-path`) and the benchmark's folder (`data-dir`) when the run reads one. On separate
    machines each silo passes its own paths the same way (docs/flower.md)."""
    out = {}
    for silo in task.client_names():
        node = {"data-dir": str(data_dir)} if data_dir is not None else {}
        own = task.own_source(silo)
        if own is not None:
            node["silo-path"] = own.path
        out[silo] = node
    return out