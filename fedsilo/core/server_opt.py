"""Server update on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

Δ is the aggregated client change Σ p_i (w_i − w). Rules (one small function each, in a registry):
  fedavg   w ← w + η·Δ
  sgdm     m ← β·m + Δ;  w ← w + η·m          (FedAvgM; the Lorar authors' "FedOPT": η=1, β=0.9)
  adam     m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;            w ← w + η_t·m/(√v + τ)
  yogi     m as adam;  v ← v − (1−β2)·Δ²·sign(v − Δ²);             w ← w + η·m/(√v + τ)
  adagrad  m as adam;  v ← v + Δ²;                                  w ← w + η·m/(√v + τ)
The second moment starts at v₀ = τ² (Reddi et al., Algorithm 2) unless `v0` says otherwise (0 is
Flower's convention). Adam's step is η unless `bias_correction`: "adam" gives η·√(1−β2^t)/(1−β1^t)
with t the server step (Kingma & Ba), "flower" the same with t = step + 1, as Flower 1.41's FedAdam
computes it (`server_round + 1`). docs/server-optimizers.md compares each rule with Flower's.
Tensors absent from Δ (nobody sent them) are left untouched, moments included. State is allocated
once per tensor and updated in place.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedsilo.registry import Registry

from .tensors import Tensors

BIAS_CORRECTIONS = ("none", "adam", "flower")

# rule(w, Δ, state of this tensor (mutable dict), optimiser) -> None: updates w in place
Rule = Callable[[torch.Tensor, torch.Tensor, dict, "ServerOptimizer"], None]
SERVER_OPTIMIZERS: Registry[Rule] = Registry("server optimizer")


@SERVER_OPTIMIZERS.register("fedavg")
def fedavg(w, d, state, opt) -> None:
    w.add_(d, alpha=opt.lr)


@SERVER_OPTIMIZERS.register("sgdm")
def sgdm(w, d, state, opt) -> None:
    if "m" not in state:
        state["m"] = d.clone()
    else:
        state["m"].mul_(opt.momentum).add_(d)
    w.add_(state["m"], alpha=opt.lr)


def _first_moment(d: torch.Tensor, state: dict, opt: "ServerOptimizer") -> torch.Tensor:
    if "m" not in state:
        state["m"] = torch.zeros_like(d)
        state["v"] = torch.full_like(d, opt.initial_v)
    return state["m"].mul_(opt.beta1).add_(d, alpha=1 - opt.beta1)


def _adaptive_step(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, tau: float) -> None:
    w.addcdiv_(m, v.sqrt().add_(tau), value=lr)


@SERVER_OPTIMIZERS.register("adam")
def adam(w, d, state, opt) -> None:
    m = _first_moment(d, state, opt)
    v = state["v"].mul_(opt.beta2).addcmul_(d, d, value=1 - opt.beta2)
    lr = opt.lr
    if opt.bias_correction != "none":
        t = opt.steps + (1 if opt.bias_correction == "flower" else 0)
        lr = opt.lr * math.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)
    _adaptive_step(w, m, v, lr, opt.tau)


@SERVER_OPTIMIZERS.register("yogi")
def yogi(w, d, state, opt) -> None:
    m = _first_moment(d, state, opt)
    sq = d * d
    v = state["v"]
    v.addcmul_(sq, torch.sign(v - sq), value=-(1 - opt.beta2))
    _adaptive_step(w, m, v, opt.lr, opt.tau)


@SERVER_OPTIMIZERS.register("adagrad")
def adagrad(w, d, state, opt) -> None:
    m = _first_moment(d, state, opt)
    v = state["v"].addcmul_(d, d)
    _adaptive_step(w, m, v, opt.lr, opt.tau)


@dataclass
class ServerOptimizer:
    kind: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    v0: float | None = None          # None: τ² (Reddi et al.)
    bias_correction: str = "none"    # "none" (Reddi et al.), "adam" (Kingma & Ba), "flower" (FedAdam)
    steps: int = 0
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rule = SERVER_OPTIMIZERS.get(self.kind)
        if self.bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"bias_correction {self.bias_correction!r}: choose from {', '.join(BIAS_CORRECTIONS)}")

    @property
    def initial_v(self) -> float:
        return self.tau ** 2 if self.v0 is None else self.v0

    @torch.no_grad()
    def step(self, params: Tensors, delta: Tensors) -> None:
        """Apply Δ to `params` in place."""
        self.steps += 1
        for name, d in delta.items():
            w = params[name]
            self.rule(w, d.to(w.dtype), self.state.setdefault(name, {}), self)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": self.state}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.state = {k: dict(v) for k, v in state["state"].items()}
