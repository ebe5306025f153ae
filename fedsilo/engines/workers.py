"""Parallel clients for the in-process engine: a round's sampled clients train at once in a pool of
worker processes, each with its own working model and a share of the CPU threads (or a GPU).

Results equal one-after-another training at equal threads per client: a client's round depends
only on what it receives, its stored state and its seed, and the parent folds the updates into the
aggregate in the sampled order. The parent keeps the only client store: it sends each job the
client's state and saves the state the job returns, so disk and memory stores, private tensors,
personal models and optimiser state work unchanged. A free worker takes the next client at once;
at most `workers` jobs run and at most `workers` finished ones wait for their turn to be folded, so
memory grows by about one model per worker (its working model and the tensors of its jobs), not
per client. Tensors cross between the processes in shared memory (`share`): a round's global
tensors are written once for all workers, and an update is read by the parent where the worker
wrote it.

Workers are forked from the parent on CPU with one thread each (they inherit the task, its tokenised
silos and the clients); otherwise (CUDA, which cannot be forked; several threads per worker, which
OpenMP cannot fork: `start_method`) they are spawned and build the same parts from the config
(`fedsilo.recipe`), worker k on GPU k mod the GPU count.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions multiprocessing pickles with)

from fedsilo.client.store import ClientState
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import SiloRefused
from fedsilo.errors import WorkerLost
from fedsilo.progress import Progress
from fedsilo.server import Server

MAX_AUTO_CPU_WORKERS = 4


def resolve_workers(setting: int | str, device: torch.device, n_clients: int) -> int:
    """`engine.workers` as a count: auto is one per GPU on CUDA, else one per CPU core (at most 4);
    never more than there are clients."""
    if setting == "auto":
        if device.type == "cuda":
            setting = max(1, torch.cuda.device_count())
        else:
            setting = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                          MAX_AUTO_CPU_WORKERS)
    return max(1, min(int(setting), n_clients))


def resolve_threads(setting: int | str) -> int:
    """`engine.threads` as a count: the threads of the whole run (auto: torch's own choice, the cores
    this process may use, or OMP_NUM_THREADS), which one process uses alone or workers share."""
    return torch.get_num_threads() if setting == "auto" else int(setting)


def threads_per_worker(threads: int, workers: int) -> int:
    return max(1, threads // workers)


def start_method(device: torch.device, threads: int) -> str:
    """fork where it is safe and cheapest: CPU, POSIX, one torch thread per worker. Otherwise spawn:
    CUDA cannot be forked, and torch's OpenMP (libgomp) is not fork-safe: once the parent has run a
    parallel region, a forked worker that opens one with 2+ threads waits forever for threads the
    fork did not copy (seen: `engine.threads = 4, engine.workers = 2` hung in round 1; auto settings
    do this on any machine with more than 4 cores). One thread never opens a parallel region."""
    return "fork" if device.type == "cpu" and threads == 1 and "fork" in mp.get_all_start_methods() else "spawn"


# ---- tensors cross the process boundary in shared memory, one buffer per message ------------------
# Pickled by multiprocessing, a shared buffer travels as a handle (torch.multiprocessing's reduction:
# a file descriptor), not as its bytes; the receiver maps the same pages, and its tensors are views.
# So a round's global tensors exist once for every worker (not once per job as bytes, then again as
# tensors), and an update is written once by the worker and read in place by the parent. Dicts keep
# their order (checkpoints then equal a sequential run's, key order included).

ALIGN = 64  # each tensor starts on a 64-byte boundary, so a byte slice views as any dtype


@dataclasses.dataclass(frozen=True)
class Shared:
    """Named tensors in one shared-memory buffer: (name, dtype, shape, byte offset) per tensor."""
    buffer: torch.Tensor | None  # uint8 in shared memory; None when there are no tensors
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def share(tensors: Tensors) -> Shared:
    """One copy of `tensors` (any device) in a new shared-memory buffer."""
    layout, size = [], 0
    for name, t in tensors.items():
        layout.append((name, t.dtype, tuple(t.shape), size))
        size += -(-_nbytes(t.dtype, tuple(t.shape)) // ALIGN) * ALIGN
    if not layout:
        return Shared(None, ())
    buffer = torch.empty(size, dtype=torch.uint8).share_memory_()
    shared = Shared(buffer, tuple(layout))
    with torch.no_grad():
        for view, t in zip(unshare(shared).values(), tensors.values()):
            view.copy_(t.detach())
    return shared


def unshare(shared: Shared) -> Tensors:
    """The tensors of `shared` as views of its buffer (no copy)."""
    return {name: shared.buffer[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)
            for name, dtype, shape, offset in shared.layout}


def share_state(state: ClientState | None) -> tuple[dict[str, Shared], dict] | None:
    return None if state is None else ({k: share(v) for k, v in state.slots.items()}, state.meta)


def unshare_state(packed: tuple[dict[str, Shared], dict] | None) -> ClientState | None:
    return None if packed is None else ClientState({k: unshare(v) for k, v in packed[0].items()}, packed[1])


class JobStore:
    """The client store a worker's client sees during one job: the state the parent sent, and the
    state the client saves, which goes back to the parent's store."""

    def __init__(self, round_idx: int, state: ClientState | None) -> None:
        self.round = round_idx
        self._state = state
        self.saved: ClientState | None = None

    def get(self, client: str) -> ClientState | None:
        return self._state

    def put(self, client: str, state: ClientState) -> None:
        self.saved = state


# ---- the worker side ------------------------------------------------------------------------------

_CLIENTS: dict = {}      # name → SiloClient: inherited by fork, or built by `_build` after spawn
_STEPS = None            # queue of finished optimiser steps, for the parent's progress bar


def _init_worker(threads: int, steps, spawn_from: dict | None, counter, parent: int, policies: dict,
                 ledgers: dict) -> None:
    global _STEPS, _CLIENTS
    _die_with(parent)
    # a worker ends without a word; the run's process says what happened. A fork inherits the run's handlers
    # (SIGTERM raising `Terminated`, SIGINT KeyboardInterrupt), and each printed a traceback: the pool ends the
    # other workers with SIGTERM when one died, and Ctrl-C reaches every process of the terminal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    torch.set_num_threads(threads)
    _STEPS = steps
    if spawn_from is not None:
        with counter.get_lock():
            rank = counter.value
            counter.value += 1
        _CLIENTS = _build(spawn_from, rank)
        from fedsilo.recipe import give_policies
        give_policies(_CLIENTS, policies)  # each silo's own policy, as in the run's process
        for name, ledger in ledgers.items():  # and its privacy ledger (the same file)
            _CLIENTS[name].ledger = ledger


def _die_with(parent: int) -> None:
    """Exit when the run's process dies, even by SIGKILL: an orphaned worker would idle forever,
    holding its memory (Linux; elsewhere the worker ends when the pool's queue breaks)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:          # the parent died before prctl took effect
        os._exit(1)


def _build(config: dict, rank: int) -> dict:
    """The clients over a model of this worker's own (spawned workers: CUDA)."""
    from fedsilo.client.store import MemoryStore
    from fedsilo.config import validate
    from fedsilo.recipe import build_clients, build_model, build_task

    cfg = validate(config)
    if torch.cuda.is_available() and cfg.model.device in ("auto", "cuda"):
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"device": f"cuda:{rank % torch.cuda.device_count()}"})})
    model, tokenizer = build_model(cfg)
    task = build_task(cfg, tokenizer)
    return build_clients(cfg, task, model, MemoryStore())


def _fit(name: str, round_idx: int, received: Shared, state, seed: int) -> tuple:
    client = _CLIENTS[name]
    store = client.store = JobStore(round_idx, unshare_state(state))
    on_step = (lambda: _STEPS.put(1)) if _STEPS is not None else None
    update = client.fit(round_idx, unshare(received), seed, on_step=on_step)
    update.tensors = share(update.tensors)
    return update, share_state(store.saved)


# ---- the parent side ------------------------------------------------------------------------------

def _quiet_handle_sharer(previous):
    """A worker killed while it fetched a shared tensor's file descriptor resets the connection of
    multiprocessing's handle-sharing thread, which prints that error as a traceback (through
    sys.excepthook). The run reports the dead worker in one line (WorkerLost): this hook drops only
    that thread's connection errors and hands everything else on."""
    from multiprocessing import resource_sharer

    def hook(kind, value, tb):
        sharer = getattr(resource_sharer._resource_sharer, "_thread", None)  # noqa: SLF001 - stdlib internals
        if not (issubclass(kind, (ConnectionError, EOFError)) and threading.current_thread() is sharer):
            previous(kind, value, tb)

    return hook


class WorkerPool:
    """`workers` processes that train clients; started at the first parallel round, closed with the run."""

    def __init__(self, clients: dict, workers: int, threads: int, device: torch.device, config: dict,
                 policies: dict[str, str] | None = None) -> None:
        """`threads`: torch threads of each worker."""
        global _CLIENTS
        method = start_method(device, threads)
        ctx = mp.get_context(method)
        self.workers = workers
        self.steps = ctx.SimpleQueue()
        _CLIENTS = clients  # what fork children inherit
        self._excepthook, sys.excepthook = sys.excepthook, _quiet_handle_sharer(sys.excepthook)
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                        initargs=(threads, self.steps, config if method == "spawn" else None,
                                                  ctx.Value("i", 0), os.getpid(), policies or {},
                                                  {n: c.ledger for n, c in clients.items() if c.ledger is not None}))

    def run_round(self, server: Server, clients: dict, sampled: Sequence[str], round_idx: int, seed: int,
                  progress: Progress | None, deliver=None) -> None:
        """Train `sampled` in the pool and fold each update (and save each state) in the sampled order.

        A worker takes the next client as soon as it is free, not when the client before it in the
        order is folded; finished jobs wait for their turn, at most `workers` of them, so memory stays
        bounded by the worker count, not the client count."""
        drain = _StepCounter(self.steps, progress) if progress else None
        queue = list(sampled)
        payloads: dict[tuple, Shared] = {}  # this round's global tensors, shared once per distinct payload
        running: dict[Future, str] = {}
        finished: dict[str, Future] = {}
        try:
            for name in sampled:
                while name not in finished:
                    while queue and len(running) < self.workers and len(running) + len(finished) < 2 * self.workers:
                        nxt = queue.pop(0)
                        running[self.pool.submit(_fit, nxt, round_idx, _payload(server, nxt, payloads),
                                                 share_state(clients[nxt].store.get(nxt)), seed)] = nxt
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    finished.update((running.pop(f), f) for f in done)
                try:
                    update, state = finished.pop(name).result()
                except SiloRefused as err:  # nothing trained, nothing to store
                    reason = server.reject(name, f"refused by the silo: {err}", key="refused", final=err.final)
                else:
                    update = dataclasses.replace(update, tensors=unshare(update.tensors))
                    state = unshare_state(state)
                    if state is not None:
                        clients[name].store.put(name, state)
                    reason = (deliver or server.receive)(name, update)
                if reason and progress:
                    progress.warn(f"round {round_idx}: rejected {name}: {reason}")
        except BrokenProcessPool:
            training = ", ".join(c for c in sampled if c == name or c in finished or c in running.values())
            raise WorkerLost(f"round {round_idx}: a worker process died while training one of {training} (killed, "
                             "or out of memory?); the last complete round's checkpoint is kept: continue with "
                             "--resume, adding --set engine.workers=1 to train one client at a time") from None
        finally:
            for f in running:
                f.cancel()
            if drain:
                drain.stop()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        sys.excepthook = self._excepthook


def _payload(server: Server, client: str, payloads: dict[tuple, Shared]) -> Shared:
    """What `client` receives, in shared memory: clients that receive the same tensors (all of them,
    unless a download policy differs per client) share one buffer. Within a round the global tensors
    do not change (the server steps once every update is in)."""
    tensors = server.payload(client)
    key = tuple((name, id(t)) for name, t in tensors.items())
    if key not in payloads:
        payloads[key] = share(tensors)
    return payloads[key]


class _StepCounter:
    """Moves the workers' step events onto the progress bar, from a thread of the parent.

    It is stopped by an event of the parent's own, never by a message through the workers' queue: when
    a worker dies the pool kills the others, and one killed inside `put` leaves the queue's write lock
    held for ever (a parent putting a stop message then hung; tests/test_hardening_runs.py saw it)."""

    POLL = 0.05  # seconds between looks at the queue while it is empty

    def __init__(self, steps, progress: Progress) -> None:
        self.steps, self.progress = steps, progress
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:  # every event already sent is shown before the thread ends
            if not self.steps.empty():
                self.steps.get()
                self.progress.advance()
            elif self.done.is_set():
                return
            else:
                self.done.wait(self.POLL)

    def stop(self) -> None:
        """Stops the thread after what it is reading (a worker killed mid-message leaves a read that never
        ends: the daemon thread is then left to the process's exit)."""
        self.done.set()
        self.thread.join(timeout=1.0)
