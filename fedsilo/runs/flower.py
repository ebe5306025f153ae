"""A run with Flower carrying the messages: the ServerApp (fedsilo's runner and Server over the
Flower engine) for `flwr run` and deployments, and Flower's simulation of one SuperNode per silo.

The server process never opens client data: it builds the model only for its initial weights.
"""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsilo.config import RunConfig, load_config
from fedsilo.engines.flower.engine import FlowerEngine
from fedsilo.progress import Display, Progress
from fedsilo.recipe import build_model, build_server
from fedsilo.rundir.layout import RunDir, tokenizer_identity
from fedsilo.rundir.lock import RunLock, held_for
from fedsilo.rundir.refusal import left_as_found
from fedsilo.tasks import TASKS

from .report import write_report
from .runner import run_federation
from .tracked import RunTracking, finish_run


def serve(grid: Grid, cfg: RunConfig, out: Path, resume: bool, show_progress: Display = True,
          lock_token: str = "") -> dict:
    """The whole run (rounds, selection, test, report) with Flower carrying the messages.

    One writer per run directory: the run holds its lock unless `lock_token` shows that the process
    which submitted it (`fedsilo deploy`) holds it already. Refused at its start, it leaves `out` as it
    found it (fedsilo.rundir.refusal)."""
    with nullcontext() if held_for(out, lock_token) else RunLock(out), left_as_found(out):
        return _serve(grid, cfg, out, resume, show_progress)


def _serve(grid: Grid, cfg: RunConfig, out: Path, resume: bool, show_progress: Display) -> dict:
    run = RunDir(out)
    run.prepare(cfg, resume)  # fails before any silo is contacted if the run dir is unusable
    model, tokenizer = build_model(cfg)  # the same builder as the silos: initial weights only, no client data
    engine = FlowerEngine(grid, cfg, run_key=run.run_id())
    spec = TASKS.get(cfg.task.name).spec()
    # tracked here, on the server side, with what the silos sent: the rounds' and evaluations' numbers
    with Progress(enabled=show_progress) as progress, RunTracking.of(cfg, out, progress.warn) as tracking:
        results = run_federation(cfg, run, engine, build_server(cfg, model), spec, cfg.task.name, resume,
                                 progress, display=server_display(cfg), tokenizer=tokenizer_identity(tokenizer),
                                 tracking=tracking)
        write_report(out)
        finish_run(tracking, out)
    return results


def server_display(cfg: RunConfig) -> dict[str, str]:
    """The silos' names in tables, from the config alone (the server never opens the silos' data):
    an own source's `display`, a benchmark silo's name in the papers."""
    names = cfg.task.display_names()
    return {silo: names[silo] for silo in cfg.task.client_names() if silo in names}


def make_server_app(cfg: RunConfig, out: Path, resume: bool = False, show_progress: Display = True) -> ServerApp:
    """A ServerApp bound to one fedsilo config (simulation from Python, `fedsilo run --engine flower-sim`).

    A run directory in use by another run is refused here, before Flower starts its workers."""
    if Path(out).exists():  # a folder that is not there is no one's: the run's own lock makes it
        with RunLock(out):
            pass
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        serve(grid, cfg, out, resume, show_progress)

    return server_app


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """For `flwr run` / deployment: run config keys `config` (TOML path), `out`, `resume`, `set`, and
    `lock` (the token of the run-directory lock `fedsilo deploy` holds for this run)."""
    rc = context.run_config
    cfg = load_config(str(rc["config"]), [s for s in str(rc.get("set", "")).split(";") if s])
    out = Path(str(rc.get("out") or Path(cfg.out_dir) / cfg.name))
    serve(grid, cfg, out, bool(rc.get("resume", False)), show_progress=False, lock_token=str(rc.get("lock", "")))


def run_simulation(cfg: RunConfig, out: Path, resume: bool = False, show_progress: Display = True) -> dict:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from flwr.simulation import run_simulation as flwr_run_simulation

    from fedsilo.engines.flower.client_app import SIMULATION, app as client_app  # built here only: no ServerApp needs one

    before = os.environ.get(SIMULATION)
    os.environ[SIMULATION] = "1"  # its virtual silos know they are one operator's (Ray's workers inherit it)
    try:
        flwr_run_simulation(
            server_app=make_server_app(cfg, Path(out), resume, show_progress),
            client_app=client_app,
            num_supernodes=len(cfg.task.client_names()),
            backend_config={"client_resources": {"num_cpus": cfg.flower.num_cpus, "num_gpus": 0.0},
                            "init_args": {"num_cpus": max(1, os.cpu_count() or 1), "include_dashboard": False}},
        )
    finally:  # a deployment this process starts later must not inherit it
        if before is None:
            os.environ.pop(SIMULATION, None)
        else:
            os.environ[SIMULATION] = before
    results = Path(out) / "results.json"
    if not results.exists():
        raise RuntimeError(f"the Flower simulation ended without results in {out} (see the log above)")
    return json.loads(results.read_text())
