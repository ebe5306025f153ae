"""Record-level DP-SGD (fedsilo.client.private): the accountant against Google's dp-accounting, the
clipped per-example gradients against a per-example loop, the noise's scale, and the run-level
behaviour (ε per silo per round, a spent budget, resume, refusals)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, MarianConfig, MarianMTModel

from fedsilo.client.optim import sgd
from fedsilo.client.train import TrainingParts
from fedsilo.recipe import build_recipe
from fedsilo.client.private import PrivateSGD, plan_budget
from fedsilo.privacy.accountant import ORDERS, Budget
from fedsilo.client.settings import DPSettings
from fedsilo.config import ConfigError, validate
from fedsilo.runs.runner import run_experiment
from tests.test_plugins import PLUGINS, toy_config


# ---- the accountant ------------------------------------------------------------------------------

def google_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε from dp-accounting's RDP accountant (the same orders), composing Poisson-sampled Gaussians."""
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    for sigma, q, steps in history:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("history,delta", [
    ([(1.1, 0.01, 1000)], 1e-5),
    ([(0.657, 0.25, 24)], 1 / 320),
    ([(2.0, 1.0, 10)], 1e-6),           # q = 1: every example every step
    ([(0.8, 0.05, 300), (1.5, 0.05, 200)], 1e-5),  # a silo whose σ changed
])
def test_epsilon_equals_dp_accounting(history, delta):
    budget = Budget(*history[-1][:2], delta, history=list(history[:-1]))
    budget.spend(history[-1][2])
    assert budget.epsilon() == pytest.approx(google_epsilon(history, delta), rel=1e-3)


def test_noise_from_a_target_ends_at_the_target_and_a_round_past_it_is_refused():
    settings = DPSettings(target_epsilon=3.0)
    budget = plan_budget(settings, n_examples=200, batch_size=8, steps_per_round=25, rounds=4)
    assert budget.delta == pytest.approx(1 / 2000) and budget.sample_rate == pytest.approx(0.04)
    budget.spend(100)
    assert 2.98 <= budget.epsilon() <= 3.0   # Opacus's search stops within 0.01 below the target
    assert budget.epsilon(25) > 3.0          # a fifth round would pass it
    from fedsilo.client.private import BudgetSpent, check_budget
    with pytest.raises(BudgetSpent, match=r"round 5 .* ε = 3\.\d+ > its target ε = 3 .*trains no more"):
        check_budget(budget, 25, "bank", 5)


def test_budget_round_trips_through_the_store_meta():
    budget = Budget(0.9, 0.125, 1e-4, 5.0)
    budget.spend(3)
    budget.spend(4)  # merged with the same (σ, q)
    again = Budget.from_meta(json.loads(json.dumps(budget.to_meta())))
    assert again.history == [(0.9, 0.125, 7)] and again.epsilon() == budget.epsilon()


# ---- clipped per-example gradients against a loop --------------------------------------------

def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=1,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).train()


def tiny_marian() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MarianConfig(vocab_size=30, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                       attention_dropout=0.0, max_position_embeddings=16, pad_token_id=0, eos_token_id=1,
                       decoder_start_token_id=0, share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    return MarianMTModel(cfg).train()


class Pairs:
    """Answer selection's shape: each example is a relevant and an irrelevant pair (2 rows)."""
    rows_per_example = 2

    @staticmethod
    def example_losses(model, batch):
        pos, neg = model(**batch).logits.squeeze(-1).chunk(2)
        return torch.relu(1.0 - pos + neg)


class Sequences:
    rows_per_example = 1

    @staticmethod
    def example_losses(model, batch):
        from fedsilo.tasks.tokens import sequence_losses
        return sequence_losses(model, batch)


def pair_batch(n: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (2 * n, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 5:] = 0  # some padding
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def seq_batch(n: int) -> dict:
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(2, 30, (n, 5), generator=g)
    labels[0, 3:] = -100
    return {"input_ids": torch.randint(2, 30, (n, 6), generator=g), "attention_mask": torch.ones(n, 6, dtype=torch.long),
            "labels": labels}


def row_gradients(model, task, batch: dict, n: int) -> list[list[torch.Tensor]]:
    """For each example, each of its rows' gradient of that example's loss (the other rows held fixed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    k = task.rows_per_example
    out = []
    for i in range(n):
        rows = [i + j * n for j in range(k)]  # Pairs: row i (relevant) and row n + i (irrelevant)
        single = {key: v[rows] for key, v in batch.items()}
        grads = []
        for r in range(k):
            logits = model(**single).logits
            held = torch.stack([logits[j] if j == r else logits[j].detach() for j in range(k)])
            if k == 2:
                loss = torch.relu(1.0 - held[0] + held[1]).sum()
            else:
                loss = task.example_losses(model, single).sum()
            grads.append([g if g is not None else torch.zeros_like(p)
                          for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)])
        out.append(grads)
    return out


def flat_norm(ts: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))


@pytest.mark.parametrize("build,task,batch,clipping", [
    (tiny_bert, Pairs, pair_batch, "ghost"),
    (tiny_bert, Pairs, pair_batch, "per_example"),
    (tiny_marian, Sequences, seq_batch, "per_example"),
    (tiny_marian, Sequences, seq_batch, "auto"),  # tied embeddings: auto takes per-example clipping
], ids=["bert-ghost", "bert-per-example", "marian-per-example", "marian-auto"])
def test_clipped_gradient_sum_equals_a_per_example_loop(build, task, batch, clipping):
    n = 5
    model, data = build(), batch(n)
    rows = row_gradients(model, task, data, n)
    norms = sorted(flat_norm(g) for ex in rows for g in ex)
    c = norms[len(norms) // 2] * task.rows_per_example  # C/k at the median row norm: some rows clipped, some not
    k = task.rows_per_example
    expected = [sum(g[j] * min(1.0, (c / k) / (flat_norm(g) + 1e-6)) for ex in rows for g in ex)
                for j in range(len(rows[0][0]))]
    params = [p for p in model.parameters() if p.requires_grad]
    plain = torch.optim.SGD(params, lr=0.1)
    dp = PrivateSGD(model, plain, Budget(0.0, 0.5, 1e-5), DPSettings(noise_multiplier=1.0, max_grad_norm=c,
                                                                       clipping=clipping),
                    task.rows_per_example, expected_batch=4, g=torch.Generator().manual_seed(0))
    assert dp.ghost == (clipping == "ghost")
    try:
        dp.backward(task.example_losses, data, n)
        dp.optimizer.pre_step()  # σ = 0: Σ clipped / expected batch
        got = [p.grad * 4 for p in params]
    finally:
        dp.close()
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e.to(g.dtype), rtol=2e-4, atol=2e-6)
    assert not any(hasattr(p, "grad_sample") or hasattr(p, "_forward_counter") for p in params)  # hooks gone


def test_a_layer_that_mixes_the_batch_is_refused_by_name():
    """T5's relative attention bias is one table added to every row: no per-row gradient exists."""
    model = tiny_t5()
    dp = PrivateSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), Budget(1.0, 0.5, 1e-5),
                    DPSettings(noise_multiplier=1.0), 1, 4, torch.Generator())
    try:
        with pytest.raises(ConfigError, match="relative_attention_bias.weight' has no per-example gradient"):
            dp.backward(Sequences.example_losses, seq_batch(4), 4)
    finally:
        dp.close()


def test_ghost_clipping_refuses_a_model_that_ties_parameters():
    model = tiny_marian()
    with pytest.raises(ValueError, match="ties parameters"):
        PrivateSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), Budget(1.0, 0.5, 1e-5),
                   DPSettings(noise_multiplier=1.0, clipping="ghost"), 1, 4, torch.Generator())


@pytest.mark.parametrize("rows", [1, 2])
def test_noise_has_standard_deviation_sigma_times_c_over_the_expected_batch(rows):
    """An empty Poisson sample: the step is the noise alone, N(0, σ²C²) per coordinate / expected batch
    (also with 2 rows per example: rows are clipped to C/2, the noise stays σ·C)."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 200))
    params = [p for p in model.parameters() if p.requires_grad]
    sigma, c, batch = 2.0, 0.5, 8
    dp = PrivateSGD(model, torch.optim.SGD(params, lr=0.1), Budget(sigma, 0.1, 1e-5),
                    DPSettings(noise_multiplier=sigma, max_grad_norm=c), rows, batch, torch.Generator().manual_seed(3))
    try:
        dp.empty()
        dp.optimizer.pre_step()
        noise = torch.cat([p.grad.flatten() for p in params]).double() * batch
    finally:
        dp.close()
    n = noise.numel()
    assert n > 10_000
    assert noise.std().item() == pytest.approx(sigma * c, rel=0.03)
    assert abs(noise.mean().item()) < 4 * sigma * c / math.sqrt(n)


# ---- runs ----------------------------------------------------------------------------------------

def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def test_a_dp_run_reports_each_silos_epsilon_per_round_and_sends_no_loss(tmp_path):
    results = run_experiment(toy_config(client={"dp": {"target_epsilon": 4.0}}), tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    for silo in ("alpha", "beta", "gamma"):
        eps = [r["clients"][silo]["privacy"]["epsilon"] for r in rounds]
        assert 0 < eps[0] < eps[1] <= 4.0
        budget = Budget(rounds[1]["clients"][silo]["privacy"]["noise_multiplier"],
                        rounds[1]["clients"][silo]["privacy"]["sample_rate"], 1 / (10 * 8))
        budget.spend(int(rounds[1]["clients"][silo]["privacy"]["steps"]))
        assert eps[1] == pytest.approx(budget.epsilon(), rel=1e-12)
        for r in rounds:  # nothing computed from the records' losses leaves the silo
            entry = r["clients"][silo]
            assert entry["losses"] == [] and entry["delta_loss"] is None and entry["mean_loss"] is None \
                and entry["terms"] == {}
        assert results["privacy"][silo]["epsilon"] == eps[1]
    from fedsilo.runs.report import write_report
    report = write_report(tmp_path / "run").read_text()
    assert "ε" in report and f"{rounds[1]['clients']['alpha']['privacy']['epsilon']:.2f}" in report


def test_a_silo_past_its_target_stops_and_the_run_ends_when_none_is_left(tmp_path):
    # σ = 0.6, q = 0.5, 2 steps a round: ε(δ = 1/80) is 6.12 after round 1 and 9.25 after round 2
    cfg = toy_config(client={"dp": {"noise_multiplier": 0.6, "target_epsilon": 7.0}},
                     clients={"gamma": {"dp": {"noise_multiplier": 3.0, "target_epsilon": 7.0}}},
                     federation={"rounds": 4})
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    assert "privacy" in rounds[0]["clients"]["alpha"]
    second = rounds[1]["clients"]
    for silo in ("alpha", "beta"):
        assert second[silo].get("final") and "ε = 9.246 > its target ε = 7" in second[silo]["refused"]
    assert rounds[1]["applied"] and "privacy" in second["gamma"]  # the federation goes on with gamma
    assert len(rounds) == 4 and all(r["clients"]["gamma"].get("privacy") for r in rounds)
    assert all(set(r["clients"]) == {"gamma"} for r in rounds[2:])  # spent silos are not asked again
    assert results["privacy"]["alpha"]["round"] == 1 and results["privacy"]["gamma"]["round"] == 4
    assert "stopped" not in results

    # every silo spent: the run ends early, and a resume says it is finished
    cfg = toy_config(client={"dp": {"noise_multiplier": 0.6, "target_epsilon": 7.0}}, federation={"rounds": 5})
    results = run_experiment(cfg, tmp_path / "spent", show_progress=False)
    assert results["rounds"] == 2 and "every silo refused round 2" in results["stopped"]
    assert len(rounds_of(tmp_path / "spent")) == 2
    again = run_experiment(cfg, tmp_path / "spent", resume=True, show_progress=False)
    assert again == results and len(rounds_of(tmp_path / "spent")) == 2


def test_epsilon_after_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    from tests.killed_run import interrupted_in_round_two

    cfg = toy_config(client={"dp": {"target_epsilon": 5.0}}, federation={"rounds": 3})
    run_experiment(cfg, tmp_path / "whole", show_progress=False)
    interrupted_in_round_two(monkeypatch, cfg, tmp_path / "cut", loop="train_private")
    assert len(rounds_of(tmp_path / "cut")) == 1
    run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    for a, b in zip(rounds_of(tmp_path / "whole"), rounds_of(tmp_path / "cut"), strict=True):
        assert {c: e["privacy"] for c, e in a["clients"].items()} == {c: e["privacy"] for c, e in b["clients"].items()}


def test_seeded_noise_reproduces_a_run_and_secret_noise_does_not(tmp_path):
    def params(run):
        return torch.load(run / "checkpoint.pt", weights_only=True)["server"]["params"]

    for name, noise in (("a", "seeded"), ("b", "seeded"), ("c", "secret"), ("d", "secret")):
        run_experiment(toy_config(client={"dp": {"noise_multiplier": 1.0, "noise": noise}}, federation={"rounds": 1}),
                       tmp_path / name, show_progress=False)
    a, b, c, d = (params(tmp_path / x) for x in "abcd")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(c[k], d[k]) for k in c)


@pytest.mark.parametrize("sections,culprit", [
    ({"federation": {"weighting": "lorar"}}, "federation.weighting = 'lorar' reads each silo's delta_loss"),
    ({"client": {"dp": {"target_epsilon": 1.0}, "grad_accum": 2}}, "grad_accum = 2 is not supported"),
    ({"client": {"dp": {"target_epsilon": 1.0}, "objective": "meta_weighting"}}, "objective 'meta_weighting'"),
    ({"model": {"precision": "bf16"}}, "DP-SGD runs in fp32"),
    ({"client": {"dp": {"target_epsilon": 1.0}, "personal": {"coef": 0.1}}}, "after-training pass 'ditto'"),
    ({"client": {"dp": {}}}, "set target_epsilon"),
    ({"client": {"dp": {"target_epsilon": -1}}}, "target_epsilon"),
])
def test_combinations_the_accountant_does_not_cover_are_refused_by_name(sections, culprit):
    base = {"plugins": PLUGINS, "name": "toy", "task": {"name": "toyrank", "n_train": 8, "n_eval": 4},
            "model": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2},
            "client": {"dp": {"target_epsilon": 1.0}}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    with pytest.raises((ConfigError, ValueError), match=culprit):
        build_recipe(validate(base))


def test_dp_on_flower_simulation_equals_in_process_with_the_accountant_on_each_silo(tmp_path, monkeypatch):
    """Seeded noise, so both engines draw the same samples and noise: the same ε per silo per round and the
    same model; each silo's accountant history is in its own privacy ledger (its state folder), not the server's."""
    import os

    from tests.parity import local_and_simulation

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = toy_config(client={"dp": {"target_epsilon": 6.0, "noise": "seeded"}}, engine={"workers": 1})
    local, sim = local_and_simulation(cfg, tmp_path)
    for a, b in zip(rounds_of(local), rounds_of(sim), strict=True):
        assert {c: e["privacy"] for c, e in a["clients"].items()} == {c: e["privacy"] for c, e in b["clients"].items()}
    pa = torch.load(local / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(sim / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
    import tempfile

    from fedsilo.privacy.ledger import LEDGER_FILE, PrivacyLedger
    mine = PrivacyLedger(local / "privacy-ledger" / "alpha.jsonl").entries()  # in-process: in the run directory
    sim_state = Path(tempfile.gettempdir()) / "fedsilo-flower-state" / "alpha" / (sim / "run_id").read_text().strip()
    theirs = PrivacyLedger(sim_state / LEDGER_FILE).entries()  # simulation: in the silo's own state folder
    assert [e["mechanisms"] for e in theirs] == [e["mechanisms"] for e in mine]
    assert [(e["round"], e["mechanisms"][0]["sample_rate"], e["mechanisms"][0]["steps"]) for e in mine] == \
        [(1, 0.5, 2), (2, 0.5, 2)]
    assert not list(sim.glob("privacy-ledger/*"))  # never the server's


def tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=30, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
        feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0, decoder_start_token_id=0)).train()


def one_by_one(batch: dict, n: int, k: int) -> tuple[list[dict], object]:
    """The batch as n single examples (rows i, n + i, … of an example) and a collate that rebuilds batches."""
    items = [{key: v[[i + j * n for j in range(k)]] for key, v in batch.items()} for i in range(n)]

    def collate(chosen):
        return {key: torch.cat([c[key][j:j + 1] for j in range(k) for c in chosen]) for key in chosen[0]}
    return items, collate


@pytest.mark.parametrize("build,task,batch", [
    (tiny_bert, Pairs, pair_batch), (tiny_marian, Sequences, seq_batch), (tiny_t5, Sequences, seq_batch),
], ids=["bert-pairs", "marian", "t5"])
def test_the_loop_clips_each_examples_whole_gradient(build, task, batch):
    """clipping = "loop": each example's gradient (all its rows together) clipped to C, for any model."""
    from fedsilo.client.private import LoopSGD

    n = 5
    model, data = build(), batch(n)
    rows = row_gradients(model, task, data, n)
    whole = [[sum(g[j] for g in ex) for j in range(len(ex[0]))] for ex in rows]  # an example's gradient
    norms = sorted(flat_norm(w) for w in whole)
    c = norms[len(norms) // 2]
    expected = [sum(w[j] * min(1.0, c / (flat_norm(w) + 1e-6)) for w in whole) for j in range(len(whole[0]))]
    items, collate = one_by_one(data, n, task.rows_per_example)
    dp = LoopSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), Budget(0.0, 0.5, 1e-5),
                 DPSettings(noise_multiplier=1.0, max_grad_norm=c, clipping="loop"), 4, torch.Generator())
    losses = dp.backward_items(task.example_losses, items, collate, torch.device("cpu"))
    assert losses.shape == (n,)
    for e, got in zip(expected, dp.summed):
        torch.testing.assert_close(got, e.to(got.dtype), rtol=2e-4, atol=2e-6)


def test_auto_goes_on_one_example_at_a_time_for_a_model_opacus_cannot_take():
    """tiny-t5 under clipping = "auto": Opacus refuses its relative attention bias, the round trains by the loop."""
    from fedsilo.client.private import train_private

    model, data = tiny_t5(), seq_batch(6)
    items, collate = one_by_one(data, 6, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    budget = Budget(1.0, 0.5, 1e-5)
    result, _ = train_private(model, items, collate, Sequences, budget, DPSettings(noise_multiplier=1.0),
                              steps=3, lr=0.01, batch_size=3, parts=TrainingParts(optimizer=sgd))
    assert result.steps == 3 and budget.steps == 3
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="use dp.clipping = \"loop\""):  # q = 1: never an empty Poisson sample
        train_private(tiny_t5(), items, collate, Sequences, Budget(1.0, 1.0, 1e-5),
                      DPSettings(noise_multiplier=1.0, clipping="per_example"), steps=1, lr=0.01, batch_size=6,
                      parts=TrainingParts(optimizer=sgd))


def test_the_accountants_epsilon_is_opacuss_to_the_last_bit():
    """Budget.epsilon keeps each (σ, q)'s per-step RDP instead of asking Opacus's RDPAccountant again:
    over random histories (several mechanisms, q = 1, small and large δ) the ε is the very same float."""
    import random
    import warnings

    from opacus.accountants import RDPAccountant

    from fedsilo.privacy.accountant import ORDERS, Budget

    rng = random.Random(0)
    for _ in range(16):
        history = [(rng.uniform(0.3, 5), rng.choice([rng.uniform(0.001, 0.9), 1.0]), rng.randint(1, 500))
                   for _ in range(rng.randint(1, 4))]
        delta = rng.choice([1e-5, 1e-3, 0.01, 0.3])
        reference = RDPAccountant()
        reference.history = list(history)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = max(0.0, float(reference.get_epsilon(delta=delta, alphas=ORDERS)))
        assert Budget(1.0, 1.0, delta, history=history).epsilon() == expected
        sigma, q, steps = history[-1]
        assert Budget(sigma, q, delta, history=history[:-1]).epsilon(steps) == expected
