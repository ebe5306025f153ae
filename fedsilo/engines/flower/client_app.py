"""The Flower ClientApp: one silo. It reads only its own data (the SuperNode's node config names
it), trains with fedsilo's SiloClient, and keeps its state in a client store on the silo's own disk,
so a message that reaches a fresh process continues where the last one stopped."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import tomllib
import traceback
from contextlib import contextmanager
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
from fedsilo.errors import DataError, FedsiloError, UnknownChoice
from fedsilo.models.precision import autocast
from fedsilo.privacy.ledger import LEDGER_FILE, received_digest
from fedsilo.rundir.datacheck import check_at_start
from fedsilo.sources.confine import confine, silo_folder
from fedsilo.tasks.base import evaluate_rows

from fedsilo.fileio import atomic_write_bytes, regular_file

from .codec import (from_arrays, masked_to_content, pack, pack_shares, refusal_to_content, rows_to_record, unpack,
                    unpack_keys, update_to_content)


class SiloFailed(FedsiloError, RuntimeError):
    """What the coordinator learns of a silo's failure: where and what kind, never the silo's data."""


def content_free(message: Message, context: Context, call_next) -> Message:
    """Every handler's exception becomes the coordinator's `reply.error.reason` (Flower sends its
    text), so the silo logs the full message here, on its own stderr, and lets out only what cannot
    quote its data: config and policy errors (built from the run's config and the silo's own rules),
    a data error's `public` form (file:line and counts), else the error's kind alone."""
    try:
        return call_next(message, context)
    except (ConfigError, UnknownChoice, SiloRefused):
        raise
    except Exception as err:  # noqa: BLE001 - everything else may quote a row, a header, a file
        silo = context.node_config.get("silo", context.node_config.get("partition-id", "?"))
        print(f"fedsilo: error on silo {silo}: {type(err).__name__}: {err}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        kind = "DataError" if isinstance(err, DataError) else type(err).__name__
        public = getattr(err, "public", None)
        told = f"{kind}: {public.removeprefix(f'silo {silo}: ')}" if isinstance(public, str) else \
            f"{kind} (its message stays in the silo's own log: it may quote the silo's data)"
        raise SiloFailed(f"silo {silo}: {told}") from None


app = ClientApp(mods=[content_free])


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


def silo_view(task, name: str, data_dir, silo_path: str | None, deployed: bool = True):
    """The task settings as this silo's machine sees them: only its own silo, the benchmark folder it
    was given, and its own source read from `silo_path` (its path on this machine). Every file the
    coordinator's config names for it must lie in that folder (fedsilo.sources.confine), checked
    before any is opened; a SuperNode of its own (`deployed`) without silo-path reads no own files
    (a simulation's virtual nodes, one operator's processes, read the config's own paths)."""
    view = task.for_silos([name]).model_copy(update={"data_dir": data_dir})
    source = view.own_source(name)
    if silo_path and source is not None:
        source = source.model_copy(update={"path": silo_path})
        confine(name, source, silo_folder(silo_path), "its silo-path")
        view = view.model_copy(update={"sources": {**view.sources, name: source}})
    elif silo_path:
        raise ConfigError(f"this SuperNode's silo-path {silo_path!r} is for an own silo, but {name} is a benchmark "
                          "silo of this run (its files come from data-dir)")
    elif source is not None and deployed:
        raise ConfigError(f"silo {name} is an own silo, but this SuperNode has no silo-path: a silo reads only the "
                          "folder its operator names (--node-config 'silo-path=\"/its/folder\"'), never a path the "
                          "coordinator sends")
    return view


def _warn_here(message: str) -> None:
    """A silo's data warnings go to its own log (the SuperNode's), where its operator reads them."""
    print(f"fedsilo: warning: {message}", file=sys.stderr, flush=True)


SIMULATION = "FEDSILO_FLOWER_SIMULATION"  # "1" in fedsilo's own Flower simulation (fedsilo.runs.flower), whose
# Ray workers inherit it from the process that runs every silo: the environment is the operator's, no message sets it
SECRET_FILE = "silo-secret"


def in_simulation() -> bool:
    return os.environ.get(SIMULATION) == "1"


def ledger_path(node_config: dict, root: Path, run_key: str) -> Path | None:
    """The silo's privacy ledger (fedsilo.privacy.ledger): its node config's `ledger`, else beside its
    state (`silo` or `state-dir` set), outside every run key's folder, so a new run key adds to it.
    fedsilo's own simulation gives its virtual nodes neither: one operator runs every silo there, and
    the ledger is the run's. A SuperNode configured otherwise (Flower's examples' `partition-id` alone)
    names no place (None): a silo that keeps a ledger is refused there, as a ledger kept per run key
    would let every new run spend the budget again."""
    if "ledger" in node_config:
        return Path(str(node_config["ledger"]))
    if "silo" in node_config or "state-dir" in node_config:
        return root / LEDGER_FILE
    if in_simulation():
        return root / run_key / LEDGER_FILE
    return None


def silo_secret(node_config: dict, root: Path) -> bytes | None:
    """32 random bytes in the silo's state folder (0600), made once and never sent: under secure aggregation
    they enter its data order and dropout, so that what the server sends does not decide the silo's input
    (fedsilo.client.silo.secret_seed). None in fedsilo's simulation (one operator) and where the operator
    opts out by name (`secret-randomness=false`: runs that must equal an in-process run's numbers)."""
    if in_simulation() or not node_flag(node_config, "secret-randomness", True):
        return None
    path = Path(root) / SECRET_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = regular_file(path, "the silo's secret", ConfigError).read_bytes()
        if len(secret) != 32:
            raise ConfigError(f"{path}: the silo's secret is {len(secret)} bytes, not 32 (remove it: a new one is "
                              "made)") from None
        return secret
    secret = os.urandom(32)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
        fh.flush()
        os.fsync(fh.fileno())
    return secret


NODE_FILES = ("roster", "signing-key", "policy")  # files the operator names in the node config, read on the silo


def check_node_paths(node_config: dict) -> None:
    """Refuse by its node config key, before the silo opens anything, a file its operator named that is not
    a regular file (a FIFO would block the silo for ever), a ledger that is there but is not one, and a
    state-dir that is not a folder."""
    named = [key for key in NODE_FILES if key in node_config]
    if "ledger" in node_config and os.path.lexists(str(node_config["ledger"])):  # made by its first release
        named.append("ledger")
    for key in named:
        regular_file(str(node_config[key]), f"this SuperNode's node config {key}", ConfigError)
    state = node_config.get("state-dir")
    if state and os.path.lexists(str(state)) and not Path(str(state)).is_dir():
        raise ConfigError(f"this SuperNode's node config state-dir: {state} is not a folder")


def node_flag(node_config: dict, key: str, default: bool) -> bool:
    """A yes/no of the operator's node config: TOML's true/false, or the strings "true"/"false"."""
    value = node_config.get(key, default)
    if str(value).lower() not in ("true", "false"):
        raise ConfigError(f"this SuperNode's node config {key} = {value!r}: must be true or false")
    return str(value).lower() == "true"


def silo_for(message: Message, context: Context) -> Silo:
    """Build (once per process) this silo's task, model and client from the run's config."""
    from fedsilo.recipe import build_client, build_model, build_task, give_ledger

    conf = message.content["config"]
    text = str(conf["config"])
    cfg = validate(tomllib.loads(text), "config from the ServerApp")
    node = context.node_config
    check_node_paths(node)
    name = silo_name(cfg, node)
    data_dir = node.get("data-dir", cfg.task.data_dir)
    root = node.get("state-dir") or Path(tempfile.gettempdir()) / "fedsilo-flower-state" / name
    policy = node.get("policy")  # the silo's own rules (fedsilo.client.policy), not the server's
    ledger = ledger_path(node, Path(root), str(conf["run-key"]))
    scope = node.get("ledger-scope")
    key = (hashlib.sha256(text.encode()).hexdigest(), str(conf["run-key"]), name, data_dir, str(root), policy,
           str(ledger), scope, in_simulation())
    if key not in _SILOS:
        if cfg.engine.threads != "auto":  # each silo is a process of its own: the threads are all its own
            torch.set_num_threads(cfg.engine.threads)
        # this machine's view: its own silo, its own files (the SuperNode's silo-path and data-dir)
        own = cfg.model_copy(update={"task": silo_view(cfg.task, name, data_dir, node.get("silo-path"),
                                                       deployed="silo" in node)})
        model, tokenizer = build_model(own)
        state = Path(root) / str(conf["run-key"])  # the run key is its run id
        checks = check_at_start(own, state, True, _warn_here, silos=[name])  # fingerprints kept on the silo's disk
        task = build_task(own, tokenizer, clients=[name])
        store = DiskStore(state, str(conf["run-key"]))
        client = build_client(cfg, task, model, store, name, task.examples(name, "train"))
        if policy:
            client.policy = read_policy(str(policy))
        client.identity = _identity(name, node)  # from the silo's node config, never a message
        client.unmasked_allowed = node_flag(node, "allow-unmasked", False)
        if client.keeps_ledger:
            if ledger is None:
                raise ConfigError(f"silo {name} releases under DP or secure aggregation, but its SuperNode's node "
                                  "config names no place for its privacy ledger: set state-dir (or ledger), e.g. "
                                  "--node-config 'state-dir=\"/var/lib/fedsilo/SILO\"'; a ledger kept per run key "
                                  "would let every new run spend its budget again")
            client.secret = silo_secret(node, Path(root)) if client.mask is not None else None
        give_ledger(client, ledger, str(conf["run-key"]), scope,  # its place the operator's, never a message's
                    files=next((c.files for c in checks if c.name == name), None), one_operator=in_simulation())
        if client.identity is not None and not client.adds_noise:
            _warn_here(f"silo {name} holds a roster but adds no DP noise: secure aggregation hides one round's "
                       "input among the others, not what a server learns across rounds (docs/privacy.md); a policy "
                       "with require_noise = true refuses such rounds")
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
    received = from_arrays(message.content["arrays"])
    try:
        protocol = _committed(silo, conf, received) if silo.client.mask is not None else None
        admitted = silo.client.admit(round_idx, received)  # the privacy ledger first: a refused replay truncates nothing
        silo.store.truncate(round_idx - 1)  # state of an unfinished earlier attempt at this round
        silo.store.prune([int(r) for r in conf["keep"]] + [round_idx - 1])
        silo.store.set_round(round_idx)
        update = silo.client.fit(round_idx, received, silo.cfg.seed, admitted=admitted)
    except SiloRefused as err:  # the silo's own check: no arrays in the reply, only why
        return Message(refusal_to_content(str(err), silo.name, err.final), reply_to=message)
    if update.secure_input is not None:  # masked here, on the silo, with the keys it shared this round
        masked = protocol.masked_input(update.secure_input, unpack(message.content["secagg"], "from"))
        _keep_secagg(silo, conf, protocol)
        return Message(masked_to_content(update, masked, silo.name), reply_to=message)
    return Message(update_to_content(update, silo.name), reply_to=message)


# ---- secure aggregation (fedsilo.privacy.secagg): the silo's side of stages 1, 2, 4 and 5 ------------
# A stage may reach this silo in another process (Flower's simulation reuses workers across nodes), so
# the protocol client is kept between stages in the silo's own state folder and deleted after stage 5.
# The silo's identity (signing key and roster) comes from its SuperNode's node config, never from a
# message: `roster="FILE"` and `signing-key="FILE"` (fedsilo.privacy.roster; `fedsilo keys`).

def _identity(name: str, node_config: dict):
    """This silo's signing key and roster, or None when its operator set neither (semi-honest only)."""
    from fedsilo.privacy.roster import load_identity
    roster, key = node_config.get("roster"), node_config.get("signing-key")
    if roster is None and key is None:
        return None
    if roster is None or key is None:
        raise ConfigError("this SuperNode's node config sets only one of roster and signing-key; a silo's "
                          "identity needs both (e.g. --node-config 'roster=\"roster.toml\" signing-key=\"silo.key\"')")
    return load_identity(name, str(key), str(roster))


@contextmanager
def _refusing():
    """A protocol check that fails is this silo's refusal, said in full to the coordinator (it names silos,
    stages and rounds, never the silo's data), before anything of the stage leaves."""
    try:
        yield
    except (ValueError, RuntimeError) as err:
        raise SiloRefused(str(err)) from None


def _secagg_path(silo: Silo, conf) -> Path:
    return silo.store.root / "secagg" / f"round-{int(conf['round'])}.json"


def _secagg(silo: Silo, conf):
    from fedsilo.privacy.secagg import SecAggClient
    path = _secagg_path(silo, conf)
    if not path.is_file():
        raise ConfigError(f"secure aggregation: {silo.name} holds no keys of round {int(conf['round'])} "
                          "(its stage-1 state is gone)")
    return SecAggClient.from_state(path.read_bytes(), silo.client.identity)


def _commitment(silo: Silo, conf, model_digest: str) -> bytes:
    """The round commitment (fedsilo.privacy.secagg_parts.round_commitment) of this message: its run key and
    round, the model it sends (sha256) and the training config as this silo resolved it."""
    from fedsilo.privacy.secagg_parts import round_commitment
    resolved = hashlib.sha256(silo.cfg.model_dump_json().encode()).hexdigest()
    return round_commitment(str(conf["run-key"]), int(conf["round"]), model_digest, resolved)


def _committed(silo: Silo, conf, received) -> object:
    """The round's protocol client, once the train message is what this silo committed to at stage 1 (and
    every peer with it, checked at stage 2); SiloRefused before anything is trained otherwise."""
    protocol = _secagg(silo, conf)
    if protocol.commitment != _commitment(silo, conf, received_digest(received)):
        raise SiloRefused(f"secure aggregation: round {int(conf['round'])} asks {silo.name} to train from another "
                          "model or training config than the one it committed to at stage 1 (as did every peer); "
                          "it trains and masks nothing")
    return protocol


def _keep_secagg(silo: Silo, conf, protocol) -> None:
    path = _secagg_path(silo, conf)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the secagg folder itself 0700: its owner only
    atomic_write_bytes(path, protocol.to_state())


def _claim(silo: Silo, conf, stage: str, what: bytes) -> None:
    """Answer-once, atomically: the first request of a stage creates the stage's claim file (O_EXCL), and
    any other request of that stage, however close in time, finds it there and is refused."""
    path = _secagg_path(silo, conf).with_suffix(f".{stage}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"secure aggregation: {silo.name} already answered the {stage} request of round "
                         f"{int(conf['round'])}; it answers it once") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(what)


@app.query("secagg_keys")
def secagg_keys(message: Message, context: Context) -> Message:
    from fedsilo.engines.secure import protocol_settings
    from fedsilo.privacy.secagg import SecAggClient
    silo = silo_for(message, context)
    conf = message.content["config"]
    secure, identity = silo.cfg.federation.secure_aggregation, silo.client.identity
    if secure.roster_fingerprint is not None and (identity is None or
                                                  identity.roster.fingerprint() != secure.roster_fingerprint):
        held = "no roster (node config roster, signing-key)" if identity is None else identity.roster.fingerprint()
        raise SiloRefused(f"secure aggregation: the run expects roster {secure.roster_fingerprint}; {silo.name} "
                          f"holds {held}")
    if "model-digest" not in conf:
        raise SiloRefused(f"secure aggregation: the stage-1 request names no model digest; {silo.name} commits to "
                          "the model it will train from before it shares any key")
    with _refusing():
        protocol = SecAggClient(silo.name, list(conf["silos"]), protocol_settings(secure),
                                str(conf["protocol-round"]), identity,
                                _commitment(silo, conf, str(conf["model-digest"])))
    for stale in _secagg_path(silo, conf).parent.glob("round-*.*"):  # keys and claims of rounds it dropped out of
        stale.unlink(missing_ok=True)
    _keep_secagg(silo, conf, protocol)
    return Message(RecordDict({"secagg": ConfigRecord(protocol.advertise_keys())}), reply_to=message)


@app.query("secagg_share")
def secagg_share(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = _secagg(silo, conf)
    with _refusing():
        packets = protocol.share_keys(unpack_keys(message.content["secagg"]))
    _keep_secagg(silo, conf, protocol)
    return Message(RecordDict({"secagg": pack(packets, "to")}), reply_to=message)


@app.query("secagg_check")
def secagg_check(message: Message, context: Context) -> Message:
    """The consistency round: sign the survivor set, once, if it fits this silo's own view."""
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = _secagg(silo, conf)
    with _refusing():
        signed = protocol.consistency(list(conf["survivors"]))
        _claim(silo, conf, "consistency", json.dumps(list(conf["survivors"])).encode())
    _keep_secagg(silo, conf, protocol)
    return Message(RecordDict({"secagg": ConfigRecord(signed)}), reply_to=message)


@app.query("secagg_unmask")
def secagg_unmask(message: Message, context: Context) -> Message:
    silo = silo_for(message, context)
    conf = message.content["config"]
    protocol = _secagg(silo, conf)
    with _refusing():
        shares = protocol.unmask(unpack(message.content["secagg"], "sig"))
        _claim(silo, conf, "unmask", b"")
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
        rows = evaluate_rows(silo.task, model, silo.name, str(conf["split"]), final=bool(conf["final"]))
    return Message(RecordDict({"rows": rows_to_record(rows), "silo": ConfigRecord({"name": silo.name})}),
                   reply_to=message)
