"""The Flower engine: a round's payloads to the silos' SuperNodes and their updates back, over a
Flower Grid (simulation or deployment alike). The ServerApp that drives it is fedsilo.runs.flower.

The server never opens client data: it learns each silo's name and size from the silos themselves
(a `describe` query).
"""
from __future__ import annotations

import time
import warnings

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedsilo.config import RunConfig, to_toml
from fedsilo.errors import ConfigError, ConfigWarning, RunFailed
from fedsilo.progress import Progress
from fedsilo.server import Server

from fedsilo.engines.secure import SEMI_HONEST, guarantee, protocol_settings
from fedsilo.privacy.ledger import received_digest
from fedsilo.privacy.secagg import SecAggServer

from .codec import (MalformedReply, carried_bytes, content_to_masked, content_to_rows, content_to_update, count, pack,
                    pack_keys, refusal_in, to_arrays, unpack, unpack_shares)


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
        replies = list(self.grid.send_and_receive(msgs, timeout=self.cfg.flower.connect_timeout))
        for reply in replies:
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
        silent = sorted(set(node_ids) - {r.metadata.src_node_id for r in replies})
        if missing and silent:
            raise ConfigError(f"no SuperNode answered for silo(s) {missing}: SuperNode(s) {silent} sent no description "
                              f"of their silo within flower.connect_timeout ({self.cfg.flower.connect_timeout}s)")
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
        if self.cfg.federation.secure_aggregation is not None:
            return self._secure_round(server, sampled, round_idx, progress)
        start = time.perf_counter()
        server.begin_round(round_idx, sampled)
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

    def _stage(self, to: list[str], action: str, round_idx: int, records: dict[str, RecordDict] | None = None,
               **config) -> tuple[dict, dict]:
        """One secure-aggregation query to silos `to` ({silo: extra records}); ({silo: reply content}, missing)."""
        conf = self._config(round=round_idx, **config)
        contents = {s: RecordDict({"config": conf, **(records or {}).get(s, {})}) for s in to}
        replies, missing = self._exchange(to, f"query.{action}", contents, f"{round_idx}-{action}")
        return {s: r.content for s, r in replies.items()}, missing

    def _secure_round(self, server: Server, sampled: list[str], round_idx: int, progress: Progress | None) -> dict:
        """SecAgg over Flower messages (fedsilo.privacy.secagg): keys, shared keys, training with the
        masked vector, the consistency round (each survivor signs the survivor set), unmasking; the server
        object is handed only the sum. A silo that answers no stage is left out of the later ones: after
        stage 2 it is a dropout the sum recovers from."""
        start = time.perf_counter()
        server.begin_round(round_idx, sampled)
        if progress:
            progress.begin(f"round {round_idx} · {len(sampled)} silos over Flower, secure aggregation", len(sampled))
        layout = server.secure_layout()
        round_id = f"{self.run_key}/{round_idx}"
        secure = self.cfg.federation.secure_aggregation
        missing: dict[str, str] = {}
        updates: dict[str, object] = {}
        try:
            protocol = SecAggServer(sampled, protocol_settings(secure), layout.length, round_id)
            digest = received_digest(server.payload(sampled[0]))  # every silo is sent the same (download = "all")
            replies, gone = self._stage(sampled, "secagg_keys", round_idx, silos=list(sampled),
                                        **{"protocol-round": round_id, "model-digest": digest})
            missing.update(gone)
            keys = protocol.collect_keys({s: {k: bytes(v) for k, v in c["secagg"].items()} for s, c in replies.items()})
            self._say_guarantee(protocol.signed, progress)
            replies, gone = self._stage(list(keys), "secagg_share", round_idx, {s: {"secagg": pack_keys(keys)} for s in keys})
            missing.update(gone)
            inboxes = protocol.route_packets({s: unpack(c["secagg"], "to") for s, c in replies.items()})
            config = self._config(round=round_idx, keep=list(self.keep))
            contents = {s: RecordDict({"arrays": to_arrays(server.payload(s)), "config": config,
                                       "secagg": pack(inboxes[s], "from")}) for s in inboxes}
            replies, gone = self._exchange(list(inboxes), "train", contents, str(round_idx))
            missing.update(gone)
            masked = {}
            for silo, reply in replies.items():
                refused = refusal_in(reply.content)
                if refused is not None:
                    server.reject(silo, f"refused by the silo: {refused[0]}", key="refused", final=refused[1])
                    continue
                try:
                    updates[silo], masked[silo] = content_to_masked(reply.content)
                except MalformedReply as err:
                    server.reject(silo, str(err))
            survivors = protocol.survivors(masked)
            replies, gone = self._stage(survivors, "secagg_check", round_idx, survivors=survivors)
            missing.update(gone)
            signatures = protocol.unmask_request({s: {"sig": bytes(c["secagg"]["sig"])} for s, c in replies.items()})
            replies, gone = self._stage(list(signatures), "secagg_unmask", round_idx,
                                        {s: {"secagg": pack(signatures, "sig")} for s in signatures})
            missing.update(gone)
            total = protocol.aggregate(masked, {s: unpack_shares(c["secagg"]) for s, c in replies.items()})
            roster = (secure.roster_fingerprint or "the silos' own (no fingerprint in the config)") \
                if protocol.signed else None
            server.receive_sum(total, layout, {s: updates[s] for s in survivors},
                               {"survivors": survivors, "dropped": protocol.dropped, "signed": list(signatures),
                                **guarantee(len(sampled), protocol.threshold, roster)})
        except (ValueError, KeyError, TypeError, MalformedReply) as err:
            server.secure_failed(str(err), updates)
            if progress:
                progress.warn(f"round {round_idx}: secure aggregation failed: {err}")
        record = server.end_round()
        record.update(round=round_idx, sampled=sampled, missing=sorted(missing), missing_reasons=missing)
        record["seconds"] = time.perf_counter() - start
        if missing and progress:
            progress.warn(f"round {round_idx}: no answer from {', '.join(sorted(missing))}")
        return record

    _said_semi_honest = False

    def _say_guarantee(self, signed: bool, progress: Progress | None) -> None:
        """Once per run: a round whose silos did not all sign their keys holds only the semi-honest guarantee."""
        if signed or self._said_semi_honest:
            return
        self._said_semi_honest = True
        if progress:
            progress.warn(SEMI_HONEST)
        else:
            warnings.warn(SEMI_HONEST, ConfigWarning, stacklevel=2)

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
