"""fedsilo values ⇄ Flower records. Only tensors and numbers cross the wire, never client text."""
from __future__ import annotations

import json

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsilo.core.tensors import Tensors
from fedsilo.server import ClientUpdate


def to_arrays(tensors: Tensors) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().contiguous().cpu().numpy()) for k, v in tensors.items()})


def from_arrays(record: ArrayRecord) -> Tensors:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


def carried_bytes(record: ArrayRecord) -> int:
    """Serialised array bytes Flower carries for this record (what really goes over the wire)."""
    return sum(len(a.data) for a in record.values())


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def update_to_content(update: ClientUpdate, silo: str) -> RecordDict:
    steps, values = zip(*update.losses) if update.losses else ((), ())
    return RecordDict({
        "arrays": to_arrays(update.tensors),
        "metrics": MetricRecord({
            "n_examples": update.n_examples, "steps": update.steps, "seconds": update.seconds,
            "loss_steps": [int(s) for s in steps], "loss_values": [float(v) for v in values],
            **{f"stat:{k}": _num(v) for k, v in update.stats.items()},
        }),
        "silo": ConfigRecord({"name": silo}),
    })


def content_to_update(content: RecordDict) -> ClientUpdate:
    m = content["metrics"]
    return ClientUpdate(
        tensors=from_arrays(content["arrays"]), n_examples=int(m["n_examples"]),
        stats={k[5:]: float(v) for k, v in m.items() if k.startswith("stat:")},
        steps=int(m["steps"]),
        losses=list(zip((int(s) for s in m["loss_steps"]), (float(v) for v in m["loss_values"]))),
        seconds=float(m["seconds"]),
    )


def rows_to_record(rows: list[dict]) -> ConfigRecord:
    """Evaluation rows (client, task, numeric statistics) — names and numbers only."""
    for row in rows:
        for key, value in row["stats"].items():
            if not isinstance(value, (int, float, list)):
                raise TypeError(f"evaluation statistic {key!r} is not a number")
    return ConfigRecord({"rows": json.dumps(rows)})


def record_to_rows(record: ConfigRecord) -> list[dict]:
    return json.loads(str(record["rows"]))
