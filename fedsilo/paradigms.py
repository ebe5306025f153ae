"""How a run's silos take part in it: the `paradigm` axis, one registry entry per way.

An entry says what the engine does differently, as properties the config, the recipe and the runner
read; none of them compares the paradigm's name. A user's own way of taking part is one more entry
(registered by a plug-in module) with these three properties.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedsilo.registry import Registry


@dataclass(frozen=True)
class Paradigm:
    federates: bool      # several clients through one server: exchange, weighting and aggregation apply
    pools_silos: bool    # one participant trains on every silo's training examples (no privacy)
    per_silo_runs: bool  # each silo trains in a run of its own, with its own model selection
    trains: bool = True  # False: no round runs; the starting model is what is evaluated (dev, then test)


PARADIGMS: Registry[Paradigm] = Registry("paradigm")
PARADIGMS.add("federated", Paradigm(federates=True, pools_silos=False, per_silo_runs=False))
# Each silo alone (the papers' "local" rows): a federation of one per silo, pooled results.
PARADIGMS.add("finetune", Paradigm(federates=False, pools_silos=False, per_silo_runs=True))
# Every silo's training data in one place: the non-private reference.
PARADIGMS.add("centralized", Paradigm(federates=False, pools_silos=True, per_silo_runs=False))
# No training at all: the starting model (a pretrained checkpoint, model.init_from's) on every silo's
# dev and test, the row every fine-tuned variant must beat (LLM papers' "zero-shot").
PARADIGMS.add("zero_shot", Paradigm(federates=False, pools_silos=False, per_silo_runs=False, trains=False))
