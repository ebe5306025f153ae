"""The local loop: the Lorar authors' loss windows, gradient accumulation, named objective terms."""
import pytest
import torch

from fedsilo.client.objective import Term, prox
from fedsilo.client.optim import sgd
from fedsilo.client.train import TrainingParts
from fedsilo.client.train import LossLog, train_local
from fedsilo.core.weighting import delta_loss


class Counting(torch.nn.Module):
    """loss of the k-th batch = k (and a zero-gradient path through a parameter)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.calls = 0

    def loss(self, model, batch):
        self.calls += 1
        return {"task": self.calls + 0.0 * self.w.sum()}


def collate(batch):
    return {"x": torch.tensor(batch)}


def run(n_examples, epochs, batch_size=1, **kw):
    model = Counting()
    kw.setdefault("parts", TrainingParts(optimizer=sgd))
    result, _ = train_local(model, list(range(n_examples)), collate, model.loss, epochs=epochs, lr=0.1,
                            batch_size=batch_size, max_grad_norm=None, **kw)
    return result


def test_authors_ten_step_example():
    log = LossLog(every=4)
    for v in range(1, 11):
        log.record(float(v))
    assert [v for _, v in log.points] == [1.0, 3.0, 6.5]  # first step; steps 2-4; 5-8; 9-10 dropped
    assert delta_loss([v for _, v in log.points]) == 5.5


def test_windows_run_across_epochs_without_an_epoch_end_flush():
    result = run(5, epochs=2, logging_steps=4)  # 10 optimiser steps over two epochs of 5
    assert result.losses == [(1, 1.0), (4, 3.0), (8, 6.5)]
    assert result.delta_loss == 5.5 and result.steps == 10


def test_fewer_steps_than_a_window_logs_one_value():
    result = run(3, epochs=1, logging_steps=4)
    assert result.losses == [(1, 1.0)] and result.delta_loss == 0.0


def test_logged_values_are_rounded_to_four_decimals():
    log = LossLog(every=2)
    for v in (1.000049, 2.123456, 3.0):
        log.record(v)
    assert log.points == [(1, 1.0), (2, 2.1235)]


def test_step_offset_moves_the_plot_axis_only():
    result = run(5, epochs=1, logging_steps=4, step_offset=100)
    assert result.losses == [(101, 1.0), (104, 3.0)]


def test_gradient_accumulation_follows_the_trainer():
    # 5 batches per epoch, accumulate 2: steps after batches 2 and 4 of each epoch; batch 5's gradient
    # and loss carry into the next epoch's first step (3 batches), the last epoch's batch 5 is left over.
    result = run(5, epochs=2, grad_accum=2, logging_steps=1)
    assert result.steps == 4
    assert result.losses == [(1, (1 + 2) / 2), (2, (3 + 4) / 2), (3, (5 + 6 + 7) / 2), (4, (8 + 9) / 2)]


def test_short_epoch_steps_at_its_end():
    result = run(3, epochs=2, grad_accum=16, logging_steps=1)  # 3 batches < 16: one step per epoch
    assert result.steps == 2
    assert result.losses == [(1, (1 + 2 + 3) / 16), (2, (4 + 5 + 6) / 16)]


def test_terms_are_logged_by_name_and_tracked_terms_choose_the_logged_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    anchor = {k: v.detach().clone() + 1.0 for k, v in model.named_parameters()}  # ‖w − anchor‖² = 3 at start

    def loss(m, batch):
        return {"task": m(batch["x"]).pow(2).mean()}

    data = [[1.0, 0.0]] * 4
    common = dict(epochs=1, lr=0.0, batch_size=4, max_grad_norm=None, anchor=anchor,
                  parts=TrainingParts(optimizer=sgd, regularizers=(Term("prox", prox, 0.5),)))
    col = lambda b: {"x": torch.tensor(b)}  # noqa: E731
    with_prox, _ = train_local(model, data, col, loss, **common)
    task_only, _ = train_local(model, data, col, loss, tracked_terms=["task"], **common)
    assert set(with_prox.terms) == {"task", "prox"}
    assert with_prox.terms["prox"] == pytest.approx(0.5 / 2 * 3)  # μ/2‖w − w_t‖², lr 0: unchanged
    assert with_prox.mean_loss == pytest.approx(with_prox.terms["task"] + with_prox.terms["prox"])
    assert task_only.mean_loss == pytest.approx(task_only.terms["task"])
    assert task_only.terms["prox"] == pytest.approx(with_prox.terms["prox"])


def test_training_leaves_the_global_generator_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run(4, epochs=1, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_steps_per_round_repeat_passes_as_needed_and_stop_exactly():
    r = run(4, epochs=1, batch_size=2, max_steps=5)       # 2 steps per pass: 2.5 passes
    assert r.steps == 5
    r = run(4, epochs=9, batch_size=2, max_steps=3)       # steps win over epochs
    assert r.steps == 3
    r = run(8, epochs=1, batch_size=1, grad_accum=2, max_steps=3)
    assert r.steps == 3


def test_lr_overrides_put_named_parameters_in_their_own_group_in_model_order():
    from fedsilo.client.train import param_groups
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].bias.requires_grad_(False)
    groups = param_groups(dict(model.named_parameters()), 0.1, {"1.weight": 0.5, "0.weight": 0.5})
    assert [g["lr"] for g in groups] == [0.1, 0.5]
    assert groups[0]["params"] == [model[1].bias]  # the frozen bias is in no group
    assert groups[1]["params"] == [model[0].weight, model[1].weight]
    assert len(param_groups(dict(model.named_parameters()), 0.1, {})) == 1
