"""The Flower ClientApp: one silo. It reads only its own data (the SuperNode's node config names
it), trains with fedsilo's SiloClient, and keeps its state on the silo's disk, so a message that
reaches a fresh process continues where the last one stopped."""
from __future__ import annotations

import hashlib
import io
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsilo.client.silo import SiloClient
from fedsilo.config import ConfigError, RunConfig, validate
from fedsilo.engines.local import exchange_plan, load_tensors
from fedsilo.runs.rundir import atomic_write_bytes

from .codec import eval_row_to_metrics, from_arrays, update_to_content

app = ClientApp()


@dataclass
class Silo:
    cfg: RunConfig
    name: str
    task: object
    client: SiloClient
    state_dir: Path

    def state_path(self, round_idx: int) -> Path:
        return self.state_dir / f"round-{round_idx:05d}.pt"

    def restore(self, before_round: int) -> None:
        """Private tensors and step count as they were after the last round before `before_round`."""
        saved = sorted(p for p in self.state_dir.glob("round-*.pt") if int(p.stem[6:]) < before_round)
        if saved:
            self.client.load_state_dict(torch.load(saved[-1], weights_only=True))

    def persist(self, round_idx: int) -> None:
        buf = io.BytesIO()
        torch.save(self.client.state_dict(), buf)
        atomic_write_bytes(self.state_path(round_idx), buf.getvalue())


_SILOS: dict[tuple, Silo] = {}


def silo_name(cfg: RunConfig, node_config: dict) -> str:
    """Deployment: node config `silo`; simulation: the virtual node's partition id."""
    if "silo" in node_config:
        name = str(node_config["silo"])
    elif "partition-id" in node_config:
        name = cfg.task.silos[int(node_config["partition-id"])]
    else:
        raise ConfigError("this SuperNode has no node config `silo` (e.g. --node-config 'silo=\"yelp\"')")
    if name not in cfg.task.silos:
        raise ConfigError(f"SuperNode silo {name!r} is not in the run's task.silos {cfg.task.silos}")
    return name


def silo_for(message: Message, context: Context) -> Silo:
    """Build (once per process) this silo's task, model and client from the run's config."""
    conf = message.content["config"]
    text = str(conf["config"])
    cfg = validate(tomllib.loads(text), "config from the ServerApp")
    name = silo_name(cfg, context.node_config)
    data_dir = context.node_config.get("data-dir", cfg.task.data_dir)
    root = context.node_config.get("state-dir") or Path(tempfile.gettempdir()) / "fedsilo-flower-state" / name
    key = (hashlib.sha256(text.encode()).hexdigest(), str(conf["run-key"]), name, data_dir, str(root))
    if key not in _SILOS:
        from fedsilo.runs.runner import build_task
        own = cfg.model_copy(update={"task": cfg.task.model_copy(update={"silos": [name], "data_dir": data_dir})})
        task, model = build_task(own)
        plan = exchange_plan(cfg)
        params = dict(model.named_parameters())
        _, private = plan.split(params)
        client = SiloClient(name, cfg.task.silos.index(name), task.examples(name, "train"), task.collate,
                            cfg.client_config(name), model, plan, {k: params[k].detach() for k in private})
        state_dir = Path(root) / str(conf["run-key"])
        state_dir.mkdir(parents=True, exist_ok=True)
        _SILOS[key] = Silo(cfg, name, task, client, state_dir)
    return _SILOS[key]


@app.query("describe")
def describe(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    return Message(RecordDict({"silo": ConfigRecord({"name": silo.name}),
                               "metrics": MetricRecord({"n_examples": len(silo.client.examples)})}),
                   reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    round_idx = int(message.content["config"]["round"])
    silo.restore(before_round=round_idx)
    shared = from_arrays(message.content["arrays"])
    update = silo.client.fit(round_idx, shared, silo.cfg.seed)
    silo.persist(round_idx)
    return Message(update_to_content(update, silo.name), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    silo.restore(before_round=int(conf["state-round"]) + 1)
    load_tensors(silo.client.model, from_arrays(message.content["arrays"]), silo.client.private)
    row = silo.task.evaluate(silo.client.model, str(conf["split"]), [silo.name],
                             with_exec=bool(conf["with-exec"]))["per_silo"][silo.name]
    return Message(RecordDict({"metrics": eval_row_to_metrics(row), "silo": ConfigRecord({"name": silo.name})}),
                   reply_to=message)
