"""A second task family through the same plug-in points: a toy answer-selection task with an encoder
model, a model surgery, a round hook, personal models in a disk store, persistent optimiser state."""
import json

import pytest
import torch

import tests.toyplugins as toyplugins
from fedsilo.config import validate
from fedsilo.recipe import build_recipe
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.base import pool

PLUGINS = ["tests.toytask", "tests.toyplugins"]


def toy_config(**sections) -> dict:
    cfg = {
        "plugins": PLUGINS, "name": "toy", "seed": 5,
        "task": {"name": "toyrank", "n_train": 8, "n_eval": 4},
        "model": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2},
        "client": {"epochs": 1, "lr": 1e-3, "batch_size": 4, "optimizer": "adamw", "logging_steps": 1},
        "federation": {"rounds": 2, "weighting": "equal"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = validate(cfg)
    build_recipe(cfg)  # every combination check, as a run makes them
    return cfg


def rounds_of(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def checkpoint(run, name="checkpoint.pt"):
    return torch.load(run / name, weights_only=True)


def test_toy_task_runs_federated_with_pooled_metrics_from_stats(tmp_path):
    results = run_experiment(toy_config(), tmp_path / "run", show_progress=False)
    test = results["test"]
    assert [r["client"] for r in test["rows"]] == ["alpha", "beta", "gamma"]
    assert all(r["task"] == "toyrank" and r["stats"]["questions"] == 4 for r in test["rows"])
    pooled = pool([r["stats"] for r in test["rows"]])
    assert test["pooled"]["map"] == pytest.approx(100 * pooled["ap_sum"] / pooled["questions"])
    assert test["macro"]["map"] == pytest.approx(sum(r["metrics"]["map"] for r in test["rows"]) / 3)
    assert results["metric_spec"]["primary"] == "map" and results["metric_spec"]["selection"] == "macro"
    rounds = rounds_of(tmp_path / "run")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert [c["weight"] for c in r["clients"].values()] == pytest.approx([1 / 3] * 3)  # equal
        assert r["dev"]["score"] == r["dev"]["macro"]["map"]
        assert set(r["clients"]["alpha"]["terms"]) == {"task"}


def test_surgery_is_applied_seeded_and_its_tensors_federate(tmp_path):
    from fedsilo.recipe import build_model

    cfg = toy_config(model={"surgery": {"name": "test-adapter", "options": {"noise": 0.05}}},
                     federation={"rounds": 1})
    a, _ = build_model(cfg)
    b, _ = build_model(cfg)
    assert "classifier.0.weight" in dict(a.named_parameters())
    assert torch.equal(a.classifier[0].weight, b.classifier[0].weight)
    assert not torch.equal(a.classifier[0].weight, torch.eye(32))
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert "classifier.0.weight" in checkpoint(tmp_path / "run")["server"]["params"]


def test_surgery_options_are_validated():
    from fedsilo.config import ConfigError

    with pytest.raises(ConfigError, match="model.surgery"):
        toy_config(model={"surgery": {"name": "test-adapter", "options": {"nosie": 1}}})
    with pytest.raises(ConfigError, match="model.surgery.name.*'patchez'"):
        toy_config(model={"surgery": {"name": "patchez"}})


@pytest.mark.parametrize("source", ["global", "own"])
def test_round_hook_labels_with_the_chosen_model_and_sets_the_training_data(tmp_path, source):
    toyplugins.SEEN.clear()
    cfg = toy_config(client={"before_training": "test-twice", "pseudo_source": source,
                             "regularizers": {"personal": 0.1}},
                     exchange={"overwrite": "none"}, task={"silos": ["alpha", "beta"]})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    rounds = rounds_of(tmp_path / "run")
    # the hook doubled the training data: 8 questions at batch 4 → 4 steps instead of 2
    assert all(c["steps"] == 4 for r in rounds for c in r["clients"].values())
    assert [(s["client"], s["round"]) for s in toyplugins.SEEN] == \
        [("alpha", 1), ("beta", 1), ("alpha", 2), ("beta", 2)]
    round2 = [s for s in toyplugins.SEEN if s["round"] == 2]
    assert all(s["own"] for s in round2)  # personal models kept since round 1
    for s in round2:  # every tensor is shared here: the global labeler is exactly the received model
        assert (s["labeler_sum"] == pytest.approx(s["received_sum"], rel=1e-12)) == (source == "global")


def test_personal_models_live_in_the_disk_store_and_resume_bit_identical(tmp_path):
    def cfg(rounds):
        return toy_config(client={"regularizers": {"personal": 0.5}}, exchange={"overwrite": "none"},
                          federation={"rounds": rounds, "weighting": "loss"})

    run_experiment(cfg(3), tmp_path / "full", show_progress=False)
    run_experiment(cfg(1), tmp_path / "cut", show_progress=False)
    run_experiment(cfg(3), tmp_path / "cut", resume=True, show_progress=False)
    full, cut = checkpoint(tmp_path / "full"), checkpoint(tmp_path / "cut")
    assert all(torch.equal(full["server"]["params"][k], cut["server"]["params"][k]) for k in full["server"]["params"])
    store = full["clients"]["store"]
    assert (store["kind"], store["round"]) == ("disk", 3)  # the checkpoint refers to files
    assert sorted(store["files"]) == ["alpha", "beta", "gamma"]  # ...and their hashes
    from fedsilo.client.store import DiskStore

    for run in ("full", "cut"):
        files = sorted(p.name for p in (tmp_path / run / "clients" / "alpha").iterdir())
        best = checkpoint(tmp_path / run, "best.pt")["round"]
        assert files == sorted({f"round-{r:05d}.safetensors" for r in (3, best)})  # current + best only
    a, b = DiskStore(tmp_path / "full" / "clients"), DiskStore(tmp_path / "cut" / "clients")
    a.set_round(3)
    b.set_round(3)
    for silo in ("alpha", "beta", "gamma"):
        own_a, own_b = a.get(silo).slot("own"), b.get(silo).slot("own")
        assert "classifier.weight" in own_a and len(own_a) == len(full["server"]["params"])  # a whole model
        assert all(torch.equal(own_a[k], own_b[k]) for k in own_a)
    # weights are proportional to each client's mean training loss (FewFedWeight's δ)
    for r in rounds_of(tmp_path / "full"):
        losses = {c: v["mean_loss"] for c, v in r["clients"].items()}
        total = sum(losses.values())
        assert {c: v["weight"] for c, v in r["clients"].items()} == pytest.approx(
            {c: x / total for c, x in losses.items()})


def test_finetune_keeps_optimizer_state_across_rounds(tmp_path):
    cfg = toy_config(paradigm="finetune", task={"silos": ["alpha"]}, federation={"rounds": 3})
    run_experiment(cfg, tmp_path / "run", show_progress=False)
    from fedsilo.client.store import DiskStore

    store = DiskStore(tmp_path / "run" / "silos" / "alpha" / "clients")
    store.set_round(3)
    state = store.get("alpha")
    steps = {k: v for k, v in state.slot("optimizer").items() if k.endswith(".step")}
    assert steps and all(v.item() == 6 for v in steps.values())  # 2 steps a round, never restarted


def test_a_registered_after_training_pass_keeps_its_slot_and_evaluation_uses_it(tmp_path):
    cfg = toy_config(client={"after_training": "test-shrink", "after_training_options": {"factor": 0.0}},
                     federation={"rounds": 1})
    results = run_experiment(cfg, tmp_path / "run", show_progress=False)
    record = rounds_of(tmp_path / "run")[0]
    assert all(c["personal_terms"] == {"shrunk": 0.0} and "shrunk" in c["phase_seconds"]
               for c in record["clients"].values())
    # every client evaluates with its kept all-zero model: every candidate scores the same
    plain = run_experiment(toy_config(federation={"rounds": 1}), tmp_path / "plain", show_progress=False)
    assert results["test"]["macro"] != plain["test"]["macro"]


def test_after_training_settings_are_checked():
    from fedsilo.config import ConfigError

    with pytest.raises(ConfigError, match="after_training_options.factor"):
        toy_config(client={"after_training": "test-shrink", "after_training_options": {"factor": "big"}})
    with pytest.raises(ConfigError, match="personal` already asks for Ditto"):
        toy_config(client={"after_training": "test-shrink", "personal": {"coef": 0.1}})
    with pytest.raises(ConfigError, match="'nope' is not a known after-training pass"):
        toy_config(client={"after_training": "nope"})


def test_a_registered_paradigm_is_a_valid_choice_and_its_properties_drive_the_run(tmp_path):
    from fedsilo.config import ConfigError

    alone = run_experiment(toy_config(paradigm="test-alone", federation={"rounds": 1}), tmp_path / "alone",
                           show_progress=False)
    finetune = run_experiment(toy_config(paradigm="finetune", federation={"rounds": 1}), tmp_path / "ft",
                              show_progress=False)
    assert alone["paradigm"] == "test-alone" and set(alone["subruns"]) == {"alpha", "beta", "gamma"}
    assert alone["test"] == finetune["test"]
    with pytest.raises(ConfigError, match="'solo' is not a known paradigm; choose from 'federated'"):
        toy_config(paradigm="solo")


def test_a_round_hook_the_task_cannot_serve_is_refused_before_round_1(tmp_path):
    from fedsilo.config import ConfigError

    cfg = toy_config(client={"before_training": "pseudo_labels"})  # toyrank writes no pseudo labels
    with pytest.raises(ConfigError, match="'pseudo_labels': the toyrank task does not offer it .PseudoLabeling."):
        run_experiment(cfg, tmp_path / "run", show_progress=False)
    assert not (tmp_path / "run" / "rounds.jsonl").exists()
