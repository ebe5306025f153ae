"""Crash tests: a `fedsilo run` in its own process SIGKILLed once it has logged round 1, or an in-process
run interrupted in round 2."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def past_round_1(config: Path, out: Path, **env: str) -> Iterator[subprocess.Popen]:
    """Yields the running process once rounds.jsonl holds round 1; kills it (SIGKILL) on exit."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen([sys.executable, "-m", "fedsilo", "run", str(config), "--out", str(out), "--no-progress"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not (out / "rounds.jsonl").exists() or not (out / "rounds.jsonl").read_text():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def interrupted_in_round_two(monkeypatch, cfg, out: Path, loop: str = "train_local") -> None:
    """Run `cfg` into `out` until round 2's second client is about to train, then raise KeyboardInterrupt
    (as Ctrl-C would); the real training loop (`loop`: train_local, or DP-SGD's train_private) is back in
    place afterwards."""
    import pytest

    import fedsilo.client.trainers as silo
    from fedsilo.runs.runner import run_experiment

    real, calls = getattr(silo, loop), {"n": 0}

    def dies_in_round_two(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # round 2, second client
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(silo, loop, dies_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, show_progress=False)
    monkeypatch.setattr(silo, loop, real)
