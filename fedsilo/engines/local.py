"""The in-process engine: every silo in this process, trained one after another on one working
model, or a round's clients at once in worker processes (`engine.workers`, `engines/workers.py`).

What a silo keeps between rounds is in the client store (disk by default), so RAM holds one model
(plus one per worker) however many silos keep state.
"""
from __future__ import annotations

import time

import torch

from fedsilo.client.silo import SiloClient, initial_private, load_tensors
from fedsilo.client.store import ClientStore
from fedsilo.config import RunConfig, SecureAggregationConfig
from fedsilo.core.transforms import SiloRefused
from fedsilo.engines.secure import sum_in_process
from fedsilo.engines.workers import WorkerPool, resolve_threads, resolve_workers, threads_per_worker
from fedsilo.models.precision import autocast
from fedsilo.progress import Progress
from fedsilo.errors import RunDirError
from fedsilo.recipe import Recipe, build_clients, give_policies
from fedsilo.server import Server
from fedsilo.tasks.base import CrossDomain, evaluate_rows


def run_round(server: Server, clients: dict[str, SiloClient], sampled: list[str], round_idx: int, seed: int,
              progress: Progress | None = None, pool: WorkerPool | None = None,
              secure: SecureAggregationConfig | None = None) -> dict:
    """Send, train, receive, aggregate. Returns the round record (without evaluation)."""
    start = time.perf_counter()
    server.begin_round(round_idx, sampled)
    for client in clients.values():
        client.store.set_round(round_idx)
    masked: dict = {}  # secure aggregation: the silos' vectors, summed under the mask below

    def deliver(name, update):
        if update.secure_input is not None:
            masked[name] = update
            return None
        return server.receive(name, update)

    if pool is not None and len(sampled) > 1:
        if progress:
            progress.begin(f"round {round_idx} · {len(sampled)} clients in {pool.workers} workers",
                           sum(clients[n].planned_steps() for n in sampled))
        pool.run_round(server, clients, sampled, round_idx, seed, progress, deliver)
    else:
        for name in sampled:
            client = clients[name]
            if progress:
                progress.begin(f"round {round_idx} · {name}", client.planned_steps())
            try:
                update = client.fit(round_idx, server.payload(name), seed,
                                    on_step=progress.advance if progress else None)
                reason = deliver(name, update)
            except SiloRefused as err:
                reason = server.reject(name, f"refused by the silo: {err}", key="refused", final=err.final)
            if reason and progress:
                progress.warn(f"round {round_idx}: rejected {name}: {reason}")
    if secure is not None:
        reason = sum_in_process(server, masked, sampled, secure, f"{seed}/{round_idx}")
        if reason and progress:
            progress.warn(f"round {round_idx}: {reason}")
    record = server.end_round()
    record.update(round=round_idx, sampled=sampled, missing=[])
    record["seconds"] = time.perf_counter() - start
    return record


class LocalEngine:
    def __init__(self, cfg: RunConfig, task, model: torch.nn.Module, store: ClientStore, recipe: Recipe,
                 policies: dict[str, str] | None = None) -> None:
        self.cfg, self.task, self.model, self.store = cfg, task, model, store
        self.plan = recipe.plan
        self.initial = initial_private(model, self.plan)  # the global model's private tensors (the matrix)
        self.clients = build_clients(cfg, task, model, store, recipe)
        self.policies = dict(policies or {})
        give_policies(self.clients, self.policies)
        self.device = next(model.parameters()).device
        self.workers = resolve_workers(cfg.engine.workers, self.device, len(self.clients))
        self.threads = resolve_threads(cfg.engine.threads)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # put back by close()
        self._pool: WorkerPool | None = None

    @property
    def client_names(self) -> list[str]:
        return list(self.clients)

    @property
    def client_sizes(self) -> dict[str, int]:
        return {name: len(c.examples) for name, c in self.clients.items()}

    def train_round(self, server: Server, sampled: list[str], round_idx: int, progress: Progress | None) -> dict:
        parallel = self.workers > 1 and len(sampled) > 1
        if parallel and self._pool is None:
            workers = min(self.workers, len(sampled))
            self._pool = WorkerPool(self.clients, workers, threads_per_worker(self.threads, workers), self.device,
                                    self.cfg.model_dump(exclude_none=True), self.policies)
        record = run_round(server, self.clients, sampled, round_idx, self.cfg.seed, progress, self._pool,
                           self.cfg.federation.secure_aggregation)
        workers = self._pool.workers if parallel else 1
        record["compute"] = {"workers": workers, "threads_per_client": threads_per_worker(self.threads, workers)}
        return record

    def close(self) -> None:
        """Stop the worker processes (if any were started); torch's thread count as before the run."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        torch.set_num_threads(self._threads_before)

    def evaluate(self, server: Server, split: str, progress: Progress | None, final: bool = False) -> list[dict]:
        """Each silo's model (the global tensors with what the silo keeps) on that silo's `split`; the
        final test evaluation's rows also carry each test item's stats where the task can."""
        task = self.task
        if progress:
            progress.begin(f"evaluating on {split}", sum(len(task.examples(c, split)) for c in task.clients))
        rows = []
        for name in task.clients:
            client = self.clients.get(name)
            if client is not None:
                client.load_for_eval(server.params)
            else:  # centralized: the pooled model
                load_tensors(self.model, server.params)
            with autocast(self.cfg.model.precision, self.device):
                rows += evaluate_rows(task, self.model, name, split, progress=progress, final=final)
        return rows

    def evaluate_matrix(self, server: Server, split: str, progress: Progress | None) -> dict[str, list[dict]]:
        """Every model × every matrix domain's `split` (the translation paper's tables): the global
        model (the start model's private tensors under the global ones), then each client's own model
        where clients keep tensors of their own. {} when the task has no matrix."""
        task = self.task
        domains = list(task.matrix) if isinstance(task, CrossDomain) else []
        if not domains:
            return {}
        models = {"global": lambda: load_tensors(self.model, self.initial, server.params)}
        if self.plan.private or self.plan.keeps_everything:
            models.update({name: (lambda c=c: c.load_for_eval(server.params))
                           for name, c in self.clients.items() if name != "pooled"})
        if progress:
            progress.begin(f"cross-domain matrix on {split}",
                           len(models) * sum(len(task.examples(d, split)) for d in domains))
        out = {}
        for name, load in models.items():
            load()
            with autocast(self.cfg.model.precision, self.device):
                out[name] = [row for d in domains for row in task.evaluate(self.model, d, split, progress=progress)]
        return out

    def set_round(self, round_idx: int) -> None:
        self.store.set_round(round_idx)

    def after_checkpoint(self, keep: list[int]) -> None:
        self.store.prune(keep)

    def truncate(self, last_round: int) -> None:
        self.store.truncate(last_round)

    def state_dict(self) -> dict:
        return {"store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["store"].get("kind") == "flower":  # its silos' state is on their own disks, not here
            raise RunDirError("it is a Flower deployment's run directory (its silos keep their state on their "
                              "own disks); resume it as it was started: fedsilo deploy CONFIG --out DIR --resume "
                              "(or fedsilo run CONFIG --engine flower-sim --out DIR --resume)")
        self.store.load_state_dict(state["store"])
