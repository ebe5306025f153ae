"""Record-level DP-SGD on some silos: what its guarantee needs from the rest of the run."""
from __future__ import annotations


def check(recipe) -> str | None:
    cfg = recipe.config
    silos = [c for c in cfg.task.client_names() if cfg.client_config(c).dp is not None]
    if cfg.client.dp is None and not silos:
        return None
    where = "client.dp" if cfg.client.dp is not None else f"clients.{silos[0]}.dp"
    if cfg.model.precision != "fp32":
        return (f"{where}: DP-SGD runs in fp32 here (Opacus's per-example gradients under model.precision = "
                f"{cfg.model.precision!r} are not supported); set model.precision = \"fp32\"")
    server = recipe.server
    stat = server.statistic or server.weighting.value.reads
    if cfg.participation.federates and stat:
        return (f"federation.weighting = {cfg.federation.weighting!r} reads each silo's {stat}, a loss on its records "
                f"that a silo under {where} does not send (it is not privatised); use a weighting that reads none, "
                "e.g. weighting = \"size\" or \"equal\"")
    return None
