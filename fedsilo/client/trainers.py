"""The train position of a silo's round: plain training or DP-SGD, one object each.

A trainer says what its round reports (DP-SGD: the accountant, never a loss computed on records), what
the silo's privacy ledger records of it (DP-SGD: σ, q, steps, δ; fedsilo.privacy.ledger) and what it
refuses (a round past its target ε); the silo's loop does not ask which one it holds.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from fedsilo.core.messages import ClientUpdate
from fedsilo.core.transforms import SiloRefused
from fedsilo.errors import ConfigError

from .private import Budget, check_budget, plan_budget, sampling, steps_per_round, train_private
from .train import TrainingParts, train_local

LEVEL = "record"  # the privacy ledger's level of DP-SGD's releases: neighbouring data sets differ in one record


@dataclass
class RoundWork:
    """A round's working values, passed along the pipeline's positions."""
    round: int
    seed: int
    run_seed: int                 # this silo's randomness this round (client_seed)
    received: dict
    state: object                 # the silo's stored state (ClientState)
    budget: Budget | None = None  # DP-SGD's accountant (None: no record-level DP)
    on_step: object = None


@dataclass(frozen=True)
class PlainTrainer:
    """Local training (fedsilo.client.train.train_local) under the silo's objective."""
    parts: TrainingParts = TrainingParts()  # optimiser, schedule, batch order, regularisers, resolved
    private = False                         # its updates are no DP release (no privacy ledger for them)

    def planned(self, client) -> Budget | None:
        """The accountant this round's config plans, before any history (None: no record-level DP)."""
        return None

    def accountant(self, client) -> Budget | None:
        """The silo's accountant for this round, from its privacy ledger (None: no record-level DP)."""
        return None

    def refuse(self, client, work: RoundWork) -> None:
        """Raise SiloRefused when the trainer cannot take this round (a spent budget)."""

    def projected_epsilon(self, client, work: RoundWork) -> float | None:
        """The silo's ε by the run's last round, as its policy reads it (None: no record-level DP)."""
        return None

    def accounted(self, client, work: RoundWork, steps: int) -> list[dict]:
        """What the privacy ledger records of this round's training (no DP: nothing)."""
        return []

    def train(self, client, work: RoundWork, items, collate, lengths, restore, span):
        cfg, received = client.cfg, work.received
        return train_local(
            client.model, items, collate, client.loss_fn, lengths=lengths, parts=self.parts,
            length_window=cfg.length_window, precision=client.precision,
            epochs=cfg.epochs, lr=cfg.lr, lr_overrides=client.private_lrs(), batch_size=cfg.batch_size,
            grad_accum=cfg.grad_accum, weight_decay=cfg.weight_decay, logging_steps=cfg.logging_steps,
            anchor={k: received[k] for k in received if k in client.shared_names},
            tracked_terms=cfg.tracked_terms, seed=work.run_seed, step_offset=span[2],
            max_grad_norm=cfg.max_grad_norm or None, optimizer_state=restore, on_step=work.on_step,
            max_steps=cfg.steps, warmup=cfg.warmup,
            schedule_start=span[0], schedule_total=span[1],
        )

    def update(self, client, result, values, work: RoundWork, **numbers) -> ClientUpdate:
        """n: the silo's own data (FedAvg's n_k, what it registered), not counting pseudo-labelled extras."""
        return ClientUpdate(values, len(client.examples), result.steps, result.losses, delta_loss=result.delta_loss,
                            mean_loss=result.mean_loss, terms=result.terms, **numbers)


@contextmanager
def _named(client):
    """A target ε no σ reaches, named with the silo: its δ (by default 1/(10·n)) depends on its size."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"silo {client.name}'s dp (n = {len(client.examples)} examples): {err}") from None


@dataclass(frozen=True)
class DPSGDTrainer(PlainTrainer):
    """DP-SGD (fedsilo.client.private): Poisson samples, clipped per-example gradients, noise; the silo's
    accountant over every release its privacy ledger holds for its data (all runs), σ fixed at this run's
    first DP release."""
    private = True

    def steps(self, client) -> int:
        cfg = client.cfg
        return steps_per_round(len(client.examples), cfg.batch_size, cfg.epochs, cfg.steps)

    def planned(self, client) -> Budget:
        cfg = client.cfg
        with _named(client):
            return plan_budget(cfg.dp, len(client.examples), cfg.batch_size, self.steps(client), client.rounds)

    def accountant(self, client) -> Budget:
        """History: every record-level release of the silo's scope (its data), every run; σ: this run's, or
        planned for this run's rounds on top of that history; δ: the scope's, pinned by its first release
        (a config without δ takes it; one with another δ is refused in `refuse`)."""
        ledger, n = client.ledger, len(client.examples)
        dp = self._dp(client)
        spent, ours = ledger.history(LEVEL), ledger.this_run(LEVEL)
        if not ours:
            with _named(client):
                return plan_budget(dp, n, client.cfg.batch_size, self.steps(client), client.rounds, spent)
        q, delta = sampling(dp, n, client.cfg.batch_size)
        return Budget(ours[0][0], q, delta, dp.target_epsilon, spent)

    @staticmethod
    def _dp(client):
        """The config's DP settings with δ unset taken from the scope's pinned δ."""
        dp, pinned = client.cfg.dp, client.ledger.pinned_delta(LEVEL)
        return dp.model_copy(update={"delta": pinned[0]}) if dp.delta is None and pinned else dp

    def refuse(self, client, work: RoundWork) -> None:
        """SiloRefused for a δ that is not the scope's, or one of 1/n or more (such a δ allows releasing a
        record outright); BudgetSpent before anything is trained when the round would pass the target ε."""
        delta, n, pinned = work.budget.delta, len(client.examples), client.ledger.pinned_delta(LEVEL)
        if pinned and abs(delta - pinned[0]) > 1e-12 * pinned[0]:
            raise SiloRefused(f"client.dp.delta = {delta:.3g}: silo {client.name}'s data spends its budget at "
                              f"δ = {pinned[0]:.3g}, pinned by its first release ({pinned[1]}); a message does "
                              "not change it")
        if delta * n >= 1:
            raise SiloRefused(f"client.dp.delta = {delta:.3g}: at least 1/n for silo {client.name}'s n = {n} "
                              "examples, a δ that allows releasing one of them outright; it trains nothing")
        check_budget(work.budget, self.steps(client), client.name, work.round)

    def projected_epsilon(self, client, work: RoundWork) -> float:
        """ε by the run's last round, counting the round asked even when `rounds` is below its index."""
        left = max(1, client.rounds - work.round + 1) * self.steps(client)
        return work.budget.epsilon(left)

    def accounted(self, client, work: RoundWork, steps: int) -> list[dict]:
        b = work.budget
        return [{"level": LEVEL, "noise_multiplier": b.noise_multiplier, "sample_rate": b.sample_rate, "steps": steps,
                 "delta": b.delta, "target_epsilon": b.target_epsilon}]

    def train(self, client, work: RoundWork, items, collate, lengths, restore, span):
        cfg, received = client.cfg, work.received
        return train_private(
            client.model, items, collate, client.task, work.budget, cfg.dp, steps=self.steps(client),
            lr=cfg.lr, lr_overrides=client.private_lrs(), batch_size=cfg.batch_size, parts=self.parts,
            weight_decay=cfg.weight_decay,
            anchor={k: received[k] for k in received if k in client.shared_names}, seed=work.run_seed,
            max_grad_norm=cfg.max_grad_norm or None, optimizer_state=restore, on_step=work.on_step,
            warmup=cfg.warmup, schedule_start=span[0], schedule_total=span[1])

    def update(self, client, result, values, work: RoundWork, **numbers) -> ClientUpdate:
        """What leaves: the noisy model and the accountant's ε; no loss computed on records."""
        numbers.pop("personal_terms", None)
        return ClientUpdate(values, len(client.examples), result.steps, privacy=work.budget.record(), **numbers)
