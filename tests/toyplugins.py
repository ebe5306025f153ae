"""A model surgery, a round hook, an after-training pass and a paradigm: registered on import, named
in a config's `plugins`, so Flower's processes register them too."""
import torch
from pydantic import BaseModel, ConfigDict

from fedsilo.client.hooks import AFTER_TRAINING, round_hook
from fedsilo.models import SURGERIES
from fedsilo.paradigms import PARADIGMS, Paradigm

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


@round_hook("test-twice")
def twice(ctx):
    """Train on every example twice; record the sum of the labelling model's weights."""
    model = ctx.labeler()
    SEEN.append({"client": ctx.client, "round": ctx.round, "source": ctx.pseudo_source.name,
                 "labeler_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
                 "received_sum": float(sum(t.double().sum() for t in ctx.received.values())),
                 "own": bool(ctx.own)})
    return list(ctx.examples) * 2


class ShrinkSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    factor: float = 0.5


class Shrink:
    """After training, keep the received global tensors times `factor` as the client's own model
    (evaluation then uses them): a pass with no training, so its effect is exact."""
    slot = "shrunk"

    def steps(self, n_examples, client_cfg, options) -> int:
        return 0

    def __call__(self, ctx, options: ShrinkSettings):
        return {k: v * options.factor for k, v in ctx.received.items()}, {"shrunk": float(options.factor)}


AFTER_TRAINING.add("test-shrink", Shrink(), ShrinkSettings)

# Every silo alone, as `finetune`, under another name: a paradigm is three properties.
PARADIGMS.add("test-alone", Paradigm(federates=False, pools_silos=False, per_silo_runs=True))
