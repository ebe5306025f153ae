"""Record-level differential privacy inside a silo: DP-SGD (Abadi et al. 2016) through Opacus.

Each optimiser step trains on a Poisson sample of the silo's examples (each taken independently with
probability q = batch_size / n: the sampling Opacus's RDP accountant assumes), clips each example's
gradient to C (`max_grad_norm`), adds Gaussian noise N(0, σ²C²) to the sum and divides by the
expected batch size. The silo's accountant (Opacus's `RDPAccountant`) composes every step it took, over
all its rounds and runs; its history (σ, q, steps) is the silo's privacy ledger (fedsilo.privacy.ledger),
outside the round-versioned store, so neither a resume nor a server's message can reset it.

Rows: one example may fill k rows of the model's batch (answer selection: a triple is a relevant and an
irrelevant pair, `rows_per_example = 2`). Opacus clips rows; clipping each row to C/k bounds an
example's gradient by C (triangle inequality), and noise of σ·k·(C/k) = σ·C keeps the ratio σ that the
accountant composes. A task's `example_losses` gives each example a loss that depends on it alone.

Clipping: `ghost` (Li et al. 2022; Bu et al. 2023) computes each row's gradient norm without its
gradient (Opacus's GradSampleModuleFastGradientClipping), then a second backward pass weighs each row
by its clip factor: memory as plain training. `per_example` keeps each row's gradient (Opacus's
GradSampleModule, functorch for layers it has no rule for). `auto`: ghost unless the model ties
parameters (the seq2seq models share their embedding with the output layer), which ghost cannot take.

What the guarantee covers: the tensors a silo uploads are a post-processing of the noisy steps. The
loss values a round logs are not: under DP a silo withholds them (ΔL, mean loss, terms), so a weighting
policy that reads them is refused (fedsilo.config). Regularisers on the parameters alone (FedProx's
μ/2‖w − w_t‖²) read no data: their gradient is added after the noise.
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import SiloRefused
from fedsilo.errors import ConfigError
from fedsilo.privacy.accountant import Budget, noise_for
from fedsilo.privacy.noise import SecretNormal

from .objective import objective_terms
from .schedule import StepSchedule
from .settings import DPSettings
from .train import LocalResult, TrainingParts, param_groups, to_device


class BudgetSpent(SiloRefused):
    """The silo's privacy budget does not allow another round: it refuses this and every later round."""
    final = True


def embedding_grad_sample(layer: torch.nn.Embedding, activations, backprops) -> dict:
    """Opacus's per-example gradient of an embedding, with the padding row's left at zero as torch's own
    backward leaves it (Opacus's rule gives it the pad positions' gradient: the seq2seq models start
    decoding from the pad token). Registered for every GradSampleModule of this process."""
    from opacus.grad_sample.embedding import compute_embedding_grad_sample

    out = compute_embedding_grad_sample(layer, activations, backprops)
    if layer.padding_idx is not None and layer.weight in out:
        out[layer.weight][:, layer.padding_idx] = 0
    return out


def sampling(settings: DPSettings, n_examples: int, batch_size: int) -> tuple[float, float]:
    """(q, δ): each example in a step with probability batch_size / n; δ given, else 1 / (10 n)."""
    return min(1.0, batch_size / n_examples), settings.delta if settings.delta is not None else 1 / (10 * n_examples)


def plan_budget(settings: DPSettings, n_examples: int, batch_size: int, steps_per_round: int, rounds: int,
                spent: list[tuple[float, float, int]] | tuple = ()) -> Budget:
    """σ for this silo: given, or the smallest (the search ends within 0.01 below the target) whose ε after
    `rounds` rounds of `steps_per_round` steps at q = batch_size / n, on top of what its privacy ledger
    has `spent` on the same data, stays within target_epsilon. The budget's history is `spent`."""
    q, delta = sampling(settings, n_examples, batch_size)
    sigma = settings.noise_multiplier
    if sigma is None:
        sigma = noise_for(settings.target_epsilon, delta, q, steps_per_round * rounds, spent)
    return Budget(float(sigma), q, delta, settings.target_epsilon, list(spent))


def check_budget(budget: Budget, steps: int, silo: str, round_idx: int) -> None:
    """Refuse the round (BudgetSpent) when its steps would take the silo past its target ε."""
    if budget.target_epsilon is None:
        return
    after = budget.epsilon(steps)
    if after > budget.target_epsilon * (1 + 1e-9):
        raise BudgetSpent(f"privacy budget: round {round_idx} ({steps} DP-SGD steps) would take {silo} to "
                          f"ε = {after:.3f} > its target ε = {budget.target_epsilon:g} (δ = {budget.delta:.3g}; "
                          f"ε so far {budget.epsilon():.3f}); it trains no more")


def ties_parameters(model: torch.nn.Module) -> bool:
    """Whether one trainable parameter belongs to two modules (tied embeddings)."""
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                if id(p) in seen:
                    return True
                seen.add(id(p))
    return False


def generator(settings: DPSettings, seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A source of the Poisson samples, or of seeded noise (see DPSettings.noise; secret noise comes
    from fedsilo.privacy.noise's SecretNormal)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if settings.seeded else int.from_bytes(os.urandom(8), "little"))
    return g


def secret_noise(optimizer, source: SecretNormal) -> None:
    """Opacus's `add_noise` (DPOptimizer and its ghost-clipping kind alike) with secret draws: the same
    std, N(0, (σ·C)²) added in float64 to each clipped sum, then rounded to the gradient's dtype."""
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    std = getattr(optimizer, "_adjusted_noise_multiplier", optimizer.noise_multiplier) * optimizer.max_grad_norm
    for p in optimizer.params:
        _check_processed_flag(p.summed_grad)
        summed = p.summed_grad
        p.grad = (summed.double() + source.normal(std, summed.shape, summed.device)).to(summed.dtype).view_as(p)
        _mark_as_processed(p.summed_grad)


def poisson_sample(n: int, q: float, g: torch.Generator) -> list[int]:
    """Each of n examples independently with probability q (possibly none)."""
    return torch.nonzero(torch.rand(n, generator=g) < q).flatten().tolist()


def finish_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                extra: Callable[[], Sequence[torch.Tensor] | None] | None, max_grad_norm: float | None) -> None:
    """After the noisy gradient is in place: the data-free gradients (regularisers), the post-processing
    clip of `client.max_grad_norm`, and the optimiser's own step."""
    grads = extra() if extra is not None else None
    if grads:
        for p, gr in zip(params, grads):
            if gr is not None:
                p.grad.add_(gr)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()


class PrivateSGD:
    """Opacus's per-example clipping and noise around the working model and its optimiser, for one
    round; `close` takes Opacus's hooks off the model (the in-process silos share it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, budget: Budget,
                 settings: DPSettings, rows_per_example: int, expected_batch: int,
                 g: torch.Generator | SecretNormal) -> None:
        # Opacus is imported here, not with fedsilo: it costs every process ~2.5 s of imports
        from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping, register_grad_sampler
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        register_grad_sampler(torch.nn.Embedding)(embedding_grad_sample)
        k, c = rows_per_example, settings.max_grad_norm
        self.model, self.rows = model, k
        self.params = [p for p in model.parameters() if p.requires_grad]
        tied = ties_parameters(model)
        if settings.clipping == "ghost" and tied:
            raise ValueError("dp.clipping = \"ghost\": this model ties parameters (its embedding is also its output "
                             "layer), which ghost clipping cannot take; use clipping = \"per_example\", \"loop\" or "
                             "\"auto\"")
        self.ghost = settings.clipping == "ghost" or (settings.clipping == "auto" and not tied)
        if self.ghost:
            self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                            strict=False, max_grad_norm=c / k, use_ghost_clipping=True)
            kind = DPOptimizerFastGradientClipping
        else:
            self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
            kind = DPOptimizer
        seeded = isinstance(g, torch.Generator)  # else secret noise: Opacus's draws from torch's generator replaced
        self.optimizer = kind(optimizer, noise_multiplier=budget.noise_multiplier * k, max_grad_norm=c / k,
                              expected_batch_size=expected_batch, loss_reduction="mean",
                              generator=g if seeded else None, secure_mode=True)
        if not seeded:
            self.optimizer.add_noise = functools.partial(secret_noise, self.optimizer, g)
        self.positions = [m.register_forward_pre_hook(with_positions, with_kwargs=True) for m in model.modules()
                          if {"input_ids", "position_ids"} <= set(inspect.signature(m.forward).parameters)]

    @property
    def mode(self) -> str:
        return "ghost" if self.ghost else "per_example"

    def backward_items(self, example_losses: Callable, items: Sequence, collate: Callable, device) -> torch.Tensor:
        return self.backward(example_losses, to_device(collate(list(items)), device), len(items))

    def backward(self, example_losses: Callable[[torch.nn.Module, dict], torch.Tensor], batch: dict,
                 n: int) -> torch.Tensor:
        """Per-example clipped gradients of Σ loss_i over the batch's n examples (kept for `step`);
        returns the examples' losses (detached)."""
        outputs: list = []
        hook = self.model.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        try:
            losses = example_losses(self.model, batch)
        finally:
            hook.remove()
        rows = _logits(outputs[0]).shape[0] if outputs else None
        if losses.shape != (n,) or rows != self.rows * n:
            raise ValueError(f"DP-SGD: the task gave {tuple(losses.shape)} losses and {rows} model rows for {n} "
                             f"examples; it must give one loss per example and {self.rows} row(s) each")
        with warnings.catch_warnings():
            # Opacus's hooks on the first layer see inputs that need no gradient (token ids): torch says so
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            try:
                out = self._backward(losses, outputs)
            except RuntimeError as err:  # inside Opacus's per-example rules: this model is not one it can take
                if not isinstance(err.__cause__ or err.__context__, Exception) and (err.__cause__ or err.__context__):
                    raise  # a Ctrl-C or SIGTERM that torch wrapped: the CLI ends it as the stop it is
                raise ConfigError(f"DP-SGD: Opacus cannot compute per-example gradients for this model ({type(self.model).__name__}: "
                                  f"{str(err).splitlines()[0]}); use dp.clipping = \"loop\" (or \"auto\")") from None
        self._check_rows(rows)
        return out

    def _check_rows(self, rows: int) -> None:
        """Every parameter's per-example gradient (or norm) has one entry per row: a layer that mixes the
        batch's rows (T5's relative attention bias, one table added to every row) cannot be clipped per
        example, and Opacus would fail later with a shape error, or worse, not at all."""
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            got = getattr(p, "_norm_sample" if self.ghost else "grad_sample", None)
            if isinstance(got, list):
                got = got[-1]
            if got is None or got.shape[0] != rows:
                raise ConfigError(f"DP-SGD: parameter {name!r} has no per-example gradient for the batch's {rows} rows "
                                 f"({'none' if got is None else got.shape[0]}): its layer mixes the rows of a batch "
                                 "(e.g. T5's relative attention bias), so Opacus cannot clip it per example; use "
                                 "dp.clipping = \"loop\" (or \"auto\")")

    def _backward(self, losses: torch.Tensor, outputs: list) -> torch.Tensor:
        if not self.ghost:
            losses.sum().backward()
            return losses.detach()
        # Ghost clipping: the first pass gives each row's gradient norm; the second weighs each row's
        # gradient by its clip factor, through the gradient at the model's output (rows do not mix)
        logits, seen = _logits(outputs[0]), []
        logits.register_hook(lambda grad: seen.append(grad))
        losses.sum().backward(retain_graph=True)
        for p in self.params:
            p.grad = None
        coef = self.gsm.get_clipping_coef().to(seen[0].device, seen[0].dtype)
        self.gsm.disable_hooks()
        try:
            torch.autograd.backward(logits, grad_tensors=seen[0] * coef.view(-1, *[1] * (seen[0].dim() - 1)))
        finally:
            self.gsm.enable_hooks()
        return losses.detach()

    def empty(self) -> None:
        """A Poisson sample with no example: the step is the noise alone (the accountant counts it)."""
        for p in self.params:
            if self.ghost:
                p.grad = torch.zeros_like(p)
            else:
                p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)

    def step(self, extra: Callable[[], Sequence[torch.Tensor] | None] | None = None,
             max_grad_norm: float | None = None) -> None:
        """Clip, noise, average; then the data-free gradients (regularisers), the post-processing clip of
        `client.max_grad_norm`, and the optimiser's own step."""
        self.optimizer.pre_step()
        finish_step(self.params, self.optimizer.original_optimizer, extra, max_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        for hook in self.positions:
            hook.remove()
        self.gsm._close()
        for p in self.params:
            for attr in ("summed_grad", "grad_sample", "_norm_sample", "_forward_counter"):
                if hasattr(p, attr):
                    delattr(p, attr)


class LoopSGD:
    """DP-SGD for any model: each example of the sample through its own forward and backward, its gradient
    clipped to C whole (all its rows together), the clipped sum plus N(0, σ²C²) over the expected batch.
    Slower than Opacus's batched rules (one pass per example), for the models they cannot take."""
    mode = "loop"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, budget: Budget,
                 settings: DPSettings, expected_batch: int, g: torch.Generator | SecretNormal) -> None:
        self.model, self.plain, self.g = model, optimizer, g
        self.sigma, self.clip, self.batch = budget.noise_multiplier, settings.max_grad_norm, expected_batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.summed = [torch.zeros_like(p) for p in self.params]

    def backward_items(self, example_losses: Callable, items: Sequence, collate: Callable, device) -> torch.Tensor:
        losses = []
        for item in items:
            loss = example_losses(self.model, to_device(collate([item]), device)).sum()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            norm = math.sqrt(sum(float(gr.double().pow(2).sum()) for gr in grads if gr is not None))
            scale = min(1.0, self.clip / (norm + 1e-6))
            for acc, gr in zip(self.summed, grads):
                if gr is not None:
                    acc.add_(gr, alpha=scale)
            losses.append(loss.detach())
        return torch.stack(losses)

    def empty(self) -> None:
        """Nothing sampled: the step is the noise alone."""

    def step(self, extra: Callable[[], Sequence[torch.Tensor] | None] | None = None,
             max_grad_norm: float | None = None) -> None:
        from opacus.optimizers.optimizer import _generate_noise  # Opacus's noise, in its secure mode (seeded)

        for p, acc in zip(self.params, self.summed):
            if isinstance(self.g, torch.Generator):
                p.grad = (acc + _generate_noise(self.sigma * self.clip, acc, self.g, secure_mode=True)) / self.batch
            else:
                p.grad = ((acc.double() + self.g.normal(self.sigma * self.clip, acc.shape, acc.device))
                          / self.batch).to(acc.dtype)
            acc.zero_()
        finish_step(self.params, self.plain, extra, max_grad_norm)
        self.plain.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.summed = []


def with_positions(_model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook: explicit position ids, one row per input row. BERT's default is one (1, L)
    row broadcast over the batch, which per-example clipping cannot split by example."""
    ids = kwargs.get("input_ids")
    if ids is None or kwargs.get("position_ids") is not None or args:
        return None
    positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
    return args, {**kwargs, "position_ids": positions}


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def regularizer_grads(params: Mapping[str, torch.nn.Parameter], anchor: Tensors, regularizers: Sequence,
                      terms: Callable) -> Callable[[], list[torch.Tensor | None] | None]:
    """The gradient of the regularisers alone (no data), for `PrivateSGD.step`."""
    def grads():
        active = [t for t in regularizers if t.coef > 0]
        if not active:
            return None
        total = sum(terms({}, params, anchor, active).values())
        trainable = [p for p in params.values() if p.requires_grad]
        return list(torch.autograd.grad(total, trainable, allow_unused=True))
    return grads


def steps_per_round(n: int, batch_size: int, epochs: int, steps: int | None) -> int:
    """Expected-batch steps of one round: `steps`, else epochs × ⌈n / batch_size⌉."""
    return steps if steps else epochs * math.ceil(n / batch_size)


def train_private(model: torch.nn.Module, examples: Sequence, collate: Callable[[Sequence], dict], task,
                  budget: Budget, settings: DPSettings, *, steps: int, lr: float, batch_size: int,
                  lr_overrides: Mapping[str, float] | None = None, parts=None, weight_decay: float = 0.0,
                  anchor: Tensors | None = None, seed: int = 0, max_grad_norm: float | None = None,
                  optimizer_state: Callable[[torch.optim.Optimizer], None] | None = None,
                  on_step: Callable[[], None] | None = None, warmup: float = 0.0,
                  schedule_start: int = 0, schedule_total: int | None = None):
    """`steps` DP-SGD steps on Poisson samples of `examples`; the budget records them. Returns
    (LocalResult, the plain optimiser, whose state a silo may keep)."""
    parts = parts or TrainingParts()

    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    plain = parts.optimizer(param_groups(params, lr, lr_overrides or {}), lr, weight_decay)
    if optimizer_state is not None:
        optimizer_state(plain)
    schedule = StepSchedule(parts.schedule, plain, warmup, schedule_start, schedule_total or steps)
    g = generator(settings, seed)  # the Poisson samples
    noise = generator(settings, seed + 1, device) if settings.seeded else SecretNormal()  # fedsilo.privacy.noise
    dp = LoopSGD(model, plain, budget, settings, batch_size, noise) if settings.clipping == "loop" else \
        PrivateSGD(model, plain, budget, settings, task.rows_per_example, batch_size, noise)
    extra = regularizer_grads(params, anchor or {}, parts.regularizers, objective_terms)
    loss_sum, seen, last_lr = 0.0, 0, math.nan
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    try:
        with fork:
            torch.manual_seed(seed)  # dropout; restored on exit by fork_rng
            model.train()
            for _ in range(steps):
                picked = poisson_sample(len(examples), budget.sample_rate, g)
                if picked:
                    items = [examples[i] for i in picked]
                    try:
                        losses = dp.backward_items(task.example_losses, items, collate, device)
                    except ConfigError:  # a model Opacus's batched rules cannot take: `auto` goes on one by one
                        if not settings.falls_back or isinstance(dp, LoopSGD):
                            raise
                        dp.close()
                        plain.zero_grad(set_to_none=True)
                        dp = LoopSGD(model, plain, budget, settings, batch_size, noise)
                        losses = dp.backward_items(task.example_losses, items, collate, device)
                    loss_sum, seen = loss_sum + float(losses.sum()), seen + len(picked)
                else:
                    dp.empty()
                last_lr = plain.param_groups[0]["lr"]
                dp.step(extra, max_grad_norm)
                schedule.step()
                budget.spend(1)
                if on_step:
                    on_step()
    finally:
        dp.close()
        model.eval()
    result = LocalResult(n_examples=len(examples), steps=steps, mean_loss=loss_sum / seen if seen else math.nan,
                         lr=last_lr)
    return result, plain
