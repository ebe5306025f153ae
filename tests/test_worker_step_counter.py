"""The parent's step counter of the worker pool stops though a dead worker holds the step queue's
write lock: when one worker dies the pool kills the others, and one killed inside `put` keeps that
lock for ever. The counter used to stop by putting a message into that queue, and hung (seen once in
`make test`, in tests/test_hardening_runs.py's killed-worker test)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading

from fedsilo.engines.workers import _StepCounter


class Bar:
    def __init__(self) -> None:
        self.count, self.first = 0, threading.Event()

    def advance(self, n: int = 1) -> None:
        self.count += n
        self.first.set()


def _take_the_lock_and_die(queue) -> None:
    queue._wlock.acquire()  # as a worker killed inside put()
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_step_counter_stops_though_a_dead_worker_holds_the_queue_lock():
    ctx = multiprocessing.get_context("fork")
    steps = ctx.SimpleQueue()
    steps.put("step")  # a step a worker reported before
    holder = ctx.Process(target=_take_the_lock_and_die, args=(steps,))
    holder.start()
    holder.join()
    assert holder.exitcode == -signal.SIGKILL
    bar = Bar()
    counter = _StepCounter(steps, bar)
    assert bar.first.wait(60)
    stopping = threading.Thread(target=counter.stop, daemon=True)
    stopping.start()
    stopping.join(60)  # a hang, not a time: it returns at once, or never
    assert not stopping.is_alive()
    assert bar.count == 1 and not counter.thread.is_alive()
