"""Runs an experiment end to end: paradigm → rounds → model selection → test → report."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from fedsilo.config import RunConfig
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.engines.local import LocalEngine, exchange_plan
from fedsilo.progress import Progress
from fedsilo.server import Server, sample_clients

from .rundir import RunDir, RunDirError


def combine(per_silo: dict[str, dict]) -> dict:
    """MacroAvg (mean of silo EMs) and MicroAvg (pooled EM) from per-silo rows evaluated apart."""
    correct = sum(r["correct"] for r in per_silo.values())
    n = sum(r["n"] for r in per_silo.values())
    return {"per_silo": per_silo, "macro": sum(r["em"] for r in per_silo.values()) / len(per_silo),
            "micro": 100.0 * correct / n if n else 0.0}


def _pooled_loss(per_silo: dict[str, dict]) -> float:
    """Mean loss over the merged set (silos weighted by their example counts)."""
    n = sum(r["n"] for r in per_silo.values())
    return sum(r["loss"] * r["n"] for r in per_silo.values()) / n if n else float("nan")


def build_task(cfg: RunConfig):
    """(task, model) for the config; data is verified (and fetched) first."""
    from fedsilo.datafetch import default_data_root, ensure
    from fedsilo.models.seq2seq import build_seq2seq
    from fedsilo.tasks.text2sql.task import Text2SQLTask

    data_dir = Path(cfg.task.data_dir) if cfg.task.data_dir else ensure("text2sql", default_data_root() / "text2sql")
    model, tokenizer = build_seq2seq(cfg.model, seed=cfg.seed)
    return Text2SQLTask(cfg.task, tokenizer, data_dir), model


def build_server(cfg: RunConfig, model: torch.nn.Module) -> Server:
    """The server over the model's shared tensors, as the config's exchange plan splits them."""
    params = dict(model.named_parameters())
    shared, _ = exchange_plan(cfg).split(params)
    opt = ServerOptimizer(cfg.server.optimizer, cfg.server.effective_lr, cfg.server.momentum,
                          cfg.server.beta1, cfg.server.beta2, cfg.server.tau)
    return Server({k: params[k].detach() for k in shared}, opt, cfg.federation.weighting)


def run_federation(cfg: RunConfig, run: RunDir, engine, server: Server, resume: bool = False,
                   progress: Progress | None = None) -> dict:
    """Rounds on any engine, model selection on the merged dev set, test of the selected model."""
    run.prepare(cfg, resume)
    device = next(iter(server.params.values())).device  # checkpoints load where the server lives
    start, best = 1, None
    state = run.load(run.checkpoint, device) if resume else None
    if state is not None:
        server.load_state_dict(state["server"])
        engine.load_state_dict(state["clients"])
        start, best = state["round"] + 1, state["best"]
        run.truncate_rounds(state["round"])
    elif resume:
        run.truncate_rounds(0)

    rounds = cfg.federation.rounds
    for r in range(start, rounds + 1):
        sampled = sample_clients(engine.client_names, r, cfg.seed, cfg.federation.sample_fraction,
                                 cfg.federation.sample_count)
        record = engine.train_round(server, sampled, r, progress)
        record["dev"] = None
        if r % cfg.federation.eval_every == 0 or r == rounds:
            t0 = time.perf_counter()
            dev = combine(engine.evaluate(server, "dev", progress))
            dev["loss"] = _pooled_loss(dev["per_silo"])
            dev["score"] = dev["micro"]
            key = [dev["score"], -dev["loss"]]
            if best is None or key > best["key"]:
                best = {"key": key, "round": r, "score": dev["score"]}
                run.save(run.best, {"round": r, "server": server.state_dict(), "clients": engine.state_dict()})
            record["dev"] = dev
            record["eval_seconds"] = time.perf_counter() - t0
        if progress:
            dev_txt = f", dev EM {record['dev']['score']:.2f}" if record["dev"] else ""
            progress.log(f"round {r}/{rounds} done in {record['seconds']:.1f}s{dev_txt}")
        run.append_round(record)
        run.save(run.checkpoint, {"round": r, "best": best, "server": server.state_dict(),
                                  "clients": engine.state_dict()})

    best_state = run.load(run.best, device)
    if best_state is None:
        raise RunDirError(f"{run.path}: no best.pt; the run has no evaluated round")
    server.load_state_dict(best_state["server"])
    engine.load_state_dict(best_state["clients"])
    test = combine(engine.evaluate(server, "test", progress, with_exec=True))
    results = {"paradigm": cfg.paradigm, "name": cfg.name, "best_round": best_state["round"],
               "best_dev": best["score"], "test": test}
    run.write_results(results)
    return results


def run_local(cfg: RunConfig, run: RunDir, resume: bool = False, progress: Progress | None = None) -> dict:
    """One federation (or pooled/single-silo run) on the in-process engine."""
    task, model = build_task(cfg)
    return run_federation(cfg, run, LocalEngine(cfg, task, model), build_server(cfg, model), resume, progress)


def run_experiment(cfg: RunConfig, out: str | Path, resume: bool = False, show_progress: bool = True) -> dict:
    """Any paradigm into run directory `out`; returns results.json's content."""
    out = Path(out)
    with Progress(enabled=show_progress) as progress:
        if cfg.paradigm != "finetune":
            return run_local(cfg, RunDir(out), resume, progress)
        top = RunDir(out)
        top.prepare(cfg, resume)
        parts = {}
        for silo in cfg.task.silos:
            sub = cfg.model_copy(update={
                "paradigm": "federated", "name": f"{cfg.name}/{silo}",
                "task": cfg.task.model_copy(update={"silos": [silo]}),
                "clients": {k: v for k, v in cfg.clients.items() if k == silo},
                "federation": cfg.federation.model_copy(update={"weighting": "size", "sample_count": None,
                                                                "sample_fraction": 1.0}),
                "server": cfg.server.model_copy(update={"optimizer": "fedavg", "lr": 1.0}),
            })
            sub_run = RunDir(out / "silos" / silo)
            done = sub_run.read_results() if resume else None
            if done is None:
                progress.log(f"finetuning {silo} alone")
                done = run_local(sub, sub_run, resume and sub_run.config.exists(), progress)
            parts[silo] = done["test"]["per_silo"][silo]
        results = {"paradigm": "finetune", "name": cfg.name, "best_round": None, "best_dev": None,
                   "test": combine(parts)}
        top.write_results(results)
        return results
