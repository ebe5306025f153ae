"""A `fedsilo run` in its own process, SIGKILLed once it has logged round 1 (crash tests)."""
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
