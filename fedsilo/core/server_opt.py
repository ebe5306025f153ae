"""Server update on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

Δ is the aggregated client change Σ p_i (w_i − w). Conventions follow Reddi's Algorithm 2 (no
bias correction) with moments initialised at zero, as Flower's FedAdam/FedYogi/FedAdagrad do:
  fedavg   w ← w + η·Δ
  sgdm     m ← β·m + Δ;  w ← w + η·m          (FedAvgM; the Lorar authors' "FedOPT": η=1, β=0.9)
  adam     m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;            w ← w + η·m/(√v + τ)
  yogi     m as adam;  v ← v − (1−β2)·Δ²·sign(v − Δ²);             w ← w + η·m/(√v + τ)
  adagrad  m as adam;  v ← v + Δ²;                                  w ← w + η·m/(√v + τ)
Tensors absent from Δ (nobody sent them) are left untouched, moments included.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tensors import Tensors

from fedsilo.registry import Registry

OPTIMIZERS = ("fedavg", "sgdm", "adam", "yogi", "adagrad")
SERVER_OPTIMIZERS: Registry = Registry("server optimizer")
for _n in OPTIMIZERS:
    SERVER_OPTIMIZERS.add(_n, _n)


@dataclass
class ServerOptimizer:
    kind: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    m: Tensors = field(default_factory=dict)
    v: Tensors = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.kind!r}; choose one of {', '.join(OPTIMIZERS)}")

    @torch.no_grad()
    def step(self, params: Tensors, delta: Tensors) -> None:
        """Apply Δ to `params` in place."""
        for name, d in delta.items():
            w = params[name]
            d = d.to(w.dtype)
            if self.kind == "fedavg":
                w.add_(d, alpha=self.lr)
            elif self.kind == "sgdm":
                m = self.m.get(name)
                m = d.clone() if m is None else m.mul_(self.momentum).add_(d)
                self.m[name] = m
                w.add_(m, alpha=self.lr)
            else:
                m = self.m.get(name, torch.zeros_like(d)).mul_(self.beta1).add_(d, alpha=1 - self.beta1)
                v = self.v.get(name, torch.zeros_like(d))
                sq = d * d
                if self.kind == "adam":
                    v.mul_(self.beta2).add_(sq, alpha=1 - self.beta2)
                elif self.kind == "yogi":
                    v.sub_((1 - self.beta2) * sq * torch.sign(v - sq))
                else:  # adagrad
                    v.add_(sq)
                self.m[name], self.v[name] = m, v
                w.add_(self.lr * m / (v.sqrt() + self.tau))

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.m, self.v = dict(state["m"]), dict(state["v"])
