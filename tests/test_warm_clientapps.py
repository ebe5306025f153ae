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


def test_ended_clientapps_are_forgotten():
    executor = ForkExecutor()
    child = executor.context.Process(target=len, args=((),))
    child.start()
    executor.running.append(child)
    child.join()
    executor.reconcile()
    assert executor.running == []
