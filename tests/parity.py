"""One config run in-process and on Flower's simulation, for the parity tests."""
import os
from pathlib import Path

import torch

from fedsilo.runs.flower import run_simulation
from fedsilo.runs.runner import run_experiment


def local_and_simulation(cfg, out: Path) -> tuple[Path, Path]:
    """(in-process run directory, simulation run directory). In-process runs with one torch thread,
    as each Flower ClientApp gets, so the two do the same arithmetic."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(cfg, out / "local", show_progress=False)
    finally:
        torch.set_num_threads(threads)
    run_simulation(cfg, out / "sim", show_progress=False)
    return out / "local", out / "sim"
