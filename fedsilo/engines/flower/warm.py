"""A SuperNode's SuperExec that forks each ClientApp process from a warm one.

Flower's own SuperExec (`flower-superexec`, started by a SuperNode in `subprocess` isolation) runs
`flwr-clientapp` afresh for every message: Python, Flower, torch, transformers and fedsilo are
imported again each time, ≈5 CPU-seconds a message before any work (docs/testing.md). This one is
the same SuperExec loop — Flower's `run_superexec`, asking the SuperNode's Runtime API for tasks —
with an executor that starts each ClientApp as a fork of a forkserver that imported those once.

Each message still gets a process of its own that holds nothing of the last one (the forkserver
never builds a silo; a ClientApp keeps its state on disk, as under `flwr-clientapp`), and runs
Flower's own ClientApp entry (`run_clientapp`). Run it beside a SuperNode started with
`--isolation process` (fedsilo.engines.flower.deploy does):

    flower-supernode --isolation process --port 9094 ...
    python -m fedsilo.engines.flower.warm --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid PID
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
from multiprocessing import forkserver

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is imported

import flwr.supercore.superexec.run_superexec as superexec  # noqa: E402 - after the telemetry switch
import flwr.supernode.runtime.run_clientapp as flower_clientapp
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import LaunchResult
from flwr.supercore.tls import validate_and_resolve_root_certificates

# imported once in the forkserver, so that no ClientApp process imports them again (transformers
# imports its model classes lazily: the model modules import them; ≈7 CPU-s once per SuperNode)
TASK_MODULES = [f"fedsilo.tasks.{family}.{part}" for family in ("text2sql", "translation", "matching", "multitask",
                                                                "instruct") for part in ("task", "data", "metrics")]
PRELOAD = ["torch", "transformers", "peft", "opacus", "flwr.supernode.runtime.run_clientapp",
           "fedsilo.engines.flower.client_app", "fedsilo.recipe", "fedsilo.models.seq2seq", "fedsilo.models.encoder",
           "fedsilo.models.causal", "fedsilo.privacy.secagg", *TASK_MODULES]


def run_one_clientapp(runtime_api_address: str, token: str, insecure: bool, certificates: bytes | None,
                      parent_pid: int | None, runtime_dependency_install: bool) -> None:
    """Flower's ClientApp process body (what `flwr-clientapp` runs after parsing its arguments)."""
    flower_clientapp.run_clientapp(runtime_api_address=runtime_api_address, token=token, insecure=insecure,
                                   certificates=certificates, parent_pid=parent_pid,
                                   runtime_dependency_install=runtime_dependency_install)


class ForkExecutor:
    """Flower's `Executor` protocol (flwr.supercore.superexec.executor.types), for ClientApp tasks:
    each launch forks a process from the warm forkserver. Other task types are not a SuperNode's."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        self.running: list[multiprocessing.process.BaseProcess] = []

    def warm_up(self) -> None:
        """Start the forkserver now (it imports PRELOAD), not when the first message waits on it."""
        forkserver.ensure_running()

    def get_eligible_capacity(self, supported_task_types, *, insecure=False, root_certificates_path=None):
        return {t for t in supported_task_types if t == TaskType.CLIENT_APP}, set()

    def wait_for_capacity(self, task_type=None, *, fab_hash=None, insecure=False, root_certificates_path=None):
        """No capacity gate: one ClientApp per message, as `flower-superexec` starts them."""

    def launch(self, spec):
        if spec.task_type != TaskType.CLIENT_APP:
            return LaunchResult.failed(f"this SuperExec starts ClientApps only, not {spec.task_type}")
        certificates = validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure)
        proc = self.context.Process(
            target=run_one_clientapp, daemon=True, name=f"clientapp-{spec.task_id}",
            args=(spec.runtime_api_address, spec.token, spec.insecure, certificates, spec.parent_pid,
                  spec.runtime_dependency_install))
        proc.start()
        self.running.append(proc)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Forget the ClientApp processes that ended (their exit status went to Flower already)."""
        still = []
        for proc in self.running:
            if proc.is_alive():
                still.append(proc)
            else:
                proc.close()
        self.running = still

    def close(self) -> None:
        """The SuperExec ends (its SuperNode is gone): so do the ClientApps it started, which would
        have no one to report to."""
        for proc in self.running:
            if proc.is_alive():
                proc.terminate()
        for proc in self.running:
            proc.join()
        self.running = []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsilo.engines.flower.warm", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port)")
    parser.add_argument("--insecure", action="store_true", help="no TLS to the SuperNode (same machine only)")
    parser.add_argument("--root-certificates", default=None, help="CA certificate of the SuperNode's Runtime API")
    parser.add_argument("--parent-pid", type=int, default=None, help="end when this process (the SuperNode) ends")
    args = parser.parse_args(argv)
    executor = ForkExecutor()
    executor.warm_up()
    # Flower's SuperExec loop, with this executor in place of the one its CLI would choose
    superexec.get_executor = lambda *args, **kwargs: executor
    superexec.run_superexec(runtime_api_address=args.runtime_api_address, insecure=args.insecure,
                            root_certificates_path=args.root_certificates, parent_pid=args.parent_pid,
                            runtime_dependency_install=False)


if __name__ == "__main__":  # pragma: no cover - run as a process by the deployment tests
    main()
