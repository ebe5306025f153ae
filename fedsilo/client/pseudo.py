"""Pseudo-label token weights (FewFedWeight §3.2): how much each generated token of a pseudo label counts.

The global model greedily writes a pseudo label ŷ for a client's input; at each generated position a
its top-k logits f_i(a) give the token's energy (Liu et al. 2020, restricted to the top k):

    E(a) = −T · log Σ_{i ∈ top-k} exp(f_i(a) / T)          (k = 7, T = 1 in the paper)

A noisy token has a higher energy, so a lower weight; within one sequence

    w_a = −E(a) / Σ_j −E(j)                                   (the paper's Eq. 4)

and the pseudo loss of the sequence is Σ_a w_a · NLL_a (weights sum to 1: a weighted token mean).

−E(a) ≥ max_i f_i(a), so −E(a) ≤ 0 only where even the best logit is ≤ 0, and then Eq. 4 breaks
(a weight of either sign, a sum that may be 0). `energy` uses Eq. 4 wherever every token of the
sequence has −E > 0, and softplus(−E) in its place for a sequence with any −E ≤ 0: positive,
increasing in −E like Eq. 4, and within e^{−x} of x for large x. `energy_softplus` uses softplus
everywhere; `uniform` gives every token 1/l (the paper's ablation without pseudo-data weighting).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from fedsilo.registry import Registry

from .hooks import HookContext, round_hook


def neg_energy(topk_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """−E = T·logsumexp(f/T) over the last dimension (the top-k logits of each position), in float64."""
    return temperature * torch.logsumexp(topk_logits.double() / temperature, dim=-1)


TokenWeighting = Callable[[torch.Tensor], torch.Tensor]  # −E of one sequence [l] -> weights [l], summing to 1
TOKEN_WEIGHTINGS: Registry[TokenWeighting] = Registry("pseudo-label token weighting")


@TOKEN_WEIGHTINGS.register("energy")
def energy_weights(score: torch.Tensor) -> torch.Tensor:
    """The paper's Eq. 4 where every −E > 0; softplus(−E) normalised for a sequence with any −E ≤ 0."""
    if bool((score > 0).all()):
        return score / score.sum()
    return softplus_weights(score)


@TOKEN_WEIGHTINGS.register("energy_softplus")
def softplus_weights(score: torch.Tensor) -> torch.Tensor:
    s = F.softplus(score)
    return s / s.sum()


@TOKEN_WEIGHTINGS.register("uniform")
def uniform_weights(score: torch.Tensor) -> torch.Tensor:
    return torch.full_like(score, 1.0 / score.numel())


def token_weights(topk_logits: torch.Tensor, weighting: TokenWeighting = energy_weights,
                  temperature: float = 1.0) -> torch.Tensor:
    """Weights [l] of one pseudo label's tokens from its top-k logits [l, k] (`weighting`: a
    TOKEN_WEIGHTINGS entry)."""
    if topk_logits.ndim != 2 or not topk_logits.shape[0]:
        raise ValueError(f"expected the top-k logits of a non-empty sequence [l, k], got {tuple(topk_logits.shape)}")
    return weighting(neg_energy(topk_logits, temperature))


@runtime_checkable
class PseudoLabeling(Protocol):
    """What a task offers for pseudo labels (the multitask task does)."""

    def pseudo_label(self, model: torch.nn.Module, examples: Sequence[Any], top_k: int
                     ) -> list[tuple[list[int], torch.Tensor]]:
        """Per example: the greedy output's token ids and each token's top-k logits [len, k]."""

    def with_pseudo(self, example: Any, ids: Sequence[int], weights: Sequence[float]) -> Any:
        """The example carrying a pseudo label and its token weights (trained on beside its own label)."""


class PseudoSettings(BaseModel):
    """`client.hook_options` of the `pseudo_labels` hook."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    weighting: str = Field("energy", description="token weighting: energy (the paper), energy_softplus, uniform")
    top_k: int = Field(7, gt=0, description="logits the energy is taken over (the paper: 7)")
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="T of the energy (the paper: 1)")
    _weigh: TokenWeighting | None = PrivateAttr(default=None)

    @field_validator("weighting")
    @classmethod
    def _known(cls, v: str) -> str:
        return TOKEN_WEIGHTINGS.check(v)

    def model_post_init(self, context: Any) -> None:
        self._weigh = TOKEN_WEIGHTINGS.get(self.weighting)  # looked up once, as the options are validated

    @property
    def weigh(self) -> TokenWeighting:
        return self._weigh


@round_hook("pseudo_labels", PseudoSettings, needs=PseudoLabeling)
def pseudo_labels(ctx: HookContext) -> list:
    """FewFedWeight's data augmentation: the labelling model (the received global one, or the client's
    own with `client.pseudo_source = "own"`: Data Silo DA) writes a pseudo label for every training
    input; each example then trains on its own label and on the pseudo label, token-weighted."""
    opts = ctx.options or PseudoSettings()
    labelled = ctx.task.pseudo_label(ctx.labeler(), ctx.examples, opts.top_k)
    return [ctx.task.with_pseudo(example, ids, token_weights(top, opts.weigh, opts.temperature).tolist())
            for example, (ids, top) in zip(ctx.examples, labelled)]
