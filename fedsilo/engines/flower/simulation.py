"""Run a fedsilo config in Flower's simulation engine (one virtual SuperNode per silo)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from fedsilo.config import RunConfig
from fedsilo.progress import Display


def run_simulation(cfg: RunConfig, out: Path, resume: bool = False, show_progress: Display = True) -> dict:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from flwr.simulation import run_simulation as flwr_run_simulation

    from .client_app import app as client_app
    from .server_app import make_server_app

    flwr_run_simulation(
        server_app=make_server_app(cfg, Path(out), resume, show_progress),
        client_app=client_app,
        num_supernodes=len(cfg.task.client_names()),
        backend_config={"client_resources": {"num_cpus": cfg.flower.num_cpus, "num_gpus": 0.0},
                        "init_args": {"num_cpus": max(1, os.cpu_count() or 1), "include_dashboard": False}},
    )
    results = Path(out) / "results.json"
    if not results.exists():
        raise RuntimeError(f"the Flower simulation ended without results in {out} (see the log above)")
    return json.loads(results.read_text())
