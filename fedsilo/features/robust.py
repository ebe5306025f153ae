"""A coordinate-wise robust rule (median, trimmed mean) needs enough updates each round; a weighting read
from what each silo says about itself needs a bound, or the run says it has none."""
from __future__ import annotations

from fedsilo.core.aggregate import ROBUST_MIN_CLIENTS


def check(recipe) -> str | None:
    """The median of 2 is their mean and a trimmed mean of 2 trims nothing: refused, not pretended."""
    cfg = recipe.config
    f = cfg.federation
    if not cfg.participation.federates or recipe.server.aggregation.value.weighted:
        return None
    per_round = cfg.silos_per_round
    if per_round < ROBUST_MIN_CLIENTS:
        return (f"federation.aggregation = {f.aggregation!r} cannot be robust with {per_round} client(s) per round "
                f"(it needs at least {ROBUST_MIN_CLIENTS}: the median of two is their mean); use more silos, or "
                "aggregation = \"mean\" with the update and weight limits (max_update_ratio, max_weight_ratio)")
    return None


def uncapped_weights(recipe) -> str | None:
    """Weights read from a number each silo reports about itself (Lorar's ΔL, a loss) with nothing to bound
    them: one silo's claim can take the round. Said at the run's start, not refused: the Lorar paper's
    configs run so (max_weight_ratio = "off"), and their results must stay as they are."""
    cfg, server = recipe.config, recipe.server
    stat = server.statistic or server.weighting.value.reads
    if stat is None or not cfg.participation.federates or not server.aggregation.value.weighted:
        return None
    f = cfg.federation
    said = f"federation.weighting = {f.weighting!r} reads {stat}, which each silo reports itself (self-reported)"
    if f.secure_aggregation is not None:
        return (f"{said}, and under secure aggregation no weight cap applies (each silo's weight is inside its "
                "mask): one silo's claim can take the round's weight; use weighting = \"size\" or \"equal\" where "
                "that matters")
    if server.limits.max_weight_ratio is None and server.limits.max_client_weight is None:
        return (f"{said}, and federation.max_weight_ratio = \"off\" with no federation.max_client_weight: one silo's "
                "claim (e.g. ΔL = 1e30) can take most of a round's weight; set max_weight_ratio (default 10) or "
                "max_client_weight to bound it")
    return None
