"""Each feature's check on a whole recipe: what its part needs from the rest of the run.

A feature (secure aggregation, silo-level DP, DP-SGD, LoRA, codecs, a robust rule) owns one module here
with one `check(recipe) -> problem | None`, reading the abilities the resolved entries declare (a
selector that `sends_all`, a weighting's `public_weight`, a transform that `decode`s per silo), never a
policy's name. fedsilo.recipe.build_recipe runs every registered check once, so a user's own policy that
declares the right abilities combines with no change here; a user's own feature adds its check with
`RECIPE_CHECKS.add(name, check)`, and a stage around the server's aggregation with
`ROUND_STAGES.add(name, build)`.
"""
from __future__ import annotations

from collections.abc import Callable

from fedsilo.registry import Registry

from . import codecs, dp_sgd, lora, robust, secure_aggregation, silo_dp

RECIPE_CHECKS: Registry[Callable[[object], str | None]] = Registry("recipe check")
for _module in (robust, codecs, secure_aggregation, silo_dp, dp_sgd, lora):
    RECIPE_CHECKS.add(_module.__name__.rpartition(".")[2], _module.check)

# A stage around the server's round aggregation (fedsilo.server.RoundStage), from the run's config and its
# resolved weighting policy; None when the config does not ask for it. In registration order, innermost first.
ROUND_STAGES: Registry[Callable[[object, object], object | None]] = Registry("round stage")
ROUND_STAGES.add("silo_dp", silo_dp.server_stage)
ROUND_STAGES.add("sum_guard", secure_aggregation.server_stage)  # outside silo-level DP: it reads the noisy mean
