"""A scripted lying coordinator: it sends the real Flower ClientApp (fedsilo.engines.flower.client_app)
hand-made messages in any order, with any config, as a hostile ServerApp could. No network: each
message goes straight to the ClientApp as the SuperNode would hand it over; the silo's state, keys and
ledger live in its own folder (the node config's state-dir) exactly as on a real SuperNode."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsilo.config import to_toml, validate
from fedsilo.engines.flower import client_app
from fedsilo.engines.flower.codec import content_to_update, from_arrays, refusal_in, to_arrays

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"


def toy_raw(**sections) -> dict:
    """A small toyrank run (3 silos: alpha, beta, gamma; seconds per round) as a raw config."""
    from tests.test_plugins import PLUGINS
    cfg = {
        "plugins": PLUGINS, "name": "hostile", "seed": 5,
        "task": {"name": "toyrank", "n_train": 8, "n_eval": 4},
        "model": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2},
        "client": {"epochs": 1, "lr": 1e-3, "batch_size": 4, "optimizer": "adamw", "logging_steps": 1},
        "federation": {"rounds": 3, "weighting": "equal"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


class ScriptedServer:
    """One silo's ClientApp driven by a coordinator that may lie. `node_config` is what the silo's
    operator set on its SuperNode (silo, state-dir, policy, ...): the server cannot change it."""

    def __init__(self, raw: dict, silo: str, state_dir: Path, run_key: str = "run-1", **node_config) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
        self.raw, self.silo, self.run_key = raw, silo, run_key
        self.node_config = {"silo": silo, "state-dir": str(state_dir), **node_config}
        self.context = Context(run_id=1, node_id=1, node_config=self.node_config, state=RecordDict(), run_config={})
        self.sent: list[dict] = []  # every update that left the silo (its tensors and reported numbers)

    def config_text(self, **override) -> str:
        raw = self.raw
        for key, value in override.items():
            raw = {**raw, key: {**raw.get(key, {}), **value} if isinstance(value, dict) else value}
        return to_toml(validate(raw))

    def config(self, run_key: str | None = None, override: dict | None = None, **extra) -> ConfigRecord:
        return ConfigRecord({"config": self.config_text(**(override or {})), "run-key": run_key or self.run_key,
                             **extra})

    def send(self, message_type: str, config: ConfigRecord, **records) -> Message:
        msg = Message(RecordDict({"config": config, **records}), dst_node_id=1, message_type=message_type)
        return client_app.app(msg, self.context)

    def global_params(self) -> dict[str, torch.Tensor]:
        """What an honest server would send in round 1: the silo's own initial shared tensors."""
        from fedsilo.recipe import build_model
        from fedsilo.client.silo import federated_parameters
        model, _ = build_model(validate(self.raw))
        return {k: p.detach().clone() for k, p in federated_parameters(model).items()}

    def train(self, round_idx: int, params: dict | None = None, keep=(), run_key: str | None = None,
              override: dict | None = None, **records):
        """A `train` message; returns (the update that left, or None) and the refusal (reason, final) or None."""
        params = self.global_params() if params is None else params
        reply = self.send("train", self.config(run_key, override, round=round_idx, keep=list(keep)),
                          arrays=to_arrays(params), **records)
        if reply.has_error():
            raise RuntimeError(f"the ClientApp failed: {reply.error.reason}")
        refused = refusal_in(reply.content)
        if refused is not None:
            return None, refused
        update = content_to_update(reply.content) if "arrays" in reply.content else reply.content
        self.sent.append({"round": round_idx, "update": update})
        return update, None

    def query(self, action: str, run_key: str | None = None, override: dict | None = None, records=None, **config):
        """A query; the stage-1 key request names, unless told otherwise, the digest of the model an honest
        server sends next (`global_params`): the model the silo commits to."""
        if action == "secagg_keys" and "model-digest" not in config:
            config["model-digest"] = self.model_digest()
        config = {k: v for k, v in config.items() if v is not None}
        return self.send(f"query.{action}", self.config(run_key, override, **config), **(records or {}))

    def model_digest(self, params: dict | None = None) -> str:
        """sha256 of a model as the silo reads it from a train message (fedsilo.privacy.ledger.received_digest)."""
        from fedsilo.privacy.ledger import received_digest
        return received_digest(from_arrays(to_arrays(self.global_params() if params is None else params)))

    def seen_by_server(self, message_type: str, records=None, **config) -> str:
        """Everything the coordinator receives for one message, as text: the reply's records, or, when
        the ClientApp raises, the error reason Flower makes of it ("<class 'X'>:<'message'>", as
        flwr.supernode.runtime.run_clientapp does)."""
        try:
            reply = self.send(message_type, self.config(**config), **(records or {}))
        except Exception as ex:  # noqa: BLE001 - what Flower would send back instead of a reply
            return str(type(ex)) + ":<'" + str(ex) + "'>"
        return reply.error.reason if reply.has_error() else repr(reply.content)


__all__ = ["ScriptedServer", "toy_raw", "from_arrays"]
