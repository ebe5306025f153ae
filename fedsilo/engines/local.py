"""The in-process engine: every silo in this process, trained one after another on one working model."""
from __future__ import annotations

import time

import torch

from fedsilo.client.silo import SiloClient
from fedsilo.config import RunConfig
from fedsilo.core.exchange import ExchangePlan
from fedsilo.progress import Progress
from fedsilo.server import Server


def exchange_plan(cfg: RunConfig) -> ExchangePlan:
    return ExchangePlan(tuple(cfg.exchange.shared), tuple(cfg.exchange.private), cfg.exchange.select)


def load_tensors(model: torch.nn.Module, *tensor_sets: dict) -> None:
    """Copy named tensors into the model's parameters (later sets win)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for tensors in tensor_sets:
            for name, t in tensors.items():
                params[name].copy_(t)


def members(cfg: RunConfig, task) -> list[tuple[str, list, object]]:
    """(name, training examples, client config) per participant; one pooled client when centralized."""
    if cfg.paradigm == "centralized":
        return [("pooled", [e for s in task.silos for e in task.examples(s, "train")], cfg.client)]
    return [(s, task.examples(s, "train"), cfg.client_config(s)) for s in task.silos]


def run_round(server: Server, clients: dict[str, SiloClient], sampled: list[str], round_idx: int, seed: int,
              progress: Progress | None = None) -> dict:
    """Send, train, receive, aggregate. Returns the round record (without evaluation)."""
    start = time.perf_counter()
    server.begin_round()
    for name in sampled:
        client = clients[name]
        if progress:
            progress.begin(f"round {round_idx} · {name}", client.planned_steps())
        update = client.fit(round_idx, server.payload(), seed, on_step=progress.advance if progress else None)
        reason = server.receive(name, update)
        if reason and progress:
            progress.log(f"[yellow]round {round_idx}: rejected {name}: {reason}")
    record = server.end_round()
    record.update(round=round_idx, sampled=sampled, missing=[])
    record["bytes_up"] = sum(c["bytes_up"] for c in record["clients"].values())
    record["bytes_down"] = sum(c["bytes_down"] for c in record["clients"].values())
    record["seconds"] = time.perf_counter() - start
    return record


class LocalEngine:
    def __init__(self, cfg: RunConfig, task, model: torch.nn.Module) -> None:
        self.cfg, self.task, self.model = cfg, task, model
        plan = exchange_plan(cfg)
        params = dict(model.named_parameters())
        _, private = plan.split(params)
        private_init = {k: params[k].detach() for k in private}
        self.clients = {name: SiloClient(name, i, examples, task.collate, ccfg, model, plan, private_init)
                        for i, (name, examples, ccfg) in enumerate(members(cfg, task))}

    @property
    def client_names(self) -> list[str]:
        return list(self.clients)

    def train_round(self, server: Server, sampled: list[str], round_idx: int, progress: Progress | None) -> dict:
        return run_round(server, self.clients, sampled, round_idx, self.cfg.seed, progress)

    def evaluate(self, server: Server, split: str, progress: Progress | None, with_exec: bool = False) -> dict:
        """The global model (plus each silo's private tensors, if any) on every silo's `split`."""
        task = self.task
        if progress:
            progress.begin(f"evaluating on {split}", sum(len(task.examples(s, split)) for s in task.silos))
        per_silo = {}
        for silo in task.silos:
            client = self.clients.get(silo)
            load_tensors(self.model, server.params, client.private if client else {})
            per_silo.update(task.evaluate(self.model, split, [silo], progress=progress,
                                          with_exec=with_exec)["per_silo"])
        return per_silo

    def state_dict(self) -> dict:
        return {n: c.state_dict() for n, c in self.clients.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, c in self.clients.items():
            c.load_state_dict(state[name])
