"""Parallel clients (`engine.workers`): a round's clients trained in worker processes give the same
run as one after another — same final weights, same rounds.jsonl figures — with every store,
private tensors, personal models, round hooks and tasks with and without tokenised rows.

Both sides train each client on one thread (float reductions depend on the thread count). Weights
and client state are then bit-identical; a logged figure may differ in its last float32 bit (seen:
a regulariser's mean, 1.3e-7 relative), so figures are compared to 1e-6 relative."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from fedsilo.config import to_toml, validate
from fedsilo.engines import workers as workers_mod
from fedsilo.runs.runner import run_experiment

from tests import mtoy
from tests.killed_run import past_round_1
from tests.synth import tiny_config, write_silos
from tests.test_plugins import toy_config

VOLATILE = {"seconds", "eval_seconds", "phase_seconds", "compute"}  # compute: how it ran, checked apart


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def figures(run) -> list[dict]:
    """rounds.jsonl without wall-clock times."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return [strip(json.loads(line)) for line in (run / "rounds.jsonl").read_text().splitlines()]


def close(x, y) -> bool:
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return x == pytest.approx(y, rel=1e-6, abs=1e-12)
    return x == y


def same_run(a, b) -> None:
    assert close(figures(a), figures(b))
    for name in ("checkpoint.pt", "best.pt"):
        x = torch.load(a / name, weights_only=True)["server"]["params"]
        y = torch.load(b / name, weights_only=True)["server"]["params"]
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert json.loads((a / "results.json").read_text())["test"] == json.loads((b / "results.json").read_text())["test"]


def run_both(tmp_path, cfg: dict) -> None:
    for workers in (1, 2):
        raw = {**cfg, "engine": {**cfg.get("engine", {}), "workers": workers}}
        run_experiment(validate(raw), tmp_path / f"w{workers}", show_progress=False)
    same_run(tmp_path / "w1", tmp_path / "w2")
    for workers in (1, 2):  # each round records how it ran; auto threads = torch's count here (1)
        computes = [json.loads(line).get("compute") for line in (tmp_path / f"w{workers}" / "rounds.jsonl").open()]
        assert computes and all(c == {"workers": workers, "threads_per_client": 1} for c in computes), computes


def test_text2sql_lorar_fedopt_on_disk_store(tmp_path):
    data = write_silos(tmp_path / "data", per_fold=4)
    run_both(tmp_path, tiny_config(data, federation={"rounds": 2, "weighting": "lorar", "eval_every": 1}))


def test_private_tensors_personal_models_and_memory_store(tmp_path):
    data = write_silos(tmp_path / "data", per_fold=4)
    run_both(tmp_path, tiny_config(data, exchange={"private": ["decoder.block.*.layer.2.*"]},
                                   client={"personal": {"coef": 0.1}}, engine={"store": "memory"}))


def test_fewfedweight_pseudo_labels_and_sampled_clients(tmp_path):
    cfg = mtoy.config(mtoy.write_data(tmp_path / "data"), **mtoy.FEWFEDWEIGHT)
    cfg["task"] = {**cfg["task"], "clients": 3}
    cfg["federation"] = {**cfg["federation"], "sample_count": 2, "rounds": 3}
    run_both(tmp_path, cfg)


def test_task_without_tokenised_rows_centralized_and_finetune(tmp_path):
    base = toy_config().model_dump(exclude_none=True)
    run_both(tmp_path / "fed", base)
    for paradigm in ("centralized", "finetune"):  # one client per run: the pool is never started
        results = run_experiment(validate({**base, "paradigm": paradigm, "engine": {"workers": 2}}),
                                 tmp_path / paradigm, show_progress=False)
        assert results["test"]["rows"]


def test_spawned_workers_build_the_same_clients(tmp_path, monkeypatch):
    """The CUDA path (spawn: workers build model, task and clients from the config), run on CPU."""
    monkeypatch.setattr(workers_mod, "start_method", lambda device, threads: "spawn")
    data = write_silos(tmp_path / "data", per_fold=4)
    run_both(tmp_path, tiny_config(data, client={"personal": {"coef": 0.1}}))


def test_workers_of_several_threads_are_spawned_not_forked():
    cpu = torch.device("cpu")
    assert workers_mod.start_method(cpu, 1) == "fork" and workers_mod.start_method(cpu, 2) == "spawn"


def test_workers_of_two_threads_finish_after_the_parent_used_openmp(tmp_path):
    """Forked, a worker of 2 threads hung in round 1 once the parent had run an OpenMP region
    (libgomp is not fork-safe); spawned, the run finishes and equals one process at 2 threads."""
    torch.set_num_threads(2)
    torch.ones(4_000_000).clone()  # the parent opens an OpenMP team of 2 (a copy this large is split)
    data = write_silos(tmp_path / "data", per_fold=4)
    cfg = tiny_config(data)
    for workers, threads in ((1, 2), (2, 4)):
        run_experiment(validate({**cfg, "engine": {"workers": workers, "threads": threads}}),
                       tmp_path / f"w{workers}", show_progress=False)
    a, b = tmp_path / "w1", tmp_path / "w2"
    assert close(figures(a), figures(b))
    x, y = (torch.load(r / "checkpoint.pt", weights_only=True)["server"]["params"] for r in (a, b))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # evaluation runs in the parent, here at 2 and at 4 threads: equal up to float reduction order
    assert close(*(json.loads((r / "results.json").read_text())["test"] for r in (a, b)))
    computes = [json.loads(line)["compute"] for line in (tmp_path / "w2" / "rounds.jsonl").open()]
    assert computes and all(c == {"workers": 2, "threads_per_client": 2} for c in computes), computes


def test_a_failing_client_fails_the_run_with_its_error(tmp_path):
    data = write_silos(tmp_path / "data", per_fold=4)
    cfg = validate({**tiny_config(data, client={"lr": 1e30, "max_grad_norm": 0}),  # overflows to NaN
                    "engine": {"workers": 2}})
    from fedsilo.runs.runner import RunFailed
    with pytest.raises(RunFailed, match="non-finite"):
        run_experiment(cfg, tmp_path / "run", show_progress=False)


def test_a_free_worker_takes_the_next_client_while_an_earlier_one_trains(tmp_path, monkeypatch):
    """alpha trains until gamma has started: with workers = 2, beta's worker must take gamma without
    waiting for alpha's update to be folded (forked workers inherit the patched fit)."""
    from fedsilo.client.silo import SiloClient

    fit, marks = SiloClient.fit, tmp_path / "marks"
    marks.mkdir()

    def observed_fit(self, round_idx, *args, **kwargs):
        if self.name == "gamma":
            (marks / f"gamma-{round_idx}").touch()
        if self.name == "alpha":
            deadline = time.monotonic() + 300  # bounds a failure only: gamma starts at once when it works
            while not (marks / f"gamma-{round_idx}").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            (marks / f"alpha-saw-gamma-{round_idx}").write_text(str((marks / f"gamma-{round_idx}").exists()))
        return fit(self, round_idx, *args, **kwargs)

    monkeypatch.setattr(SiloClient, "fit", observed_fit)
    run_experiment(toy_config(engine={"workers": 2}), tmp_path / "run", show_progress=False)
    assert [(marks / f"alpha-saw-gamma-{r}").read_text() for r in (1, 2)] == ["True", "True"]


def test_auto_is_one_worker_per_core_capped_by_clients():
    cpu = torch.device("cpu")
    assert workers_mod.resolve_workers("auto", cpu, 1) == 1
    assert workers_mod.resolve_workers(3, cpu, 2) == 2
    assert 1 <= workers_mod.resolve_workers("auto", cpu, 64) <= workers_mod.MAX_AUTO_CPU_WORKERS


def _doubled_by_a_worker(shared):
    """A worker's job: reads the shared tensors, returns new ones (and whether its inputs were shared)."""
    views = workers_mod.unshare(shared)
    return workers_mod.share({k: v * 2 if v.is_floating_point() else v for k, v in views.items()}), \
        all(v.is_shared() for v in views.values())


def test_tensors_cross_to_a_worker_and_back_through_shared_memory_in_order():
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    tensors = {"w": torch.randn(3, 5), "steps": torch.arange(7), "mask": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4), "half": torch.randn(2, 3).to(torch.bfloat16),
               "scalar": torch.tensor(3.5, dtype=torch.float64)}
    shared = workers_mod.share(tensors)
    assert shared.buffer.is_shared()
    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        back, inputs_shared = pool.submit(_doubled_by_a_worker, shared).result()
    assert inputs_shared  # the worker read the parent's pages, not a copy of their bytes
    out = workers_mod.unshare(back)
    assert list(out) == list(tensors)
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k], t * 2 if t.is_floating_point() else t), k
    assert workers_mod.share({}) == workers_mod.Shared(None, ())


def test_clients_receiving_the_same_tensors_share_one_buffer_per_round():
    params = {"a": torch.ones(4), "b": torch.zeros(2)}

    class Server:  # what the pool asks of the server: each client's payload
        def payload(self, client):
            return params if client != "partial" else {"a": params["a"]}

    payloads = {}
    first, second = (workers_mod._payload(Server(), c, payloads) for c in ("x", "y"))
    partial = workers_mod._payload(Server(), "partial", payloads)
    assert first is second and partial is not first and len(payloads) == 2
    assert list(workers_mod.unshare(partial)) == ["a"]


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads worker pids from /proc (Linux)")
def test_kill_9_ends_the_workers_and_frees_the_run_directory(tmp_path):
    """A SIGKILLed run leaves no worker behind, and no worker keeps its run directory locked."""
    from fedsilo.rundir.lock import RunLock

    config = tmp_path / "exp.toml"
    config.write_text(to_toml(toy_config(federation={"rounds": 500}, engine={"workers": 2})))
    out = tmp_path / "run"
    with past_round_1(config, out) as proc:
        workers = {pid for pid in children_of(proc.pid) if alive(pid)}
        assert len(workers) >= 2
    deadline = time.monotonic() + 120  # a bound for a failure, not a timing: the kernel kills them at once
    while any(alive(p) for p in workers):
        assert time.monotonic() < deadline, f"workers outlived the run: {[p for p in workers if alive(p)]}"
        time.sleep(0.05)
    with RunLock(out):
        pass


def test_engine_threads_sets_torchs_threads_for_the_run_records_them_and_may_change_on_resume(tmp_path, monkeypatch):
    """engine.threads: one process uses them all, N workers share them (threads // N each); torch's
    count is put back after the run; rounds.jsonl records it; a resume may change it."""
    from fedsilo.client.silo import SiloClient
    seen = []
    fit = SiloClient.fit

    def observed_fit(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(SiloClient, "fit", observed_fit)
    cfg = toy_config(engine={"workers": 1, "threads": 2}, federation={"rounds": 1})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert seen == [2, 2, 2] and torch.get_num_threads() == 1
    assert json.loads((tmp_path / "run" / "rounds.jsonl").read_text())["compute"] == \
        {"workers": 1, "threads_per_client": 2}
    # more rounds with other threads: accepted (results depend on threads only in float rounding)
    more = toy_config(engine={"workers": 1, "threads": 3}, federation={"rounds": 2})
    run_experiment(more, tmp_path / "run", resume=True, show_progress=False)
    computes = [json.loads(line)["compute"] for line in (tmp_path / "run" / "rounds.jsonl").open()]
    assert computes == [{"workers": 1, "threads_per_client": 2}, {"workers": 1, "threads_per_client": 3}]
    assert 'threads = 3' in (tmp_path / "run" / "config.toml").read_text()
    # a worker gets its share; a bool is no count
    assert workers_mod.threads_per_worker(5, 2) == 2 and workers_mod.threads_per_worker(1, 4) == 1
    with pytest.raises(ValueError, match="engine.threads must be a positive count"):
        toy_config(engine={"threads": True})


def test_a_connection_error_of_the_handle_sharing_thread_is_not_printed_anything_else_is(monkeypatch):
    """A worker killed while it fetched a shared tensor's descriptor resets multiprocessing's
    handle-sharing thread (seen once under load in tests/test_hardening_runs.py's killed worker:
    a traceback beside the one error line). Only that thread's connection errors are dropped."""
    import threading
    from multiprocessing import resource_sharer

    seen = []
    hook = workers_mod._quiet_handle_sharer(lambda kind, value, tb: seen.append((kind, threading.current_thread())))

    def raise_in_thread(error):
        def body():
            try:
                raise error
            except BaseException:  # noqa: BLE001 - handed to the hook as the sharer hands it
                import sys
                hook(*sys.exc_info())
        thread = threading.Thread(target=body)
        return thread

    sharer = raise_in_thread(ConnectionResetError(104, "Connection reset by peer"))
    monkeypatch.setattr(resource_sharer._resource_sharer, "_thread", sharer, raising=False)
    sharer.start()
    sharer.join()
    assert seen == []  # the sharer's reset: dropped
    other = raise_in_thread(ConnectionResetError(104, "Connection reset by peer"))
    other.start()
    other.join()
    failing_sharer = raise_in_thread(ValueError("a real bug"))
    monkeypatch.setattr(resource_sharer._resource_sharer, "_thread", failing_sharer)
    failing_sharer.start()
    failing_sharer.join()
    assert seen == [(ConnectionResetError, other), (ValueError, failing_sharer)]
