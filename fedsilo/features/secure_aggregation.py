"""Secure aggregation: what needs one silo's update, weight or tensor list in the clear cannot run under
the mask."""
from __future__ import annotations

from fedsilo.privacy.secure_stages import SumGuard

from .common import changed_limits

WHY = "the server sees only the sum of the silos' masked updates"


def check(recipe) -> str | None:
    cfg = recipe.config
    secure = cfg.federation.secure_aggregation
    if secure is None:
        return None
    x, plan = cfg.exchange, recipe.plan
    if not cfg.participation.federates:
        return f"federation.secure_aggregation: paradigm {cfg.paradigm!r} does not federate"
    if not plan.upload.value.sends_all:
        return (f"exchange.upload = {x.upload!r} cannot run with federation.secure_aggregation: each silo would send "
                "other tensors, and masked vectors only add up when every silo sends all shared tensors (an upload "
                "selector that sends all, e.g. upload = \"all\")")
    if not plan.download.value.sends_all:
        return (f"exchange.download = {x.download!r} cannot run with federation.secure_aggregation: a silo's update "
                "is taken against what it received, so it must receive every shared tensor (download = \"all\")")
    if plan.download_transforms:
        return ("exchange.download_transforms cannot run with federation.secure_aggregation: each silo's masked "
                f"update is taken against the coded values it received, the mean against the server's own ({WHY})")
    if not recipe.server.aggregation.value.weighted:
        return (f"federation.aggregation = {cfg.federation.aggregation!r} needs every update apart (a coordinate-"
                f"wise robust rule); {WHY}: use aggregation = \"mean\"")
    limit = changed_limits(cfg, "federation.secure_aggregation", f"it bounds one silo's update or weight, and {WHY}; "
                           "leave it out (to clip updates, clip on the silos: exchange.upload_transforms = "
                           "[{name = \"clip\", max_norm = …}])")
    if limit:
        return limit
    per_round = cfg.silos_per_round
    need = secure.threshold or per_round // 2 + 1
    if per_round < 2 or need > per_round:
        why = "one silo's update would be the whole sum" if per_round < 2 else \
            f"the Shamir threshold {need} is more than that"
        return (f"federation.secure_aggregation: {per_round} silo(s) per round: {why}; use more silos"
                + ("" if per_round < 2 else " or a lower threshold"))
    return None


def server_stage(cfg, weighting) -> SumGuard | None:
    """What the server can still bound when it sees only the sum: the round's mean update. Under silo-level
    DP the mean holds the noise, whose norm (σ·C·√d / W) can exceed the model's own: only its growth over
    the applied rounds is bounded there (their noise is alike)."""
    secure = cfg.federation.secure_aggregation
    if secure is None:
        return None
    ratio, growth = (None if v == "off" else float(v) for v in (secure.max_mean_ratio, secure.max_mean_growth))
    return SumGuard(None if cfg.federation.silo_dp is not None else ratio, growth)
