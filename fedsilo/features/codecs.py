"""The upload chain and the download codec: what they need from the exchange plan."""
from __future__ import annotations


def check(recipe) -> str | None:
    x, plan = recipe.config.exchange, recipe.plan
    chain = plan.upload_transforms
    reads_delta = [p.name for p in chain if p.value.needs_reference]
    if reads_delta and not plan.download.value.sends_all:
        return (f"exchange.upload_transforms: {reads_delta[0]!r} reads the update against what the client received, "
                f"but download = {x.download!r} may not send every tensor it uploads (use a download policy that "
                "sends every tensor, e.g. download = \"all\")")
    if len(plan.download_transforms) > 1:
        return "exchange.download_transforms: at most one codec (each codes the server's values)"
    coded = [i for i, p in enumerate(chain) if p.value.decode is not None]
    if coded and coded[0] != len(chain) - 1:
        return (f"exchange.upload_transforms[{coded[0]}]: {chain[coded[0]].name!r} encodes what is sent (no longer "
                f"the tensors' values), so it must be the last transform; {chain[coded[0] + 1].name!r} comes after it")
    return None
