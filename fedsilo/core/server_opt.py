"""Server update on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

Δ is the aggregated client change Σ p_i (w_i − w). Rules (one small function each, in a registry):
  fedavg   w ← w + η·Δ
  sgdm     m ← β·m + Δ;  w ← w + η·m          (FedAvgM; the Lorar authors' "FedOPT": η=1, β=0.9)
  adam     m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;            w ← w + η_t·m/(√v + τ)
  yogi     m as adam;  v ← v − (1−β2)·Δ²·sign(v − Δ²);             w ← w + η·m/(√v + τ)
  adagrad  m as adam;  v ← v + Δ²;                                  w ← w + η·m/(√v + τ)
m starts at 0. The second moment starts at v₀ = τ² (Reddi et al., Algorithm 2) unless `v0` says
otherwise (0 is Flower's convention). Adam's step is η unless `bias_correction`: "adam" gives
η·√(1−β2^t)/(1−β1^t) with t the server step (Kingma & Ba), "flower" the same with t = step + 1, as
Flower 1.41's FedAdam computes it (`server_round + 1`, rounds counted from 1); True means "flower".
Every `step` call counts as one server step (an empty Δ included, as Flower counts rounds).
docs/server-optimizers.md compares each rule with Flower's strategies.
Moments are allocated once per tensor (at its first step), in the parameter's dtype and device, and
updated in place. Tensors absent from Δ (nobody sent them) are left untouched, moments included.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedsilo.registry import Registry

from .tensors import Tensors

Moments = dict[str, torch.Tensor]  # one tensor's optimiser state ("m", "v"), filled by its rule
# rule(w, Δ in w's dtype and device, w's moments, optimiser) -> None: updates w and its moments in place
Rule = Callable[[torch.Tensor, torch.Tensor, Moments, "ServerOptimizer"], None]


@dataclass(frozen=True)
class ServerRule:
    """A server optimiser's entry: its update, the lr it takes when the config names none, whether it
    reads `bias_correction` (only Adam does, in Reddi et al. and in Flower), and which of the
    `HYPERPARAMETERS` it reads (None: not declared, so none is said to be unread)."""
    update: Rule
    default_lr: float
    bias_corrected: bool = False
    reads: frozenset[str] | None = None


HYPERPARAMETERS = ("momentum", "beta1", "beta2", "tau", "v0")  # [server] keys some rules read and others not


SERVER_OPTIMIZERS: Registry[ServerRule] = Registry("server optimizer")


def server_rule(name: str, default_lr: float, bias_corrected: bool = False,
                reads: tuple[str, ...] | None = None) -> Callable[[Rule], Rule]:
    """Decorator: register an update function as server optimiser `name`; `reads`: the
    `HYPERPARAMETERS` it reads (a config setting another is refused), None: not said."""
    def wrap(update: Rule) -> Rule:
        SERVER_OPTIMIZERS.add(name, ServerRule(update, default_lr, bias_corrected,
                                               None if reads is None else frozenset(reads)))
        return update
    return wrap


# bias correction(t = server steps taken, β1, β2) -> the factor on η at this step
BiasCorrection = Callable[[int, float, float], float]
BIAS_CORRECTIONS: Registry[BiasCorrection] = Registry("bias correction")


def _kingma_ba(t: float, beta1: float, beta2: float) -> float:
    return math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)


BIAS_CORRECTIONS.add("none", lambda t, beta1, beta2: 1.0)            # Reddi et al.
BIAS_CORRECTIONS.add("adam", _kingma_ba)                               # Kingma & Ba: t = server step
BIAS_CORRECTIONS.add("flower", lambda t, beta1, beta2: _kingma_ba(t + 1.0, beta1, beta2))  # Flower: round + 1


def unread_correction(kind: str, correction: str) -> str | None:
    """Why `correction` would silently change nothing for server optimiser `kind`, or None."""
    if correction == "none" or SERVER_OPTIMIZERS.get(kind).bias_corrected:
        return None
    takers = ", ".join(n for n in SERVER_OPTIMIZERS if SERVER_OPTIMIZERS.get(n).bias_corrected)
    return (f"bias_correction = {correction!r}: the {kind!r} server optimizer does not read it (only {takers} "
            "does: neither Reddi et al. nor Flower bias-correct the other server optimisers)")


def unread_hyperparameters(kind: str) -> tuple[str, ...]:
    """The `HYPERPARAMETERS` server optimiser `kind` declares it never reads."""
    reads = SERVER_OPTIMIZERS.get(kind).reads
    return () if reads is None else tuple(h for h in HYPERPARAMETERS if h not in reads)


def _moment(state: Moments, key: str, like: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Moment `key` of one tensor: allocated at the tensor's first step, then reused."""
    t = state.get(key)
    if t is None:
        t = state[key] = torch.full_like(like, fill)
    elif t.dtype != like.dtype or t.device != like.device:  # loaded from a checkpoint made elsewhere
        t = state[key] = t.to(device=like.device, dtype=like.dtype)
    return t


def _first_moment(d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> torch.Tensor:
    return _moment(state, "m", d).mul_(opt.beta1).add_(d, alpha=1 - opt.beta1)


def _second_moment(d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> torch.Tensor:
    return _moment(state, "v", d, opt.initial_v)


def _adaptive_step(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, tau: float) -> None:
    w.addcdiv_(m, v.sqrt().add_(tau), value=lr)  # w + η·m/(√v + τ): one temporary


@server_rule("fedavg", default_lr=1.0, reads=())
def fedavg(w: torch.Tensor, d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> None:
    w.add_(d, alpha=opt.lr)


@server_rule("sgdm", default_lr=1.0, reads=("momentum",))
def sgdm(w: torch.Tensor, d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> None:
    m = _moment(state, "m", d).mul_(opt.momentum).add_(d)
    w.add_(m, alpha=opt.lr)


@server_rule("adam", default_lr=0.01, bias_corrected=True, reads=("beta1", "beta2", "tau", "v0"))
def adam(w: torch.Tensor, d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> None:
    m = _first_moment(d, state, opt)
    v = _second_moment(d, state, opt).mul_(opt.beta2).addcmul_(d, d, value=1 - opt.beta2)
    _adaptive_step(w, m, v, opt.lr * opt.adam_correction(), opt.tau)


@server_rule("yogi", default_lr=0.01, reads=("beta1", "beta2", "tau", "v0"))
def yogi(w: torch.Tensor, d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> None:
    m = _first_moment(d, state, opt)
    v = _second_moment(d, state, opt)
    s = torch.addcmul(v, d, d, value=-1).sign_().mul_(d)  # sign(v − Δ²)·Δ: one temporary
    v.addcmul_(s, d, value=-(1 - opt.beta2))               # v − (1−β2)·Δ²·sign(v − Δ²)
    _adaptive_step(w, m, v, opt.lr, opt.tau)


@server_rule("adagrad", default_lr=0.01, reads=("beta1", "tau", "v0"))
def adagrad(w: torch.Tensor, d: torch.Tensor, state: Moments, opt: ServerOptimizer) -> None:
    m = _first_moment(d, state, opt)
    v = _second_moment(d, state, opt).addcmul_(d, d)
    _adaptive_step(w, m, v, opt.lr, opt.tau)


@dataclass(eq=False)
class ServerOptimizer:
    kind: str = "fedavg"
    lr: float = 1.0                       # a config's default is the rule's (ServerConfig.effective_lr)
    momentum: float = 0.9                 # sgdm
    beta1: float = 0.9                    # adaptive rules: first moment
    beta2: float = 0.99                   # adam, yogi: second moment
    tau: float = 1e-3                     # adaptivity
    v0: float | None = None               # initial second moment; None: τ² (Reddi et al.); 0: Flower
    bias_correction: str | bool = "none"  # adam: "none" (Reddi), "adam" (Kingma & Ba), "flower"; True = "flower"
    steps: int = field(default=0, init=False)  # server steps taken (= Flower's server_round after a step)
    state: dict[str, Moments] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        entry = SERVER_OPTIMIZERS.get(self.kind)  # UnknownChoice (a ValueError) lists the choices
        self.rule: Rule = entry.update
        if isinstance(self.bias_correction, bool):
            self.bias_correction = "flower" if self.bias_correction else "none"
        self.correction: BiasCorrection = BIAS_CORRECTIONS.get(self.bias_correction)
        unread = unread_correction(self.kind, self.bias_correction)
        if unread:
            raise ValueError(unread)

    @property
    def initial_v(self) -> float:
        return self.tau ** 2 if self.v0 is None else float(self.v0)

    def adam_correction(self) -> float:
        """Factor on η at the current step, as the `bias_correction` entry computes it."""
        return self.correction(self.steps, self.beta1, self.beta2)

    @torch.no_grad()
    def step(self, params: Tensors, delta: Tensors) -> None:
        """Apply Δ to `params` in place (Δ is cast to each parameter's dtype and device)."""
        self.steps += 1
        for name, d in delta.items():
            w = params[name]
            state = self.state.get(name, {})
            self.rule(w, d.to(device=w.device, dtype=w.dtype), state, self)
            if state:
                self.state[name] = state

    @torch.no_grad()
    def check_step(self, params: Tensors, delta: Tensors, max_ratio: float | None = None) -> str | None:
        """Why applying Δ would break the global tensors — a value turning NaN/Inf, or a step longer
        than `max_ratio` × their norm (a diverging server lr) — or None. Tries the rule on copies,
        one tensor at a time, so nothing changes and the extra memory is one tensor's."""
        self.steps += 1  # the step being tried (bias correction reads it)
        step_sq = norm_sq = 0.0
        try:
            for name, d in delta.items():
                w = params[name]
                trial = w.clone()
                state = {k: v.clone() for k, v in self.state.get(name, {}).items()}
                self.rule(trial, d.to(device=w.device, dtype=w.dtype), state, self)
                if not bool(torch.isfinite(trial).all()):
                    return f"the server step would make {name!r} non-finite"
                step_sq += float(torch.linalg.vector_norm(trial - w, dtype=torch.float64)) ** 2
                norm_sq += float(torch.linalg.vector_norm(w, dtype=torch.float64)) ** 2
        finally:
            self.steps -= 1
        step, norm = math.sqrt(step_sq), math.sqrt(norm_sq)
        if max_ratio is not None and not step <= max_ratio * max(norm, 1.0):
            return (f"the server step ({step:.3g}) would be {step / max(norm, 1.0):.3g}× the global tensors' "
                    f"norm ({norm:.3g}); the limit is federation.max_step_ratio = {max_ratio:g}")
        return None

    def state_dict(self) -> dict:
        """{"steps": int, "state": {tensor name: {"m": Tensor, "v": Tensor}}}: loads with weights_only.
        The tensors are the live moments (as torch.optim's): save or copy them before the next step."""
        return {"steps": self.steps, "state": {name: dict(s) for name, s in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """A `state_dict()`, or the older {"m": {name: T}, "v": {name: T}} (its step count taken as 0)."""
        if "state" in state:
            moments = state["state"]
        else:
            moments = {}
            for key in ("m", "v"):
                for name, t in state.get(key, {}).items():
                    moments.setdefault(name, {})[key] = t
        self.steps = int(state.get("steps", 0))
        self.state = {name: {k: t.detach().clone() for k, t in s.items()} for name, s in moments.items()}
