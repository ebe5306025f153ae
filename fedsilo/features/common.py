"""What several features' checks share."""
from __future__ import annotations

from fedsilo.settings import toml_value


def changed_limits(cfg, feature: str, why: str) -> str | None:
    """A limit on one silo's update or weight set away from its default, which `feature` does not apply
    (there is nothing per silo to compare): the first one, named."""
    f = cfg.federation
    fields = type(f).model_fields
    for key in ("clip_norm", "max_client_weight", "max_weight_ratio", "max_update_ratio"):
        value = getattr(f, key)
        if value not in (None, "off") and value != fields[key].default:
            return f"federation.{key} = {toml_value(value)} cannot apply with {feature}: {why}"
    return None
