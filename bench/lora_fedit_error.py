"""How far FedIT's averaged factors are from the average of the silos' updates on a real round: the README's
main job (5 QA silos, MiniLM-L6) with LoRA FedIT (experiments/adapters/qa_lora.toml's lora_fedit), round 1
per seed. Each silo's upload is captured as the server receives it; per adapted layer the round's update
under FedIT, s·(ΣpᵢBᵢ)(ΣpᵢAᵢ) − s·B₀A₀, is compared with the exact Σ pᵢ·s·(BᵢAᵢ − B₀A₀) (p: the round's
recorded weights). The exact policy's own error is fedsilo's float32 rounding (tests/test_lora.py).

    python bench/lora_fedit_error.py [--seeds 0,1,2] [--json bench/results/lora-fedit-error.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path


from variant_cost import base_config, study_variants

from fedsilo.config import apply_overrides, validate
from fedsilo.core.lora import pairs
from fedsilo.runs.runner import run_experiment
from fedsilo.server import Server

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "adapters" / "qa_lora.toml"


def one_round(seed: int, tmp: Path) -> dict[str, float]:
    import tomllib

    base = base_config(STUDY, tmp, rounds=1)
    raw = apply_overrides(tomllib.loads(base.read_text()), [*study_variants(STUDY)["lora_fedit"], f"seed={seed}"])
    cfg = validate(raw, "lora_fedit")
    uploads, before = {}, {}
    receive, begin = Server.receive, Server.begin_round

    def spy_receive(server, client, update):
        uploads[client] = {k: v.detach().double().clone() for k, v in update.tensors.items()}
        return receive(server, client, update)

    def spy_begin(server, round_idx, sampled=None):
        before.update({k: v.detach().double().clone() for k, v in server.params.items()})
        return begin(server, round_idx, sampled)
    Server.receive, Server.begin_round = spy_receive, spy_begin
    try:
        run_experiment(cfg, tmp / f"run-{seed}", show_progress=False)
    finally:
        Server.receive, Server.begin_round = receive, begin
    record = json.loads((tmp / f"run-{seed}" / "rounds.jsonl").read_text().splitlines()[0])
    weights = {c: e["weight"] for c, e in record["clients"].items()}
    errors = {}
    for p in pairs(before):
        b0a0 = before[p.b] @ before[p.a]
        exact = sum(w * (uploads[c][p.b] @ uploads[c][p.a] - b0a0) for c, w in weights.items())
        mean_b = sum(w * uploads[c][p.b] for c, w in weights.items())
        mean_a = sum(w * uploads[c][p.a] for c, w in weights.items())
        errors[p.module] = float((mean_b @ mean_a - b0a0 - exact).norm() / exact.norm())
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            errors = one_round(seed, Path(tmp))
            rows.append({"seed": seed, "mean": statistics.mean(errors.values()), "max": max(errors.values()),
                         "layers": errors})
            print(f"seed {seed}: FedIT's relative error over {len(errors)} adapted layers: mean "
                  f"{rows[-1]['mean']:.3f}, max {rows[-1]['max']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                                               "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
