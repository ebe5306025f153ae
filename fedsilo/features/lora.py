"""LoRA: what the exact merge and per-silo ranks need from the rest of the run (fedsilo.core.lora)."""
from __future__ import annotations

from fedsilo.core.lora import LORA_AGGREGATIONS
from fedsilo.models.lora import lora_settings


def check(recipe) -> str | None:
    cfg = recipe.config
    lora = lora_settings(cfg.model)
    if lora is None:
        return None
    silos = cfg.task.client_names()
    unknown = sorted(set(lora.ranks) - set(silos))
    if unknown:
        return f"model.surgery.options.ranks: {unknown[0]!r} is not a silo of this run ({', '.join(silos)})"
    dp_silos = [c for c in silos if cfg.client_config(c).dp is not None]
    if lora.ranks and dp_silos:
        return (f"model.surgery.options.ranks with DP-SGD ({dp_silos[0]}): the noise would fill the rows a lower-rank "
                "silo keeps at zero; give every silo the same rank")
    if not LORA_AGGREGATIONS.get(lora.aggregation).merge:
        return None
    x, plan = cfg.exchange, recipe.plan
    if not plan.download.value.sends_all or not plan.overwrite.value.takes_all:
        key, value = ("download", x.download) if not plan.download.value.sends_all else ("overwrite", x.overwrite)
        return (f"exchange.{key} = {value!r} cannot run with model.surgery.options.aggregation = \"exact\": every silo "
                "must restart each round from the adapters and base weights the server sends (download = \"all\", "
                "overwrite = \"received\")")
    why = "the server merges each silo's own product B·A into the base weights, so it needs each silo's adapters apart"
    if cfg.federation.secure_aggregation is not None:
        return (f"model.surgery.options.aggregation = \"exact\" cannot run with federation.secure_aggregation: {why}; "
                "use aggregation = \"ffa\" (exact under a sum: every silo shares A)")
    if cfg.federation.silo_dp is not None:
        return ("model.surgery.options.aggregation = \"exact\" cannot run with federation.silo_dp: its clip bounds "
                "the adapters' change, not the product's; use aggregation = \"ffa\" or \"fedit\"")
    return None
