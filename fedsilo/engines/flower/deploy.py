"""A real Flower deployment on this machine: one SuperLink, one SuperNode per silo, `flwr run`.

Each SuperNode is given only its own silo's data folder and state folder (node config), as it
would be on the silo's own machine; the ServerApp runs under the SuperLink and never sees them.
Every process gets its own process group, so `stop` also ends the ClientApp/ServerApp
subprocesses Flower starts. docs/flower.md shows the same on separate machines with TLS and
SuperNode authentication.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
serverapp = "fedsilo.engines.flower.server_app:app"
clientapp = "fedsilo.engines.flower.client_app:app"

[tool.flwr.app.config]
config = ""
out = ""
resume = false
set = ""
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0]} exited with code {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def flower_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_HOME=str(home), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1 for one workdir; use as a context manager."""
    workdir: Path
    silos: dict[str, Path]  # silo name → that silo's own data folder
    port: int = field(default_factory=free_port)
    fleet_port: int | None = None  # where SuperNodes connect, if not the SuperLink's port (a relay)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.workdir / "flwr-home"

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
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
        wait_for_port(self.port, 60, link)
        for silo, data in self.silos.items():
            self.start_supernode(silo, data)
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

    def start_supernode(self, silo: str, data: Path) -> subprocess.Popen:
        state = self.workdir / "state" / silo
        state.mkdir(parents=True, exist_ok=True)
        node_config = f'silo="{silo}" data-dir="{data}" state-dir="{state}"'
        return self._start(f"supernode-{silo}", [
            str(Path(sys.executable).parent / "flower-supernode"), "--insecure",
            "--superlink", f"127.0.0.1:{self.fleet_port or self.port}", "--port", str(free_port()), "--node-config", node_config])

    def write_app(self) -> Path:
        app = self.workdir / "app"
        app.mkdir(exist_ok=True)
        (app / "pyproject.toml").write_text(APP_PYPROJECT)
        return app

    def submit(self, config: Path, out: Path, overrides: list[str] = (), resume: bool = False) -> subprocess.Popen:
        """`flwr run` the fedsilo app with this config, streaming the run's log to `flwr-run.log`."""
        run_config = (f'config="{Path(config).resolve()}" out="{Path(out).resolve()}" '
                      f'resume={"true" if resume else "false"} set="{";".join(overrides)}"')
        cmd = [str(Path(sys.executable).parent / "flwr"), "run", str(self.write_app()), "local",
               "--run-config", run_config, "--stream"]
        return self._start("flwr-run", cmd)

    def run(self, config: Path, out: Path, overrides: list[str] = (), resume: bool = False,
            timeout: float | None = None) -> None:
        """Submit and wait until the run has written its results (the log stream may outlive it)."""
        proc = self.submit(config, out, overrides, resume)
        results = Path(out) / "results.json"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not results.exists():
            if proc.poll() is not None and not results.exists():
                time.sleep(1)  # the stream may end just before the file lands
                if not results.exists():
                    raise RuntimeError(f"the Flower run ended without results; see {self.workdir}/*.log")
            if deadline and time.monotonic() > deadline:
                raise TimeoutError(f"no results in {out} after {timeout}s; see {self.workdir}/*.log")
            time.sleep(0.5)

    def kill(self, name: str) -> None:
        """End one process (and its children) abruptly, as a crashed machine would."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop(self) -> None:
        for name, proc in self.procs.items():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill(name)
        self._reap_strays()

    def _reap_strays(self, grace: float = 10.0) -> None:
        """Flower's own subprocesses (ServerApp, ClientApps) may sit in other process groups."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def split_silo_data(data_dir: Path, silos: list[str], dest: Path) -> dict[str, Path]:
    """One folder per silo holding only that silo's files, as each institution would have."""
    out = {}
    for silo in silos:
        own = dest / silo
        own.mkdir(parents=True, exist_ok=True)
        for f in Path(data_dir).glob(f"{silo}*"):
            target = own / f.name
            if not target.exists():
                shutil.copy2(f, target)
        out[silo] = own
    return out
