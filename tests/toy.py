"""A toy model with tied weights and a toy dataset, for engine tests that need no real model."""
from types import SimpleNamespace

import torch
from torch import nn


class TiedToy(nn.Module):
    """emb and head share one weight (like T5's embeddings and LM head)."""

    def __init__(self, vocab: int = 5, dim: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.Linear(dim, dim)
        self.dec = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        h = self.dec(torch.tanh(self.enc(self.emb(x))))
        return SimpleNamespace(loss=nn.functional.cross_entropy(self.head(h), y))


def toy_data(n: int, seed: int, vocab: int = 5) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randint(0, vocab, (n,), generator=g)
    return [(int(x), int((x * 2 + seed) % vocab)) for x in xs]


def toy_collate(batch):
    return {"x": torch.tensor([b[0] for b in batch]), "y": torch.tensor([b[1] for b in batch])}


class ToyTask:
    """Just what a SiloClient needs from a task: collate and named loss terms."""
    name = "toy"

    @staticmethod
    def collate(batch):
        return toy_collate(batch)

    @staticmethod
    def loss(model, batch):
        return {"task": model(**batch).loss}


def server_with(params, optimizer, weighting, plan=None, aggregation=None, lora_merge=None, **limits):
    """A Server over `params` from its parts, as fedsilo.recipe.server_recipe assembles them."""
    from fedsilo.core.exchange import ExchangePlan
    from fedsilo.core.rounds import Limits
    from fedsilo.server import Server, ServerRecipe

    extra = {"aggregation": aggregation} if aggregation is not None else {}
    return Server(params, ServerRecipe(optimizer, weighting, limits=Limits(**limits), plan=plan or ExchangePlan(),
                                       lora_merge=lora_merge, **extra))
