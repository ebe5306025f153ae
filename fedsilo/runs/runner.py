"""Runs an experiment end to end: paradigm → rounds → model selection → test → report."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsilo.client.silo import SiloClient
from fedsilo.config import RunConfig
from fedsilo.core.exchange import ExchangePlan
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import clone
from fedsilo.engines import local
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


@dataclass
class Member:
    """A participant: a name, its training examples and its hyper-parameters."""
    name: str
    examples: list
    cfg: object


def build_task(cfg: RunConfig):
    """(task, model, tokenizer) for the config; data is verified (and fetched) first."""
    from fedsilo.datafetch import default_data_root, ensure
    from fedsilo.models.seq2seq import build_seq2seq
    from fedsilo.tasks.text2sql.task import Text2SQLTask

    data_dir = Path(cfg.task.data_dir) if cfg.task.data_dir else ensure("text2sql", default_data_root() / "text2sql")
    model, tokenizer = build_seq2seq(cfg.model, seed=cfg.seed)
    return Text2SQLTask(cfg.task, tokenizer, data_dir), model


def _members(cfg: RunConfig, task) -> list[Member]:
    if cfg.paradigm == "centralized":
        pooled = [e for s in task.silos for e in task.examples(s, "train")]
        return [Member("pooled", pooled, cfg.client)]
    return [Member(s, task.examples(s, "train"), cfg.client_config(s)) for s in task.silos]


def _load_global(model: torch.nn.Module, server: Server, private: dict | None = None) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in list(server.params.items()) + list((private or {}).items()):
            params[name].copy_(t)


def _evaluate(task, model, server: Server, clients: dict[str, SiloClient], split: str,
              progress: Progress | None, with_exec: bool = False) -> dict:
    """The global model (plus each silo's private tensors, if any) on every silo's `split`."""
    total = sum(len(task.examples(s, split)) for s in task.silos)
    if progress:
        progress.begin(f"evaluating on {split}", total)
    personal = any(c.private for c in clients.values())
    if not personal:
        _load_global(model, server)
        return task.evaluate(model, split, progress=progress, with_exec=with_exec)
    parts = []
    for silo in task.silos:
        _load_global(model, server, clients[silo].private if silo in clients else None)
        parts.append(task.evaluate(model, split, [silo], progress=progress, with_exec=with_exec))
    return combine({s: row for p in parts for s, row in p["per_silo"].items()})


def run_federation(cfg: RunConfig, run: RunDir, task, model, resume: bool = False,
                   progress: Progress | None = None) -> dict:
    """Rounds on the in-process engine with model selection on the merged dev set."""
    members = _members(cfg, task)
    plan = ExchangePlan(tuple(cfg.exchange.shared), tuple(cfg.exchange.private), cfg.exchange.select)
    names = [n for n, _ in model.named_parameters()]
    shared_names, private_names = plan.split(names)
    params = dict(model.named_parameters())
    server = Server({k: params[k].detach() for k in shared_names},
                    ServerOptimizer(cfg.server.optimizer, cfg.server.effective_lr, cfg.server.momentum,
                                    cfg.server.beta1, cfg.server.beta2, cfg.server.tau),
                    cfg.federation.weighting)
    private_init = {k: params[k].detach() for k in private_names}
    clients = {m.name: SiloClient(m.name, i, m.examples, task.collate, m.cfg, model, plan, private_init)
               for i, m in enumerate(members)}

    run.prepare(cfg, resume)
    start, best = 1, None
    state = run.load(run.checkpoint) if resume else None
    if state is not None:
        server.load_state_dict(state["server"])
        for name, c in clients.items():
            c.load_state_dict(state["clients"][name])
        start, best = state["round"] + 1, state["best"]
        run.truncate_rounds(state["round"])
    elif resume:
        run.truncate_rounds(0)

    rounds = cfg.federation.rounds
    for r in range(start, rounds + 1):
        sampled = sample_clients(list(clients), r, cfg.seed, cfg.federation.sample_fraction,
                                 cfg.federation.sample_count)
        record = local.run_round(server, clients, sampled, r, cfg.seed, progress)
        record["dev"] = None
        if r % cfg.federation.eval_every == 0 or r == rounds:
            t0 = time.perf_counter()
            dev = _evaluate(task, model, server, clients, "dev", progress)
            dev["loss"] = _pooled_loss(dev["per_silo"])
            dev["score"] = dev["micro"]
            key = [dev["score"], -dev["loss"]]
            if best is None or key > best["key"]:
                best = {"key": key, "round": r, "score": dev["score"]}
                run.save(run.best, {"round": r, "server": server.state_dict(),
                                    "clients": {n: c.state_dict() for n, c in clients.items()}})
            record["dev"] = dev
            record["eval_seconds"] = time.perf_counter() - t0
        if progress:
            dev_txt = f", dev EM {record['dev']['score']:.2f}" if record["dev"] else ""
            progress.log(f"round {r}/{rounds} done in {record['seconds']:.1f}s{dev_txt}")
        run.append_round(record)
        run.save(run.checkpoint, {"round": r, "best": best, "server": server.state_dict(),
                                  "clients": {n: c.state_dict() for n, c in clients.items()}})

    best_state = run.load(run.best)
    if best_state is None:
        raise RunDirError(f"{run.path}: no best.pt; the run has no evaluated round")
    server.load_state_dict(best_state["server"])
    for name, c in clients.items():
        c.load_state_dict(best_state["clients"][name])
    test = _evaluate(task, model, server, clients, "test", progress, with_exec=True)
    results = {"paradigm": cfg.paradigm, "name": cfg.name, "best_round": best_state["round"],
               "best_dev": best["score"], "test": test}
    run.write_results(results)
    return results


def run_experiment(cfg: RunConfig, out: str | Path, resume: bool = False, show_progress: bool = True) -> dict:
    """Any paradigm into run directory `out`; returns results.json's content."""
    out = Path(out)
    with Progress(enabled=show_progress) as progress:
        if cfg.paradigm != "finetune":
            task, model = build_task(cfg)
            return run_federation(cfg, RunDir(out), task, model, resume, progress)
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
                task, model = build_task(sub)
                done = run_federation(sub, sub_run, task, model, resume and sub_run.config.exists(), progress)
            parts[silo] = done["test"]["per_silo"][silo]
        results = {"paradigm": "finetune", "name": cfg.name, "best_round": None, "best_dev": None,
                   "test": combine(parts)}
        top.write_results(results)
        return results
