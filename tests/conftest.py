"""Suite-wide settings (how the suite is organised and why: docs/testing.md).

- The token cache goes to a temporary folder, never the user's ~/.cache; under pytest-xdist every
  worker has its own (tmp_path_factory's folder is per worker), so no two workers share a cache,
  a run directory or a port (ports come from the OS, bound to 0).
- One torch thread per test process, put back after every test: `make test` runs one worker per
  core, and a worker that took every core would fight its neighbour. Subprocesses (CLI runs, Flower's
  processes, Ray workers) inherit OMP_NUM_THREADS=1. Tests that need other counts set them.
- `engine.workers = "auto"` means one worker: many tests inject failures or count calls by
  monkeypatching client-side code in this process, which forked workers would not see.
  tests/test_workers.py sets `engine.workers` explicitly to test the parallel engine.
- The modules in HEAVY_FIRST are collected first, heaviest first: xdist (`--dist loadscope`) hands out
  whole modules in collection order, so the long ones start at once and the short ones fill the gaps
  (longest-processing-time-first scheduling), and every module's fixtures are built once.
- One Flower simulation (one Ray cluster) at a time on the machine: CI once saw a simulation whose
  virtual SuperNodes never answered while two workers each started a Ray cluster (Ray probes for
  free ports for its agents, and two clusters starting together can pick the same ones); a file lock
  in the system's temporary folder makes the others wait for it.
- One Ray actor per simulation (Ray told of one CPU), not fedsilo's default of one per core: the
  virtual silos then take turns in one process, ≈10 CPU-s less per simulation on a 2-core machine
  that runs 3 workers anyway (docs/testing.md). A test marked `ray_actor_per_core` keeps the default,
  so the simulation with silos in parallel actors stays tested.
"""
import fcntl
import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

# Ordered by their measured serial seconds (docs/testing.md, 2026-11-28); CI prints the 25 slowest tests
# every run, so a module that grows past these shows there. Order only: every test still runs.
HEAVY_FIRST = [
    "tests/test_flower.py",
    "tests/test_secure_aggregation.py",
    "tests/test_translation_task.py",
    "tests/test_silo_policy.py",
    "tests/hostile_server/test_ledger.py",
    "tests/test_cli_deploy.py",
    "tests/test_deploy_hardening.py",
    "tests/test_privacy_dp.py",
    "tests/test_own_silos_e2e.py",
    "tests/test_workers.py",
    "tests/test_matching_task.py",
    "tests/test_fewfedweight.py",
    "tests/test_study.py",
    "tests/test_hardening_state3.py",
    "tests/test_compressed_exchange.py",
    "tests/test_hardening_server3.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: order within kept


@pytest.fixture(scope="session", autouse=True)
def own_token_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_CACHE_DIR", str(tmp_path_factory.mktemp("fedsilo-cache")))
        mp.setattr("fedsilo.engines.workers.MAX_AUTO_CPU_WORKERS", 1)
        yield


ACTOR_PER_CORE = False


@pytest.fixture(autouse=True)
def ray_actors(request):
    global ACTOR_PER_CORE
    ACTOR_PER_CORE = request.node.get_closest_marker("ray_actor_per_core") is not None
    yield
    ACTOR_PER_CORE = False


@pytest.fixture(scope="session", autouse=True)
def one_ray_cluster_at_a_time():
    import flwr.simulation

    flower_run_simulation = flwr.simulation.run_simulation

    def run_simulation(*args, **kwargs):
        if not ACTOR_PER_CORE:
            kwargs["backend_config"]["init_args"]["num_cpus"] = 1
        with open(os.path.join(tempfile.gettempdir(), "fedsilo-tests-ray.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return flower_run_simulation(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flwr.simulation, "run_simulation", run_simulation)
        yield


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)
