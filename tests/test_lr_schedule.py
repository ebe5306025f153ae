"""Client learning-rate schedules: their values, their span across rounds, per-group rates, resume."""
import json
import math

import pytest
import torch

from fedsilo.client.optim import adamw
from fedsilo.client.schedule import LR_SCHEDULES, StepSchedule, constant
from fedsilo.client.silo import SiloClient
from fedsilo.client.store import MemoryStore
from fedsilo.client.train import TrainingParts, train_local
from fedsilo.client.settings import ClientConfig, PersonalConfig
from fedsilo.config import ConfigError, validate
from fedsilo.core.exchange import ExchangePlan
from fedsilo.recipe import silo_recipe
from fedsilo.runs.runner import run_experiment
from tests.killed_run import interrupted_in_round_two
from tests.synth import tiny_config, write_silos


def rates(name, warmup, start, total, steps, base=(0.1,)):
    """Each group's rate at `steps` successive optimiser steps from `start`."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in base]
    opt = torch.optim.SGD(groups, lr=base[0])
    schedule = StepSchedule(LR_SCHEDULES.get(name), opt, warmup, start, total)
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        schedule.step()
    return seen


def test_linear_warms_up_then_decays_to_zero():
    lr = [r[0] for r in rates("linear", 0.1, 0, 100, 100)]
    assert lr[0] == 0.0 and lr[5] == pytest.approx(0.05)      # warm-up from 0
    assert lr[10] == pytest.approx(0.1)                         # its end: the peak rate
    assert lr[55] == pytest.approx(0.05)                        # half-way through the decay
    assert lr[99] == pytest.approx(0.1 / 90) and lr[99] < lr[98]  # the last step: near 0


def test_cosine_is_at_half_the_rate_half_way_through_its_decay():
    lr = [r[0] for r in rates("cosine", 0.1, 0, 100, 100)]
    assert lr[0] == 0.0 and lr[10] == pytest.approx(0.1)
    assert lr[55] == pytest.approx(0.05)
    assert lr[99] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 89 / 90))) and lr[99] < 1e-4


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_a_schedule_rebuilt_at_a_step_continues_where_it_stopped(name):
    """Nothing of a scheduler is saved: one built at step k gives the rates an unbroken one gives."""
    assert rates(name, 0.2, 0, 30, 30)[13:] == rates(name, 0.2, 13, 30, 17)


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_steps_past_the_end_keep_the_last_steps_rate(name):
    last = rates(name, 0.1, 0, 20, 20)[-1]
    assert last[0] > 0
    assert rates(name, 0.1, 18, 20, 6)[1:] == [last] * 5   # not 0, and a cosine does not rise again
    assert rates(name, 0.1, 50, 20, 3) == [last] * 3


def test_each_group_keeps_its_own_base_rate():
    for step in rates("cosine", 0.1, 0, 40, 40, base=(0.1, 0.003)):
        assert step[1] == pytest.approx(step[0] * 0.03)


def test_constant_attaches_nothing():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}]
    opt = torch.optim.SGD(groups, lr=0.1)
    StepSchedule(constant, opt, 0.0, 7, 20).step()
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]


# --- through the client: the rates an optimiser step actually used -------------------------------

class Slope(torch.nn.Module):
    """loss = w + v: every SGD step moves each parameter by exactly minus its learning rate."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.v = torch.nn.Parameter(torch.zeros(1))


class SlopeTask:
    name = "slope"

    @staticmethod
    def collate(batch):
        return {}

    @staticmethod
    def loss(model, batch):
        return {"task": model.w.sum() + model.v.sum()}


def slope_client(rounds=2, n=4, private=(), **cfg):
    cfg = ClientConfig(**{"lr": 0.1, "batch_size": 1, "optimizer": "sgd", "max_grad_norm": 0, **cfg})
    model = Slope().double()
    plan = ExchangePlan(shared=("*",), private=private)
    initial = {k: torch.zeros(1, dtype=torch.float64) for k in private}
    with torch.no_grad():  # the private tensors start at zero
        for k, p in model.named_parameters():
            if k in initial:
                p.copy_(initial[k])
    return SiloClient("c", SlopeTask, list(range(n)), model, MemoryStore(), silo_recipe(cfg, plan, rounds=rounds))


def used_rates(client, round_idx, name="w"):
    """The rate of each optimiser step of one round: main training, then a personal model's (each
    parameter's step is minus its rate, from where that training started)."""
    client.store.set_round(round_idx)
    state = client.store.get(client.name)
    kept = {k: (state.slot(k) or {}).get(name) if state else None for k in ("own", "personal")}
    starts = [0.0 if name in client.shared_names or kept["own"] is None else kept["own"].item()]
    param = dict(client.model.named_parameters())[name]
    after = []
    received = {k: torch.zeros(1, dtype=torch.float64) for k in client.shared_names}
    update = client.fit(round_idx, received, seed=0, on_step=lambda: after.append(param.item()))
    before = starts + after[:-1]
    if client.cfg.personal is not None:  # v starts from the last personal model (in round 1: received)
        before[update.steps] = 0.0 if kept["personal"] is None else kept["personal"].item()
    return [round(x - y, 12) for x, y in zip(before, after)], update


def linear(step, total, warmup_steps, lr=0.1):
    return lr * (step / warmup_steps if step < warmup_steps else (total - step) / (total - warmup_steps))


def test_run_span_is_one_schedule_over_all_rounds():
    client = slope_client(rounds=2, lr_schedule="linear", warmup=0.25)   # 8 steps, 2 of warm-up
    (first, u1), (second, u2) = used_rates(client, 1), used_rates(client, 2)
    assert first + second == pytest.approx([linear(s, 8, 2) for s in range(8)])
    assert (u1.lr_last, u2.lr_last) == pytest.approx((first[-1], second[-1]))


def test_round_span_restarts_every_round():
    client = slope_client(rounds=2, lr_schedule="linear", warmup=0.25, schedule_span="round")  # 4 steps, 1 warm-up
    expected = pytest.approx([linear(s, 4, 1) for s in range(4)])
    assert used_rates(client, 1)[0] == expected and used_rates(client, 2)[0] == expected


def test_the_position_is_the_clients_own_steps_not_the_round_number():
    """A client sampled in rounds 1 and 3 only goes on at its step 4, as one sampled in 1 and 2 does."""
    skips, every = (slope_client(rounds=3, lr_schedule="cosine", warmup=0.1) for _ in range(2))
    assert used_rates(skips, 1)[0] == used_rates(every, 1)[0]
    assert used_rates(skips, 3)[0] == used_rates(every, 2)[0]


def test_server_rounds_span_is_at_the_servers_round_whatever_the_client_did():
    """FlowerTune's cosine over rounds: a client sampled in rounds 1 and 3 trains round 3 at round 3's
    rates (the run's last quarter of one schedule), not at its own step 4."""
    skips, every = (slope_client(rounds=3, lr_schedule="linear", warmup=0.25, schedule_span="server_rounds")
                    for _ in range(2))
    whole = [linear(s, 12, 3) for s in range(12)]  # 3 rounds x 4 steps, 3 of warm-up
    assert used_rates(skips, 1)[0] == pytest.approx(whole[:4])
    assert used_rates(skips, 3)[0] == pytest.approx(whole[8:])
    assert used_rates(every, 1)[0] + used_rates(every, 2)[0] + used_rates(every, 3)[0] == pytest.approx(whole)


def test_a_schedule_step_is_an_optimiser_step():
    plain = slope_client(n=4, lr_schedule="linear", warmup=0.25)
    accumulated = slope_client(n=8, grad_accum=2, lr_schedule="linear", warmup=0.25)  # 4 steps of 2 batches
    for r in (1, 2):
        assert used_rates(accumulated, r)[0] == pytest.approx(used_rates(plain, r)[0])


def test_private_lr_is_scaled_by_the_schedule_not_replaced():
    shared, private = (slope_client(private=("v",), private_lr=0.02, lr_schedule="linear", warmup=0.25)
                       for _ in range(2))
    for r in (1, 2):  # the kept v goes on from its own value in round 2
        w, v = used_rates(shared, r, "w")[0], used_rates(private, r, "v")[0]
        assert v == pytest.approx([0.2 * x for x in w]) and max(v) > 0


def test_personal_model_restarts_its_schedule_every_round():
    client = slope_client(rounds=2, lr_schedule="linear", warmup=0.25, personal=PersonalConfig(coef=0.0))
    first, second = used_rates(client, 1)[0], used_rates(client, 2)[0]
    assert first[:4] + second[:4] == pytest.approx([linear(s, 8, 2) for s in range(8)])
    assert first[4:] == second[4:] == pytest.approx([linear(s, 4, 1) for s in range(4)])


def test_constant_steps_at_the_configured_rate():
    client = slope_client(rounds=2)
    (first, update), (second, _) = used_rates(client, 1), used_rates(client, 2)
    assert first == second == [0.1] * 4 and update.lr_last is None


def test_constant_is_bit_identical_to_no_schedule():
    def train(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        data = [torch.randn(3) for _ in range(10)]
        loss = lambda m, b: {"task": (m(b["x"]) ** 2).mean()}  # noqa: E731
        _, opt = train_local(model, data, lambda b: {"x": torch.stack(b)}, loss, epochs=2, lr=0.05, batch_size=3,
                             lr_overrides={"2.weight": 0.01}, **{"parts": TrainingParts(optimizer=adamw), **kw})
        return model.state_dict(), opt
    (before, _), (after, opt) = train(), train(parts=TrainingParts(optimizer=adamw, schedule=constant), schedule_start=5,
                                                   schedule_total=9)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.01]
    assert not any("initial_lr" in g for g in opt.param_groups)


# --- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1.0, -0.1, 100])
def test_warmup_outside_zero_one_is_refused(value):
    with pytest.raises(ConfigError, match=r"client\.warmup: must be a fraction of the schedule's steps in \[0, 1\)"):
        validate({"client": {"lr_schedule": "linear", "warmup": value}})


def test_warmup_without_a_schedule_is_refused():
    with pytest.raises(ConfigError, match='warmup: set, but lr_schedule = "constant"'):
        validate({"client": {"warmup": 0.1}})


def test_schedule_settings_are_per_silo_and_checked_there():
    cfg = validate({"client": {"lr_schedule": "linear", "warmup": 0.1},
                    "clients": {"yelp": {"lr_schedule": "cosine", "schedule_span": "round"}}})
    assert (cfg.client_config("yelp").lr_schedule, cfg.client_config("yelp").schedule_span) == ("cosine", "round")
    assert (cfg.client_config("academic").lr_schedule, cfg.client_config("academic").schedule_span) == ("linear", "run")
    with pytest.raises(ConfigError, match=r"clients\.yelp\.warmup"):
        validate({"client": {"lr_schedule": "linear"}, "clients": {"yelp": {"warmup": 1.5}}})
    with pytest.raises(ConfigError, match="'step' is not a known learning-rate schedule; choose from 'constant'"):
        validate({"client": {"lr_schedule": "step"}})


# --- resume -----------------------------------------------------------------------------------

def test_resume_with_a_schedule_is_bit_identical(tmp_path, monkeypatch):
    """A run cut in round 2 and resumed ends where the unbroken run ends (the schedule is rebuilt at
    each client's persisted steps_done; the optimiser state persists too)."""
    data = write_silos(tmp_path / "data")
    cfg = validate(tiny_config(data, federation={"rounds": 3},
                               client={"optimizer": "adamw", "lr_schedule": "linear", "warmup": 0.2,
                                       "persist_optimizer": True}))
    run_experiment(cfg, tmp_path / "full", show_progress=False)
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "cut")
    run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    a, b = (torch.load(tmp_path / r / "checkpoint.pt", weights_only=True)["server"]["params"] for r in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [[json.loads(line)["clients"]["yelp"]["lr_last"] for line in
               (tmp_path / r / "rounds.jsonl").read_text().splitlines()] for r in ("full", "cut")]
    assert logged[0] == logged[1] and logged[0][0] > logged[0][1] > logged[0][2] > 0  # decaying over the run
