"""fedsilo values ⇄ Flower records. Only tensors and numbers cross the wire, never text."""
from __future__ import annotations

import math

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


def _num(x: float) -> float:
    return float("nan") if x is None else float(x)


def update_to_content(update: ClientUpdate, silo: str) -> RecordDict:
    steps, values = zip(*update.losses) if update.losses else ((), ())
    return RecordDict({
        "arrays": to_arrays(update.tensors),
        "metrics": MetricRecord({
            "n_examples": update.n_examples, "delta_loss": _num(update.delta_loss),
            "mean_loss": _num(update.mean_loss), "steps": update.steps, "seconds": update.seconds,
            "loss_steps": [int(s) for s in steps], "loss_values": [float(v) for v in values],
        }),
        "silo": ConfigRecord({"name": silo}),
    })


def content_to_update(content: RecordDict) -> ClientUpdate:
    m = content["metrics"]
    return ClientUpdate(
        tensors=from_arrays(content["arrays"]), n_examples=int(m["n_examples"]),
        delta_loss=float(m["delta_loss"]), mean_loss=float(m["mean_loss"]), steps=int(m["steps"]),
        losses=list(zip((int(s) for s in m["loss_steps"]), (float(v) for v in m["loss_values"]))),
        seconds=float(m["seconds"]),
    )


def eval_row_to_metrics(row: dict) -> MetricRecord:
    """A silo's evaluation row (em, correct, n, exec, loss) as numbers; a missing exec is NaN."""
    return MetricRecord({k: float("nan") if row.get(k) is None else float(row[k])
                         for k in ("em", "correct", "n", "exec", "loss")})


def metrics_to_eval_row(m: MetricRecord) -> dict:
    row = {k: float(m[k]) for k in ("em", "loss")}
    row.update(correct=int(m["correct"]), n=int(m["n"]), exec=None if math.isnan(m["exec"]) else float(m["exec"]))
    return row
