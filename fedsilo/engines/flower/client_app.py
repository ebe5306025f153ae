"""The Flower ClientApp: one silo. It reads only its own data (the SuperNode's node config names
it), trains with fedsilo's SiloClient, and keeps its state in a client store on the silo's own disk,
so a message that reaches a fresh process continues where the last one stopped."""
from __future__ import annotations

import hashlib
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsilo.client.policy import read_policy
from fedsilo.client.silo import SiloClient
from fedsilo.client.store import DiskStore
from fedsilo.config import ConfigError, RunConfig, validate
from fedsilo.core.transforms import SiloRefused
from fedsilo.models.precision import autocast
from fedsilo.rundir.datacheck import check_at_start

from fedsilo.fileio import atomic_write_bytes

from .codec import (from_arrays, masked_to_content, pack, pack_shares, refusal_to_content, rows_to_record, unpack,
                    unpack_keys, update_to_content)

app = ClientApp()


@dataclass
class Silo:
    cfg: RunConfig
    name: str
    task: object
    client: SiloClient
    store: DiskStore


_SILOS: dict[tuple, Silo] = {}


def silo_name(cfg: RunConfig, node_config: dict) -> str:
    """Deployment: node config `silo`; simulation: the virtual node's partition id."""
    names = cfg.task.client_names()
    if "silo" in node_config:
        name = str(node_config["silo"])
    elif "partition-id" in node_config:
        name = names[int(node_config["partition-id"])]
    else:
        raise ConfigError("this SuperNode has no node config `silo` (e.g. --node-config 'silo=\"yelp\"')")
    if name not in names:
        raise ConfigError(f"SuperNode silo {name!r} is not one of the run's clients {names}")
    return name


def silo_view(task, name: str, data_dir, silo_path: str | None):
    """The task settings as this silo's machine sees them: only its own silo, the benchmark folder it
    was given, and its own source read from `silo_path` (its path on this machine) when given."""
    view = task.for_silos([name]).model_copy(update={"data_dir": data_dir})
    source = view.own_source(name)
    if silo_path and source is not None:
        view = view.model_copy(update={"sources": {**view.sources, name: source.model_copy(update={"path": silo_path})}})
    elif silo_path:
        raise ConfigError(f"this SuperNode's silo-path {silo_path!r} is for an own silo, but {name} is a benchmark "
                          "silo of this run (its files come from data-dir)")
    return view


def _warn_here(message: str) -> None:
    """A silo's data warnings go to its own log (the SuperNode's), where its operator reads them."""
    print(f"fedsilo: warning: {message}", file=sys.stderr, flush=True)


def silo_for(message: Message, context: Context) -> Silo:
    """Build (once per process) this silo's task, model and client from the run's config."""
    from fedsilo.recipe import build_client, build_model, build_task

    conf = message.content["config"]
    text = str(conf["config"])
    cfg = validate(tomllib.loads(text), "config from the ServerApp")
    name = silo_name(cfg, context.node_config)
    data_dir = context.node_config.get("data-dir", cfg.task.data_dir)
    root = context.node_config.get("state-dir") or Path(tempfile.gettempdir()) / "fedsilo-flower-state" / name
    policy = context.node_config.get("policy")  # the silo's own rules (fedsilo.client.policy), not the server's
    key = (hashlib.sha256(text.encode()).hexdigest(), str(conf["run-key"]), name, data_dir, str(root), policy)
    if key not in _SILOS:
        if cfg.engine.threads != "auto":  # each silo is a process of its own: the threads are all its own
            torch.set_num_threads(cfg.engine.threads)
        # this machine's view: its own silo, its own files (the SuperNode's silo-path and data-dir)
        own = cfg.model_copy(update={"task": silo_view(cfg.task, name, data_dir, context.node_config.get("silo-path"))})
        model, tokenizer = build_model(own)
        state = Path(root) / str(conf["run-key"])  # the run key is its run id
        check_at_start(own, state, True, _warn_here, silos=[name])  # fingerprints kept on the silo's disk
        task = build_task(own, tokenizer, clients=[name])
        store = DiskStore(state, str(conf["run-key"]))
        client = build_client(cfg, task, model, store, name, task.examples(name, "train"))
        if policy:
            client.policy = read_policy(str(policy))
        _SILOS[key] = Silo(cfg, name, task, client, store)
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
    conf = message.content["config"]
    round_idx = int(conf["round"])
    silo.store.truncate(round_idx - 1)  # state of an unfinished earlier attempt at this round
    silo.store.prune([int(r) for r in conf["keep"]] + [round_idx - 1])
    silo.store.set_round(round_idx)
    try:
        update = silo.client.fit(round_idx, from_arrays(message.content["arrays"]), silo.cfg.seed)
    except SiloRefused as err:  # the silo's own check: no arrays in the reply, only why
        return Message(refusal_to_content(str(err), silo.name, err.final), reply_to=message)
    if update.secure_input is not None:  # masked here, on the silo, with the keys it shared this round
        protocol = _secagg(silo, conf)
        masked = protocol.masked_input(update.secure_input, unpack(message.content["secagg"], "from"))
        _keep_secagg(silo, conf, protocol)
        return Message(masked_to_content(update, masked, silo.name), reply_to=message)
    return Message(update_to_content(update, silo.name), reply_to=message)


# ---- secure aggregation (fedsilo.privacy.secagg): the silo's side of stages 1, 2 and 4 ---------------
# A stage may reach this silo in another process (Flower's simulation reuses workers across nodes), so
# the protocol client is kept between stages in the silo's own state folder and deleted after stage 4.

def _secagg_path(silo: Silo, conf) -> Path:
    return silo.store.root / "secagg" / f"round-{int(conf['round'])}.json"


def _secagg(silo: Silo, conf):
    from fedsilo.privacy.secagg import SecAggClient
    path = _secagg_path(silo, conf)
    if not path.is_file():
        raise ConfigError(f"secure aggregation: {silo.name} holds no keys of round {int(conf['round'])} "
                          "(its stage-1 state is gone)")
    return SecAggClient.from_state(path.read_bytes())


def _keep_secagg(silo: Silo, conf, protocol) -> None:
    path = _secagg_path(silo, conf)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the secagg folder itself 0700: its owner only
    atomic_write_bytes(path, protocol.to_state())


@app.query("secagg_keys")
def secagg_keys(message: Message, context: Context) -> Message:
    from fedsilo.engines.secure import protocol_settings
    from fedsilo.privacy.secagg import SecAggClient
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = SecAggClient(silo.name, list(conf["silos"]), protocol_settings(silo.cfg.federation.secure_aggregation),
                            str(conf["protocol-round"]))
    for stale in _secagg_path(silo, conf).parent.glob("round-*.json"):  # keys of rounds this silo dropped out of
        stale.unlink(missing_ok=True)
    _keep_secagg(silo, conf, protocol)
    return Message(RecordDict({"secagg": ConfigRecord(protocol.advertise_keys())}), reply_to=message)


@app.query("secagg_share")
def secagg_share(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = _secagg(silo, conf)
    packets = protocol.share_keys(unpack_keys(message.content["secagg"]))
    _keep_secagg(silo, conf, protocol)
    return Message(RecordDict({"secagg": pack(packets, "to")}), reply_to=message)


@app.query("secagg_unmask")
def secagg_unmask(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = _secagg(silo, conf)
    shares = protocol.unmask(list(conf["survivors"]), list(conf["dropped"]))
    _secagg_path(silo, conf).unlink(missing_ok=True)  # the round's keys are of no further use
    return Message(RecordDict({"secagg": pack_shares(shares)}), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    silo.store.set_round(int(conf["state-round"]))
    silo.client.load_for_eval(from_arrays(message.content["arrays"]))
    model = silo.client.model
    with autocast(silo.client.precision, next(model.parameters()).device):
        rows = silo.task.evaluate(model, silo.name, str(conf["split"]), final=bool(conf["final"]))
    return Message(RecordDict({"rows": rows_to_record(rows), "silo": ConfigRecord({"name": silo.name})}),
                   reply_to=message)
