import tomllib
from pathlib import Path

import pytest

from fedsilo.config import ConfigError, apply_overrides, load_config, to_toml, validate
from fedsilo.server import sample_clients


def test_per_silo_overrides_keep_other_defaults():
    cfg = validate({"client": {"lr": 1e-4, "epochs": 12}, "clients": {"atis": {"epochs": 6}}})
    assert cfg.client_config("atis").epochs == 6 and cfg.client_config("atis").lr == 1e-4
    assert cfg.client_config("yelp").epochs == 12


def test_override_for_unknown_silo_is_named():
    with pytest.raises(ConfigError, match="clients.atlantis"):
        validate({"clients": {"atlantis": {"epochs": 1}}})
    # an override for a real silo left out of this run's subset is fine
    assert validate({"task": {"silos": ["yelp"]}, "clients": {"atis": {"epochs": 6}}}).task.silos == ["yelp"]


def test_unknown_or_repeated_silo_is_named():
    with pytest.raises(ConfigError, match="task.silos.*'atlantis'"):
        validate({"task": {"silos": ["yelp", "atlantis"]}})
    with pytest.raises(ConfigError, match="repeats"):
        validate({"task": {"silos": ["yelp", "yelp"]}})


def test_set_parses_toml_values():
    raw = apply_overrides({}, ["federation.rounds=5", "task.silos=['yelp', 'imdb']", "name=abc",
                               "client.lr=1e-3"])
    assert raw == {"federation": {"rounds": 5}, "task": {"silos": ["yelp", "imdb"]}, "name": "abc",
                   "client": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["federation.rounds"])


def test_resolved_config_round_trips(tmp_path):
    cfg = validate({"clients": {"yelp": {"lr": 0.5}}, "server": {"optimizer": "adam"}})
    assert validate(tomllib.loads(to_toml(cfg))) == cfg


def test_shipped_experiment_configs_are_valid():
    experiments = Path(__file__).resolve().parents[1] / "experiments"
    paths = sorted(experiments.rglob("*.toml"))
    assert len(paths) >= 3
    for path in paths:
        if "[study]" in path.read_text():  # a study: a base config and its variants
            from fedsilo.runs.studyfile import load_study
            assert load_study(path)[1]
        else:
            load_config(path)


def test_adaptive_server_lr_default():
    assert validate({"server": {"optimizer": "adam"}}).server.effective_lr == 0.01
    assert validate({"server": {"optimizer": "sgdm"}}).server.effective_lr == 1.0


def test_client_sampling_is_seeded_and_sized():
    clients = [f"c{i}" for i in range(8)]
    assert sample_clients(clients, 1, seed=0) == clients
    a = sample_clients(clients, 3, seed=0, count=2)
    assert len(a) == 2 and a == sample_clients(clients, 3, seed=0, count=2)
    assert a == [c for c in clients if c in a]  # kept in silo order
    assert len(sample_clients(clients, 3, seed=0, fraction=0.5)) == 4
    draws = {tuple(sample_clients(clients, r, seed=0, count=2)) for r in range(1, 20)}
    assert len(draws) > 3  # rounds draw different clients


def test_train_size_keeps_ratios_within_floor_and_cap():
    from fedsilo.tasks.text2sql.task import train_size

    task = validate({"task": {"train_fraction": 0.05, "min_train": 16, "max_train": 96}}).task
    sizes = {n: train_size(n, task) for n in (4347, 2629, 549, 499, 228, 120, 79, 78, 10)}
    assert sizes == {4347: 96, 2629: 96, 549: 28, 499: 25, 228: 16, 120: 16, 79: 16, 78: 16, 10: 10}
    assert train_size(500, validate({}).task) == 500


def test_model_device_auto_and_bad_name():
    import torch

    from fedsilo.models.seq2seq import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ConfigError, match="model.device"):
        resolve_device("nonsense")
