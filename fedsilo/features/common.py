"""What several features' checks share."""
from __future__ import annotations

from typing import Any


def fmt(v: Any) -> str:
    """A value as the config writes it (numbers as Python prints them)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def changed_limits(cfg, feature: str, why: str) -> str | None:
    """A limit on one silo's update or weight set away from its default, which `feature` does not apply
    (there is nothing per silo to compare): the first one, named."""
    f = cfg.federation
    fields = type(f).model_fields
    for key in ("clip_norm", "max_client_weight", "max_weight_ratio", "max_update_ratio"):
        value = getattr(f, key)
        if value not in (None, "off") and value != fields[key].default:
            return f"federation.{key} = {fmt(value)} cannot apply with {feature}: {why}"
    return None
