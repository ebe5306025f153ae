"""Meta Weighting (Ren et al. 2018, "Learning to reweight examples"), the FewFedWeight paper's
strongest baseline (its Appendix A.2): pseudo-labelled examples weighted by how much a step on each
would lower the loss on the annotated examples.

Per batch of b inputs with their annotated labels y_j (batch B) and pseudo labels ŷ_j (batch B̂):

1. a look-ahead SGD step on the pseudo losses, every perturbation ε_j = 1 (the paper's Algorithm 2):
   θ' = θ − α·Σ_j ε_j ∇l̂_j(θ), with α the client's learning rate;
2. the annotated loss at θ', L_B(θ'), and its gradient with respect to ε:
   ∂L_B/∂ε_j = ⟨∇L_B(θ'), ∂θ'/∂ε_j⟩ = −α·⟨∇L_B(θ'), ∇l̂_j(θ)⟩, exact without second-order terms
   since θ' is linear in ε;
3. ŵ_j = max(−∂L_B/∂ε_j, 0), w_j = ŵ_j / Σ_k ŵ_k (all zero when no pseudo example helps, as Ren et al.);
4. the step's loss: mean annotated loss + Σ_j w_j·l̂_j (weights detached).

The paper's text puts ε on the annotated losses, which would make every weight 0 (∂/∂ε_j of
Σ ε_j l_j is l_j ≥ 0); we follow Ren et al., whom it cites. All b dot products come from one
double backward (Ren et al.'s own trick): u(ε) = Σ_j ε_j ∇l̂_j(θ) is built with its graph, and
∂⟨u, ∇L_B(θ')⟩/∂ε_j = ⟨∇l̂_j, ∇L_B(θ')⟩, so a step costs about three backward passes more than
plain training, whatever b, instead of b + 2.
Attention then runs on PyTorch's math kernel: the fused kernels have no second derivative.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .objective import CLIENT_OBJECTIVES, LossFn


@runtime_checkable
class SequenceLosses(Protocol):
    def sequence_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(annotated rows' losses [b], pseudo rows' losses [p]) of one batch."""

    def annotated_only(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch without its pseudo rows."""


def meta_weights(model: torch.nn.Module, pseudo: torch.Tensor, annotated_loss, alpha: float) -> torch.Tensor:
    """w [p] from the pseudo losses l̂_j(θ) (a graph over the model's parameters, built on the math
    attention kernel: see `math_attention`) and `annotated_loss(forward)`, the annotated loss
    computed with `forward` in place of the model. The look-ahead runs through
    `torch.func.functional_call`, so the model's own tensors (and the graph of this step, which still
    needs them) are never modified."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params = list(named.values())
    eps = torch.ones_like(pseudo, requires_grad=True)
    grads = torch.autograd.grad(pseudo, params, grad_outputs=eps, create_graph=True, allow_unused=True)
    ahead = {n: (p.detach() - alpha * g.detach() if g is not None else p.detach()).requires_grad_()
             for (n, p), g in zip(named.items(), grads)}
    loss_ahead = annotated_loss(lambda **inputs: torch.func.functional_call(model, ahead, (), inputs))
    outer = torch.autograd.grad(loss_ahead, list(ahead.values()), allow_unused=True)
    inner = sum((g * o).sum() for g, o in zip(grads, outer) if g is not None and o is not None)
    dots, = torch.autograd.grad(inner, eps)
    raw = torch.clamp(alpha * dots.detach().double(), min=0)
    total = raw.sum()
    return (raw / total if total > 0 else raw).to(pseudo.dtype)


def math_attention():
    """Scaled-dot-product attention on the math kernel, whose backward can be differentiated again."""
    return sdpa_kernel([SDPBackend.MATH])


def meta_weighting(task: Any, cfg: Any) -> LossFn:
    if not isinstance(task, SequenceLosses):
        raise TypeError(f"task {getattr(task, 'name', task)!r} has no per-sequence losses for meta weighting")

    def loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with math_attention():
            annotated, pseudo = task.sequence_losses(model, batch)
            terms = {"annotated": annotated.mean()}
            if pseudo.numel():
                only = task.annotated_only(batch)
                w = meta_weights(model, pseudo, lambda forward: task.sequence_losses(forward, only)[0].mean(), cfg.lr)
                terms["pseudo"] = (w.detach() * pseudo).sum()
        return terms
    return loss


CLIENT_OBJECTIVES.add("meta_weighting", meta_weighting)
