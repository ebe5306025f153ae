"""What low-rank adapters and compressed exchange cost and save, side by side in one run: the variants of
experiments/adapters/qa_lora.toml (full FedAvg, its int8 upload, LoRA FedIT / FFA / exact, LoRA with an
int8 upload) on the README's main job, each in its own process (bench/variant_cost.py): training time,
peak memory, bytes up and down.

    python bench/adapters_cost.py [--rounds 1] [--repeat 2] [--json bench/results/adapters-cost.json]
"""
from __future__ import annotations

from pathlib import Path

from variant_cost import compare, study_variants

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "adapters" / "qa_lora.toml"

if __name__ == "__main__":
    compare(STUDY, study_variants(STUDY), __doc__, baseline="fedavg")
