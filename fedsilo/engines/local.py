"""The in-process engine: one round, clients one after another on one working model."""
from __future__ import annotations

import time

from fedsilo.client.silo import SiloClient
from fedsilo.progress import Progress
from fedsilo.server import Server


def run_round(server: Server, clients: dict[str, SiloClient], sampled: list[str], round_idx: int, seed: int,
              progress: Progress | None = None) -> dict:
    """Send, train, receive, aggregate. Returns the round record (without evaluation)."""
    start = time.perf_counter()
    server.begin_round()
    for name in sampled:
        client = clients[name]
        if progress:
            progress.begin(f"round {round_idx} · {name}", client.planned_steps())
        update = client.fit(round_idx, server.payload(), seed, on_step=progress.advance if progress else None)
        reason = server.receive(name, update)
        if reason and progress:
            progress.log(f"[yellow]round {round_idx}: rejected {name}: {reason}")
    record = server.end_round()
    record.update(round=round_idx, sampled=sampled, missing=[])
    record["bytes_up"] = sum(c["bytes_up"] for c in record["clients"].values())
    record["bytes_down"] = sum(c["bytes_down"] for c in record["clients"].values())
    record["seconds"] = time.perf_counter() - start
    return record
