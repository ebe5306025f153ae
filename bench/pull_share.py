"""How much each exchange of the Dynamic Pulling study sends, measured on tiny runs: the parameters
uploaded per round (and downloaded) as a share of FedAvg's, from each run's rounds.jsonl.

The runs use the study's configs (experiments/nmt/) and model, from a fresh model instead of the
generic engine, with a few steps per round on a subsample: the shares depend on the model's tensor
sizes and on which tensors move, not on how long it trained. The paper: DP_l and DP_g send half the
parameters up (§5.4), random as many as DP_l, the 33% variants and Controllers a third both ways.

    python bench/pull_share.py [--rounds 2] [--out runs/pull-share]
"""
from __future__ import annotations

import argparse
import json
import platform
import tomllib
from datetime import date
from pathlib import Path

from fedsilo.config import apply_overrides, validate
from fedsilo.runs.runner import run_experiment
from fedsilo.runs.tables import markdown_table

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments" / "nmt"
METHODS = ["fedavg", "dp_l", "dp_g", "random", "dp_l-count", "dp_l-33", "dp_g-33", "controllers", "controllers-8e8d"]
TINY = ["task.max_train=64", "task.max_eval=8", "client.steps=3", "federation.eval_every=1000"]


def tiny_config(method: str, rounds: int):
    raw = tomllib.loads((EXPERIMENTS / f"{method}.toml").read_text())
    raw["model"].pop("init_from", None)  # a fresh model: the generic engine is not needed to count
    raw = apply_overrides(raw, [*TINY, f"federation.rounds={rounds}", f"name=pull-share-{method}"])
    return validate(raw, f"{method}.toml (tiny)")


def shares(out: Path, rounds: int) -> dict[str, list[dict]]:
    records = {}
    for method in METHODS:
        run = out / method
        if not (run / "results.json").is_file():
            print(f"[pull share] {method}", flush=True)
            run_experiment(tiny_config(method, rounds), run, resume=run.exists(), show_progress=False)
        records[method] = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line]
    return records


def table(records: dict[str, list[dict]]) -> list[list[str]]:
    full = records["fedavg"]
    rows = [["method", *(f"round {r['round']}: up / down" for r in full), "up, per round (parameters)"]]
    for method, rounds in records.items():
        cells = [f"{r['params_up'] / f['params_up']:.1%} / {r['params_down'] / f['params_down']:.1%}"
                 for r, f in zip(rounds, full)]
        rows.append([method, *cells, " · ".join(f"{r['params_up']:,}" for r in rounds)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/pull-share"))
    args = ap.parse_args()
    rows = table(shares(args.out, args.rounds))
    print(f"Parameters sent as a share of FedAvg's (5 clients, summed), {date.today()}, {platform.machine()}:\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
