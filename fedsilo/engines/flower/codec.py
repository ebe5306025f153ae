"""fedsilo values ⇄ Flower records. Only tensors and numbers cross the wire, never client text."""
from __future__ import annotations

import json
import math
import re

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsilo.core.tensors import Tensors
from fedsilo.core.messages import ClientUpdate


def to_arrays(tensors: Tensors) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().contiguous().cpu().numpy()) for k, v in tensors.items()})


def from_arrays(record: ArrayRecord) -> Tensors:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


def carried_bytes(record: ArrayRecord) -> int:
    """Serialised array bytes Flower carries for this record (what really goes over the wire)."""
    return sum(len(a.data) for a in record.values())


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


_NAMED = {"term": "terms", "personal": "personal_terms", "phase": "phase_seconds",
          "dp": "privacy"}  # wire prefix → field


def update_to_content(update: ClientUpdate, silo: str) -> RecordDict:
    steps, values = zip(*update.losses) if update.losses else ((), ())
    return RecordDict({
        "arrays": to_arrays(update.tensors),
        "metrics": MetricRecord({
            "n_examples": update.n_examples, "steps": update.steps, "seconds": update.seconds,
            "loss_steps": [int(s) for s in steps], "loss_values": [float(v) for v in values],
            "delta_loss": _num(update.delta_loss), "mean_loss": _num(update.mean_loss),
            **({"lr_last": _num(update.lr_last)} if update.lr_last is not None else {}),
            **{f"{prefix}:{k}": _num(v) for prefix, values in _NAMED.items()
               for k, v in getattr(update, values).items()},
        }),
        "silo": ConfigRecord({"name": silo}),
        **({"transforms": ConfigRecord({"records": json.dumps(update.transforms)})} if update.transforms else {}),
    })


def masked_to_content(update: ClientUpdate, masked, silo: str) -> RecordDict:
    """A silo's reply under secure aggregation: its masked vector and the numbers the mask does not hold."""
    content = update_to_content(update, silo)
    content["arrays"] = ArrayRecord({"masked": Array(masked)})
    return content


def content_to_masked(content: RecordDict):
    """(the update's unmasked numbers, its masked uint64 vector); `MalformedReply` when it has none."""
    update = content_to_update(content)
    masked = update.tensors.pop("masked", None)
    if masked is None or update.tensors or masked.dtype != torch.uint64 or masked.dim() != 1:
        raise MalformedReply("the reply holds no masked vector (one uint64 array named 'masked')")
    return update, masked.numpy()


def pack(values: dict[str, bytes], prefix: str) -> ConfigRecord:
    """{name: bytes} as one record, keys '<prefix>:<name>' (silo names may hold any characters)."""
    return ConfigRecord({f"{prefix}:{name}": value for name, value in values.items()})


def unpack(record, prefix: str) -> dict[str, bytes]:
    try:
        return {k[len(prefix) + 1:]: bytes(v) for k, v in record.items() if k.startswith(prefix + ":")}
    except (AttributeError, TypeError) as err:
        raise MalformedReply(f"unreadable secure aggregation record: {err}") from None


def pack_keys(public_keys: dict[str, dict[str, bytes]]) -> ConfigRecord:
    return ConfigRecord({f"{kind}:{name}": key for name, keys in public_keys.items() for kind, key in keys.items()})


def unpack_keys(record) -> dict[str, dict[str, bytes]]:
    """{silo: {c_pk, s_pk and, when it signed its advertisement or committed to its round, sig and commit}}."""
    c, s = unpack(record, "c_pk"), unpack(record, "s_pk")
    extra = {kind: unpack(record, kind) for kind in ("sig", "commit")}
    return {name: {"c_pk": c[name], "s_pk": s[name], **{k: v[name] for k, v in extra.items() if name in v}}
            for name in c if name in s}


def pack_shares(shares: dict) -> ConfigRecord:
    return ConfigRecord({**{f"b:{o}": v for o, v in shares["self_mask_shares"].items()},
                         **{f"s:{o}": v for o, v in shares["mask_key_shares"].items()}})


def unpack_shares(record) -> dict:
    return {"self_mask_shares": unpack(record, "b"), "mask_key_shares": unpack(record, "s")}


def refusal_to_content(reason: str, silo: str, final: bool = False) -> RecordDict:
    """A silo's answer when its own check refused the round: the reason (and whether it refuses every
    later round too), no tensors."""
    return RecordDict({"refused": ConfigRecord({"reason": reason, "final": final}),
                       "silo": ConfigRecord({"name": silo})})


def refusal_in(content: RecordDict) -> tuple[str, bool] | None:
    """(the reason a silo refused the round, whether for good), or None for an update."""
    if "refused" in content and isinstance(content["refused"], ConfigRecord):
        record = content["refused"]
        return str(record.get("reason", "no reason given")), record.get("final") is True
    return None


class MalformedReply(ValueError):
    """A client's reply that cannot be read as an update; the server rejects that client."""


def count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not float(value).is_integer():
        raise MalformedReply(f"n_examples {value!r} is not a count")
    return int(value)


def content_to_update(content: RecordDict) -> ClientUpdate:
    """The update in a train reply; `MalformedReply` names what is missing or wrong."""
    for key, kind in (("arrays", ArrayRecord), ("metrics", MetricRecord)):
        if key not in content or not isinstance(content[key], kind):
            raise MalformedReply(f"the reply has no {key!r} record")
    m = content["metrics"]
    missing = [k for k in ("n_examples", "steps", "seconds", "loss_steps", "loss_values") if k not in m]
    if missing:
        raise MalformedReply(f"the reply's metrics lack {', '.join(missing)}")
    steps, values = list(m["loss_steps"]), list(m["loss_values"])
    if len(steps) != len(values):
        raise MalformedReply("the reply's loss_steps and loss_values differ in length")
    try:
        tensors = from_arrays(content["arrays"])
    except Exception as err:  # noqa: BLE001 - any undecodable array is the same rejection
        raise MalformedReply(f"unreadable arrays: {err}") from None
    try:
        return ClientUpdate(
            tensors=tensors, n_examples=count(m["n_examples"]),
            steps=count(m["steps"]),
            losses=list(zip((int(s) for s in steps), (float(v) for v in values))),
            seconds=float(m["seconds"]),
            delta_loss=float(m.get("delta_loss", math.nan)), mean_loss=float(m.get("mean_loss", math.nan)),
            lr_last=float(m["lr_last"]) if "lr_last" in m else None,
            **{field: {k[len(prefix) + 1:]: float(v) for k, v in m.items() if k.startswith(prefix + ":")}
               for prefix, field in _NAMED.items()},
            transforms=_transforms(content),
        )
    except MalformedReply:
        raise
    except (TypeError, ValueError, OverflowError) as err:
        raise MalformedReply(f"unreadable metrics: {err}") from None


def _transforms(content: RecordDict) -> list[dict]:
    if "transforms" not in content:
        return []
    try:
        records = json.loads(str(content["transforms"]["records"]))
    except (KeyError, TypeError, ValueError) as err:
        raise MalformedReply(f"unreadable transform records: {err}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise MalformedReply("transform records are not a list of tables")
    return records


_ITEM_ID = re.compile(r"[0-9a-f]{16}")  # an item's id is a hash (fedsilo.tasks.base.item_ids), never its text


def rows_to_record(rows: list[dict]) -> ConfigRecord:
    """Evaluation rows (client, task, numeric statistics; the final test's per-item statistics under
    hashed ids) — names, hashes and numbers only."""
    for row in rows:
        for key, value in row["stats"].items():
            if not isinstance(value, (int, float, list)):
                raise TypeError(f"evaluation statistic {key!r} is not a number")
        problem = _items_problem(row["items"]) if "items" in row else None
        if problem:
            raise TypeError(f"evaluation row of {row['client']}: {problem}")
    return ConfigRecord({"rows": json.dumps(rows)})


def _numbers(value) -> bool:
    if isinstance(value, list):
        return all(_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _items_problem(items) -> str | None:
    """What makes a row's `items` more than hashed ids and numbers, or None."""
    if not isinstance(items, dict) or set(items) != {"ids", "stats"} or not isinstance(items["ids"], list) \
            or not isinstance(items["stats"], list):
        return "its items are not {ids, stats} lists"
    if len(items["ids"]) != len(items["stats"]):
        return f"{len(items['ids'])} item ids for {len(items['stats'])} item statistics"
    if not all(isinstance(i, str) and _ITEM_ID.fullmatch(i) for i in items["ids"]):
        return "an item id is not a hash (16 hex digits)"
    if not all(isinstance(s, dict) and all(_numbers(v) for v in s.values()) for s in items["stats"]):
        return "an item statistic is not a number"
    return None


def content_to_rows(content: RecordDict, silo: str) -> list[dict]:
    """The rows of an evaluate reply: this silo's own rows of numeric statistics, else `MalformedReply`
    (a silo cannot report statistics for another)."""
    try:
        rows = json.loads(str(content["rows"]["rows"]))
    except (KeyError, TypeError, ValueError) as err:
        raise MalformedReply(f"unreadable evaluation rows: {err}") from None
    if not isinstance(rows, list):
        raise MalformedReply("the evaluation rows are not a list")
    for row in rows:
        if not isinstance(row, dict) or row.get("client") != silo or not isinstance(row.get("stats"), dict) \
                or not all(_numbers(v) for v in row["stats"].values()):
            raise MalformedReply(f"an evaluation row is not {silo}'s own numeric statistics")
        problem = _items_problem(row["items"]) if "items" in row else None
        if problem:
            raise MalformedReply(f"an evaluation row of {silo}: {problem}")
    return rows
