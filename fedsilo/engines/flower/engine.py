"""The Flower engine: a round's payloads to the silos' SuperNodes and their updates back, over a
Flower Grid (simulation or deployment alike). The ServerApp that drives it is fedsilo.runs.flower.

The server never opens client data: it learns each silo's name and size from the silos themselves
(a `describe` query).
"""
from __future__ import annotations

import time

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedsilo.config import RunConfig, to_toml
from fedsilo.errors import ConfigError, RunFailed
from fedsilo.progress import Progress
from fedsilo.server import Server

from .codec import (MalformedReply, carried_bytes, content_to_rows, content_to_update, count, refusal_in,
                    to_arrays)


class FlowerEngine:
    """train_round / evaluate over a Flower Grid (simulation or deployment alike)."""

    def __init__(self, grid: Grid, cfg: RunConfig, run_key: str) -> None:
        if not cfg.participation.federates:
            raise ConfigError(f"paradigm {cfg.paradigm!r} runs on the in-process engine only")
        self.grid, self.cfg, self.run_key = grid, cfg, run_key
        self.config_text = to_toml(cfg)
        self.nodes = self._discover()

    def _config(self, **extra) -> ConfigRecord:
        return ConfigRecord({"config": self.config_text, "run-key": self.run_key, **extra})

    def _discover(self) -> dict[str, int]:
        """silo name → node id, asking every connected SuperNode which silo it holds."""
        want, deadline = len(self.client_names), time.monotonic() + self.cfg.flower.connect_timeout
        while len(node_ids := list(self.grid.get_node_ids())) < want:
            if time.monotonic() > deadline:
                raise ConfigError(f"only {len(node_ids)} of {want} SuperNodes connected within "
                                  f"{self.cfg.flower.connect_timeout}s")
            time.sleep(0.5)
        msgs = [Message(RecordDict({"config": self._config()}), dst_node_id=n, message_type="query.describe")
                for n in node_ids]
        nodes, self.client_sizes = {}, {}
        for reply in self.grid.send_and_receive(msgs, timeout=self.cfg.flower.connect_timeout):
            if reply.has_error():
                raise ConfigError(f"SuperNode {reply.metadata.src_node_id} failed to start: {reply.error.reason}")
            try:
                name = str(reply.content["silo"]["name"])
                size = count(reply.content["metrics"]["n_examples"])
            except (KeyError, TypeError, MalformedReply) as err:
                raise ConfigError(f"SuperNode {reply.metadata.src_node_id} described its silo wrongly: {err}") from None
            nodes[name] = reply.metadata.src_node_id
            self.client_sizes[name] = size
        missing = [s for s in self.client_names if s not in nodes]
        if missing:
            raise ConfigError(f"no SuperNode holds silo(s) {missing}")
        return nodes

    @property
    def client_names(self) -> list[str]:
        return self.cfg.task.client_names()

    def _exchange(self, silos: list[str], message_type: str, contents: dict[str, RecordDict], group: str):
        """Send to the silos' nodes (with retries); returns ({silo: reply}, {silo: why missing})."""
        replies, missing = {}, {}
        pending = list(silos)
        for _ in range(1 + self.cfg.flower.retries):
            msgs = [Message(contents[s], dst_node_id=self.nodes[s], message_type=message_type, group_id=group)
                    for s in pending]
            # Replies are matched by message id: for a lost node the SuperLink itself answers with an error.
            waiting = dict(zip(self.grid.push_messages(msgs), pending))
            timeout = self.cfg.flower.round_timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            while waiting and (deadline is None or time.monotonic() < deadline):
                for reply in self.grid.pull_messages(list(waiting)):
                    silo = waiting.pop(reply.metadata.reply_to_message_id, None)
                    if silo is None:
                        continue
                    if reply.has_error():
                        missing[silo] = f"error: {reply.error.reason}"
                    else:
                        replies[silo] = reply
                        missing.pop(silo, None)
                if waiting:
                    time.sleep(0.1)
            for silo in waiting.values():
                missing.setdefault(silo, f"no reply within {timeout}s")
            pending = [s for s in pending if s not in replies]
            if not pending:
                break
        return replies, missing

    def train_round(self, server: Server, sampled: list[str], round_idx: int, progress: Progress | None) -> dict:
        start = time.perf_counter()
        server.begin_round(round_idx)
        if progress:
            progress.begin(f"round {round_idx} · {len(sampled)} silos over Flower", len(sampled))
        config = self._config(round=round_idx, keep=list(self.keep))
        contents, sent = {}, {}
        for silo in sampled:  # each client its own payload (download policies differ per client)
            sent[silo] = to_arrays(server.payload(silo))
            contents[silo] = RecordDict({"arrays": sent[silo], "config": config})
        replies, missing = self._exchange(sampled, "train", contents, str(round_idx))
        flower_bytes = {}
        for silo in sampled:
            if silo in replies:
                reply = replies[silo].content
                try:
                    refused = refusal_in(reply)
                    if refused is not None:
                        reason = server.reject(silo, f"refused by the silo: {refused[0]}", key="refused",
                                               final=refused[1])
                    else:
                        reason = server.receive(silo, content_to_update(reply))
                        flower_bytes[silo] = (carried_bytes(reply["arrays"]), carried_bytes(sent[silo]))
                except MalformedReply as err:
                    reason = server.reject(silo, str(err))
                if reason and progress:
                    progress.warn(f"round {round_idx}: rejected {silo}: {reason}")
            if progress:
                progress.advance()
        record = server.end_round()
        for silo, (up, down) in flower_bytes.items():
            record["clients"][silo].update(flower_bytes_up=up, flower_bytes_down=down)
        record.update(round=round_idx, sampled=sampled, missing=sorted(missing), missing_reasons=missing)
        record["seconds"] = time.perf_counter() - start
        if missing and progress:
            progress.warn(f"round {round_idx}: no update from {', '.join(sorted(missing))}")
        return record

    def evaluate(self, server: Server, split: str, progress: Progress | None, final: bool = False) -> list[dict]:
        content = RecordDict({"arrays": to_arrays(server.params),
                              "config": self._config(split=split, final=final, **{"state-round": self.state_round})})
        names = self.client_names
        replies, missing = self._exchange(names, "evaluate", {s: content for s in names}, f"eval-{split}")
        rows = []
        for silo in names:
            if silo in replies:
                try:
                    rows += content_to_rows(replies[silo].content, silo)
                except MalformedReply as err:
                    missing[silo] = f"rejected: {err}"
        if not rows:
            raise RunFailed(f"no silo answered the {split} evaluation: {missing}")
        if missing and progress:
            without = "; ".join(f"{s} ({why})" for s, why in sorted(missing.items()))
            progress.warn(f"{split} evaluation without {without}")
        return rows

    # Client state lives in stores on the silos' disks; the server tells them which round's state
    # to use (evaluation) and which rounds a checkpoint still refers to (they prune the rest).
    state_round = 0
    keep: tuple[int, ...] = ()

    def set_round(self, round_idx: int) -> None:
        self.state_round = round_idx

    def truncate(self, last_round: int) -> None:
        """Silos drop state newer than the round a train message continues from."""
        self.state_round = last_round

    def after_checkpoint(self, keep: list[int]) -> None:
        self.keep = tuple(keep)

    def state_dict(self) -> dict:
        return {"store": {"kind": "flower", "round": self.state_round}}

    def load_state_dict(self, state: dict) -> None:
        self.state_round = int(state["store"]["round"])
