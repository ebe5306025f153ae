"""What privacy costs in time and memory, side by side in one run: the README's main job (answer selection
on 5 QA silos, FedAvg, MiniLM-L6) trained plainly, with DP-SGD (ghost and per-example clipping), with
secure aggregation, and with both (bench/variant_cost.py: each variant in its own process, interleaved).

    python bench/privacy_cost.py [--rounds 1] [--repeat 2] [--json bench/results/privacy-cost.json]
"""
from __future__ import annotations

from pathlib import Path

from variant_cost import compare

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "privacy" / "qa_dp.toml"
VARIANTS = {
    "plain": [],
    "dp-ghost": ["client.dp.target_epsilon=8", "client.dp.clipping=\"ghost\""],
    "dp-per-example": ["client.dp.target_epsilon=8", "client.dp.clipping=\"per_example\""],
    "secure-aggregation": ["federation.secure_aggregation={}"],
    "dp-ghost + secure": ["client.dp.target_epsilon=8", "client.dp.clipping=\"ghost\"",
                          "federation.secure_aggregation={}"],
}

if __name__ == "__main__":
    compare(STUDY, VARIANTS, __doc__, baseline="plain")
