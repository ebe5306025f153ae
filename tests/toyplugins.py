"""A model surgery, a round hook and nothing else: registered on import, named in a config's
`plugins`, so Flower's processes register them too."""
import torch
from pydantic import BaseModel, ConfigDict

from fedsilo.client.hooks import ROUND_HOOKS
from fedsilo.models import SURGERIES

SEEN: list[dict] = []  # what the hook saw (in-process tests read it)


class AdapterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    noise: float = 0.01


@SURGERIES.register("test-adapter", AdapterSettings)
def adapter(model, settings: AdapterSettings, seed: int) -> None:
    """Put a near-identity linear layer before the score head (seeded: the same everywhere)."""
    head = model.classifier
    d = head.in_features
    gen = torch.Generator().manual_seed(seed)
    extra = torch.nn.Linear(d, d)
    with torch.no_grad():
        extra.weight.copy_(torch.eye(d) + settings.noise * torch.randn(d, d, generator=gen))
        extra.bias.zero_()
    model.classifier = torch.nn.Sequential(extra, head)


@ROUND_HOOKS.register("test-twice")
def twice(ctx):
    """Train on every example twice; record the sum of the labelling model's weights."""
    model = ctx.labeler()
    SEEN.append({"client": ctx.client, "round": ctx.round, "source": ctx.pseudo_source,
                 "labeler_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
                 "received_sum": float(sum(t.double().sum() for t in ctx.received.values())),
                 "own": bool(ctx.own)})
    return list(ctx.examples) * 2
