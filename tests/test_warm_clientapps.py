"""fedsilo's SuperExec (fedsilo.engines.flower.warm): ClientApps forked from a process that imported
torch, transformers and fedsilo once. The deployment tests run whole federations through it."""
import sys

from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResultStatus

from fedsilo.engines.flower.warm import PRELOAD, ForkExecutor


def modules_and_parent(queue) -> None:
    import os

    queue.put(([m for m in PRELOAD if m in sys.modules], os.getppid()))


def test_a_forked_process_starts_with_every_preloaded_module_imported():
    """multiprocessing ignores a preload that fails to import: this would catch one."""
    import os

    executor = ForkExecutor()
    executor.warm_up()
    queue = executor.context.SimpleQueue()
    child = executor.context.Process(target=modules_and_parent, args=(queue,))
    child.start()
    loaded, parent = queue.get()
    child.join()
    assert child.exitcode == 0
    assert loaded == PRELOAD
    assert parent != os.getpid()  # forked by the forkserver, not by the SuperExec's process


def test_it_serves_clientapp_tasks_and_refuses_the_others():
    executor = ForkExecutor()
    types, fabs = executor.get_eligible_capacity({TaskType.CLIENT_APP, TaskType.SERVER_APP})
    assert types == {TaskType.CLIENT_APP} and fabs == set()
    spec = ExecutionSpec(task_type=TaskType.SERVER_APP, runtime_api_address="127.0.0.1:1", token="t", insecure=True,
                         root_certificates_path=None, runtime_dependency_install=False, parent_pid=None,
                         suppress_output=False, task_id=1)
    result = executor.launch(spec)
    assert result.status == LaunchResultStatus.FAILED and "ClientApps only" in result.message
    assert executor.running == []


def test_ended_clientapps_are_forgotten_and_running_ones_kept():
    import time

    executor = ForkExecutor()
    ended = executor.context.Process(target=len, args=((),))
    running = executor.context.Process(target=time.sleep, args=(3600,), daemon=True)
    for child in (ended, running):
        child.start()
        executor.running.append(child)
    ended.join()
    executor.reconcile()
    assert executor.running == [running]
    executor.close()


class RecordingContext:
    """Stands in for the forkserver context: records the processes launch() would start."""

    def __init__(self):
        self.started = []

    def Process(self, **kwargs):  # noqa: N802 - multiprocessing's name
        context = self

        class Started:
            def start(self):
                context.started.append(kwargs)

        return Started()


def clientapp_spec(**changes):
    fields = dict(task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9094", token="tok", insecure=True,
                  root_certificates_path=None, runtime_dependency_install=False, parent_pid=77,
                  suppress_output=True, task_id=5)
    return ExecutionSpec(**{**fields, **changes})


def test_launch_hands_flowers_clientapp_entry_the_specs_address_token_and_certificates(tmp_path):
    from fedsilo.engines.flower.warm import run_one_clientapp

    executor = ForkExecutor()
    executor.context = RecordingContext()
    assert executor.launch(clientapp_spec()).status == LaunchResultStatus.ACCEPTED
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    executor.launch(clientapp_spec(insecure=False, root_certificates_path=str(pem), task_id=6))
    first, second = executor.context.started
    assert first["target"] is run_one_clientapp and first["daemon"] is True
    assert first["args"] == ("127.0.0.1:9094", "tok", True, None, 77, False)
    assert second["args"] == ("127.0.0.1:9094", "tok", False, pem.read_bytes(), 77, False)
    assert len(executor.running) == 2


def test_the_forked_body_is_flowers_run_clientapp(monkeypatch):
    import flwr.supernode.runtime.run_clientapp as flower

    from fedsilo.engines.flower.warm import run_one_clientapp

    calls = []
    monkeypatch.setattr(flower, "run_clientapp", lambda **kwargs: calls.append(kwargs))
    run_one_clientapp("127.0.0.1:9094", "tok", True, None, 77, False)
    assert calls == [dict(runtime_api_address="127.0.0.1:9094", token="tok", insecure=True, certificates=None,
                          parent_pid=77, runtime_dependency_install=False)]


def test_main_runs_flowers_superexec_loop_with_the_fork_executor(monkeypatch):
    import flwr.supercore.superexec.run_superexec as superexec

    from fedsilo.engines.flower import warm

    seen = {}
    monkeypatch.setattr(superexec, "get_executor", superexec.get_executor)  # restored after the test
    monkeypatch.setattr(superexec, "run_superexec",
                        lambda **kwargs: seen.update(kwargs, executor=superexec.get_executor("subprocess")))
    warm.main(["--runtime-api-address", "127.0.0.1:9094", "--insecure", "--parent-pid", "77"])
    assert isinstance(seen.pop("executor"), ForkExecutor)
    assert seen == dict(runtime_api_address="127.0.0.1:9094", insecure=True, root_certificates_path=None,
                        parent_pid=77, runtime_dependency_install=False)


def test_closing_ends_the_clientapps_still_running():
    import time

    executor = ForkExecutor()
    child = executor.context.Process(target=time.sleep, args=(3600,), daemon=True)
    child.start()
    executor.running.append(child)
    executor.close()
    assert executor.running == [] and child.exitcode is not None and child.exitcode < 0  # ended by a signal
