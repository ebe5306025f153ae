import pytest
import torch

from fedsilo.client.objective import Term
from fedsilo.client.objective import prox as prox_term
from fedsilo.client.optim import sgd
from fedsilo.client.train import TrainingParts
from fedsilo.client.train import train_local
from tests.toy import TiedToy, ToyTask, toy_collate, toy_data


def test_prox_gradient_is_mu_times_distance():
    w = {"a": torch.tensor([1.0, 2.0], requires_grad=True)}
    anchor = {"a": torch.tensor([0.5, -1.0])}
    prox_term(w, anchor, 0.1).backward()
    assert w["a"].grad.tolist() == pytest.approx([0.05, 0.3])
    assert prox_term(w, anchor, 0.1).item() == pytest.approx(0.05 * (0.25 + 9.0))


def test_one_sgd_step_includes_prox_gradient():
    data = toy_data(4, seed=1)
    torch.manual_seed(0)
    model = TiedToy()
    params = dict(model.named_parameters())
    anchor = {k: v.detach().clone() + 0.5 for k, v in params.items()}  # global model elsewhere
    start = {k: v.detach().clone() for k, v in params.items()}
    # reference gradient of the data loss alone, at the start point
    model.zero_grad()
    model(**toy_collate(data)).loss.backward()  # batch = all 4 examples, order irrelevant for the mean
    grads = {k: p.grad.clone() for k, p in params.items()}
    mu, lr = 0.3, 0.1
    result, _ = train_local(model, data, toy_collate, ToyTask.loss, epochs=1, lr=lr, batch_size=4, anchor=anchor,
                            parts=TrainingParts(optimizer=sgd, regularizers=(Term("prox", prox_term, mu),)), max_grad_norm=None)
    for k, p in params.items():
        expected = start[k] - lr * (grads[k] + mu * (start[k] - anchor[k]))
        assert torch.allclose(p.detach(), expected, atol=1e-6), k
    # the logged loss includes the prox term, logged by name too
    prox = 0.5 * mu * sum(((start[k] - anchor[k]) ** 2).sum() for k in params)
    assert result.terms["prox"] == pytest.approx(float(prox), rel=1e-5)
    assert result.losses[0][1] == pytest.approx(round(result.terms["task"] + float(prox), 4), abs=1e-4)
