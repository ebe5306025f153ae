"""Instruction-tuning metrics, from additive per-record stats (pooling silos or machines is exact).

- `loss_sum` / `loss_n`: the summed cross-entropy of the response tokens (the completion-only loss's
  tokens, EOS or end-of-turn included) and their count: held-out loss, and perplexity = exp(loss).
  Every silo reports them, whatever else it scores.
- `em_hit` / `em_n`: GSM8K, the greedy generation's final number (after "####") equal to the gold one.
- `mc_hit` / `mc_n`: multiple choice (PubMedQA's yes/no/maybe) as lm-evaluation-harness's `acc`: the
  option with the largest summed log-likelihood given the prompt is the prediction.
- `cut`: evaluated records longer than `task.max_length` (their loss read on what truncation left).
- `prompt_cut` / `prompt_lost`: records whose prompt generation or multiple-choice scoring read without
  its start (`budget`: longer than task.max_prompt_length, or max_length less the longest option), and
  the tokens they lost.
- `nonfinite`: records whose loss was NaN/Inf: the evaluation is then invalid (fedsilo.tasks.base).

The model is selected on the macro (mean over silos) loss: it is the one score every silo has, and a
macro mean keeps a silo with long responses (code) from outweighing the others.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from fedsilo.tasks.base import Column, MetricSpec

__all__ = ["SPEC", "compute"]


def _ratio(num, den) -> float | None:
    return float(num) / float(den) if den else None


def compute(stats: Mapping[str, float]) -> dict[str, float | None]:
    loss = _ratio(stats.get("loss_sum", 0.0), stats.get("loss_n", 0.0))
    em, acc = _ratio(stats.get("em_hit", 0.0), stats.get("em_n", 0.0)), _ratio(stats.get("mc_hit", 0.0),
                                                                               stats.get("mc_n", 0.0))
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)) if loss is not None else None,
            "em": 100 * em if em is not None else None, "acc": 100 * acc if acc is not None else None,
            "cut": float(stats.get("cut", 0.0)), "prompt_cut": float(stats.get("prompt_cut", 0.0))}


SPEC = MetricSpec(
    columns=(Column("loss", "loss", ".4f", higher_is_better=False), Column("ppl", "ppl", ".2f", higher_is_better=False),
             Column("em", "GSM8K EM %", ".2f"),
             Column("acc", "MC acc %", ".2f"), Column("cut", "cut", ".0f", in_macro=False),
             Column("prompt_cut", "prompt cut", ".0f", in_macro=False)),
    compute=compute, primary="loss", higher_is_better=False, tie_break=None, selection="macro",
    description="rows: one per silo; loss = mean cross-entropy of the response tokens (completion-only), "
                "ppl = exp(loss); GSM8K EM % = greedy generation's final number after '####' equals the "
                "gold one; MC acc % = the option (yes/no/maybe) with the largest log-likelihood is the gold "
                "one (lm-evaluation-harness acc); cut = records longer than task.max_length; prompt cut = records "
                "whose prompt generation or option scoring read without its start.")
