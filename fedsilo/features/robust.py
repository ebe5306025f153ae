"""A coordinate-wise robust rule (median, trimmed mean) needs enough updates each round."""
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
