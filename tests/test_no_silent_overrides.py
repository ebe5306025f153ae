"""No silent overrides (issue 25): a setting another setting makes meaningless is refused or warned
about by name, `model.init_from`'s tokenizer settings are the saved tokenizer's, and `plugins` are
imported from the config's own folder (recorded absolute, so Flower's processes find them too)."""
import os
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from fedsilo import cli
from fedsilo.config import ConfigError, load_config, to_toml, validate
from fedsilo.errors import ConfigWarning
from fedsilo.rundir.layout import RunDir, config_hash
from fedsilo.runs.studyfile import load_study

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- model.init_from and the task's tokenizer

def source_run(tmp_path: Path, task: str = 'name = "translation"\nvocab_size = 4000\n', config: bool = True) -> Path:
    """A run directory as the runner leaves it for a later init_from: a saved tokenizer and config.toml."""
    run = tmp_path / "generic"
    (run / "tokenizer").mkdir(parents=True)
    if config:
        (run / "config.toml").write_text(f"[task]\n{task}")
    return run


def nmt(source: Path | None, **task) -> dict:
    raw = {"task": {"name": "translation", "silos": ["ted"], **task}, "model": {}}
    if source is not None:
        raw["model"]["init_from"] = str(source)
    return raw


def test_a_tokenizer_key_other_than_the_saved_tokenizers_is_refused_naming_both_keys(tmp_path):
    source = source_run(tmp_path)
    with pytest.raises(ConfigError, match=r"task\.vocab_size = 300: not read, model\.init_from = .*generic.* "
                                          r"fitted with vocab_size = 4000 .*config\.toml"):
        validate(nmt(source, vocab_size=300))
    with pytest.raises(ConfigError, match=r"task\.tokenizer_domain = \"ted\": not read, model\.init_from"):
        validate(nmt(source / "best.pt", tokenizer_domain="ted"))  # a checkpoint file: its folder's tokenizer
    assert validate(nmt(source, vocab_size=4000)).task.vocab_size == 4000  # the same value says nothing new


def test_a_tokenizer_key_left_out_is_recorded_as_the_saved_tokenizers(tmp_path):
    source = source_run(tmp_path, 'name = "translation"\nvocab_size = 4000\ntokenizer_model = "bpe"\n')
    cfg = validate(nmt(source))
    assert (cfg.task.vocab_size, cfg.task.tokenizer_model, cfg.task.tokenizer_domain) == (4000, "bpe", "news")
    recorded = tomllib.loads(to_toml(cfg))["task"]
    assert (recorded["vocab_size"], recorded["tokenizer_model"]) == (4000, "bpe")  # not the defaults 8000, unigram
    # Every path that reads the dump back (Flower's apps, workers, a study's runs) gets the same config.
    assert validate(tomllib.loads(to_toml(cfg)), "config from the ServerApp") == cfg


def test_resume_and_a_run_directorys_own_config_toml_still_validate(tmp_path):
    source = source_run(tmp_path)
    user = tmp_path / "fedavg.toml"
    user.write_text(f'[task]\nname = "translation"\nsilos = ["ted"]\n[model]\ninit_from = "{source}"\n')
    cfg = load_config(user)
    out = RunDir(tmp_path / "runs" / "fedavg")
    out.prepare(cfg, resume=False)
    out.prepare(load_config(user), resume=True)  # raises when the config differs from config.toml
    again = load_config(out.config)  # `fedsilo run RUN/config.toml --resume`: every key now explicit
    assert again == cfg and config_hash(again) == config_hash(cfg)


def test_without_a_record_of_the_saved_tokenizer_only_defaults_pass(tmp_path):
    source = source_run(tmp_path, config=False)
    with pytest.raises(ConfigError, match=r"task\.vocab_size = 300: not read.*holds no config\.toml"):
        validate(nmt(source, vocab_size=300))
    cfg = validate(nmt(source))
    assert cfg.task.vocab_size == 8000 and validate(tomllib.loads(to_toml(cfg))) == cfg


def test_without_a_saved_tokenizer_the_tasks_own_is_fitted_from_the_settings(tmp_path):
    (tmp_path / "best.pt").write_bytes(b"")  # a checkpoint file alone: the task's tokenizer is fitted as configured
    assert validate(nmt(tmp_path / "best.pt", vocab_size=300)).task.vocab_size == 300


def test_a_model_that_does_not_use_the_tasks_tokenizer_warns_about_its_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[task]\nname = "translation"\nvocab_size = 300\n[model]\nname = "tiny-t5"\n')
    with pytest.warns(ConfigWarning, match=r"task\.vocab_size = 300 has no effect: model 'tiny-t5' \(seq2seq\)"):
        cfg = load_config(path)
    assert cfg.task.vocab_size == 300  # nothing taken from anywhere: tiny-t5 uses MiniLM's tokenizer


# ---------------------------------------------------------------- other settings another setting overrides

@pytest.mark.parametrize("raw, message", [
    ({"federation": {"sample_count": 2, "sample_fraction": 0.5}},
     r"federation\.sample_fraction = 0\.5: not read, federation\.sample_count = 2"),
    ({"server": {"momentum": 0.5}}, r"server\.momentum = 0\.5: the 'fedavg' server optimizer does not read it"),
    ({"server": {"optimizer": "adagrad", "beta2": 0.9}}, r"server\.beta2 = 0\.9: the 'adagrad'"),
    ({"server": {"optimizer": "sgdm", "tau": 0.1}}, r"server\.tau = 0\.1: the 'sgdm'"),
    ({"client": {"steps": 5, "epochs": 3}}, r"client\.epochs = 3: nothing reads it \(steps = 5 is set"),
    ({"client": {"schedule_span": "round"}}, r"client\.schedule_span = \"round\": nothing reads it \(lr_schedule"),
    ({"client": {"pseudo_source": "own"}}, r"client\.pseudo_source = \"own\": nothing reads it \(there is no "
                                           r"before_training hook"),
    ({"client": {"batching": "shuffle", "length_window": 4}}, r"client\.length_window = 4: nothing reads it"),
    ({"client": {"steps": 5}, "clients": {"atis": {"epochs": 3}}}, r"clients\.atis\.epochs = 3: nothing reads it"),
])
def test_a_setting_no_code_reads_is_refused_by_name(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate(raw)


@pytest.mark.parametrize("raw", [
    {"federation": {"sample_count": 2}},
    {"server": {"optimizer": "sgdm", "momentum": 0.5}},
    {"server": {"optimizer": "adam", "beta2": 0.9, "tau": 0.1, "v0": 0.0}},
    {"server": {"momentum": 0.9}},  # the default: nothing is overridden (experiments/lorar/bench.toml)
    {"client": {"epochs": 3}, "clients": {"atis": {"steps": 5}}},  # epochs still read by the other silos
    {"client": {"lr_schedule": "linear", "schedule_span": "round"}},
    {"client": {"before_training": "pseudo_labels", "pseudo_source": "own"}},
    {"client": {"length_window": 4}},
])
def test_the_same_settings_where_they_are_read_pass(raw):
    validate(raw)


@pytest.mark.parametrize("raw, message", [
    ({"paradigm": "finetune", "federation": {"weighting": "equal"}},
     r"federation\.weighting = \"equal\" has no effect: paradigm = 'finetune' does not federate"),
    ({"paradigm": "finetune", "server": {"optimizer": "sgdm"}}, r"server\.optimizer = 'sgdm'.*not used"),
    ({"paradigm": "centralized", "clients": {"atis": {"epochs": 2}}},
     r"\[clients\.atis\] has no effect: paradigm = 'centralized' trains one pooled client"),
    ({"task": {"name": "matching"}, "model": {"d_model": 64}},
     r"model\.d_model = 64 has no effect: model 'minilm' \(encoder\)"),
    ({"model": {"name": "minilm2bert", "num_heads": 8}}, r"model\.num_heads = 8 has no effect: model 'minilm2bert'"),
])
def test_a_setting_a_common_setup_overrides_is_warned_about_as_the_file_loads(raw, message):
    with pytest.warns(ConfigWarning, match=message):
        validate(raw, "c.toml", warn=True)
    import warnings
    with warnings.catch_warnings():  # a process reading the run's config.toml back says nothing again
        warnings.simplefilter("error", ConfigWarning)
        validate(raw)


def test_the_cli_prints_a_warning_as_one_line(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('paradigm = "finetune"\n[federation]\nweighting = "equal"\n')
    (tmp_path / "taken").write_text("")
    assert cli.main(["run", str(config), "--out", str(tmp_path / "taken"), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"fedsilo: warning: {config}: federation.weighting = \"equal\" has no effect: paradigm = "
                      "'finetune' does not federate (each silo trains alone)")
    assert err[1].startswith("fedsilo: error:") and len(err) == 2


# ---------------------------------------------------------------- plugins from the config's folder

PLUGIN = """from fedsilo.paradigms import PARADIGMS, Paradigm
PARADIGMS.add("{name}", Paradigm(federates=True, pools_silos=False, per_silo_runs=False))
"""


def plugin_folder(tmp_path: Path, config: str) -> tuple[Path, str]:
    """A folder with a plugin module (registering a paradigm named after it) and `config` beside it;
    the module's name is new to this process, so nothing imported it before."""
    module = f"silo_plugin_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / f"{module}.py").write_text(PLUGIN.format(name=module))
    (folder / "run.toml").write_text(config.format(module=module))
    return folder, module


TOY = """plugins = ["tests.toytask", "{module}"]
name = "toy"
paradigm = "{module}"
[task]
name = "toyrank"
n_train = 8
n_eval = 4
[model]
d_model = 32
d_ff = 64
num_layers = 1
num_heads = 2
[client]
lr = 1e-3
batch_size = 4
optimizer = "adamw"
[federation]
rounds = 1
"""


def test_fedsilo_run_imports_a_plugin_beside_the_config_from_another_folder(tmp_path, monkeypatch):
    folder, module = plugin_folder(tmp_path, TOY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    assert cli.main(["run", str(folder / "run.toml"), "--out", "out", "--no-progress"]) == 0
    recorded = tomllib.loads((elsewhere / "out" / "config.toml").read_text())
    assert recorded["paradigm"] == module and recorded["plugin_dir"] == str(folder.resolve())


def test_a_run_directorys_config_finds_the_plugin_in_a_fresh_process_elsewhere(tmp_path):
    """What Flower's ServerApp and ClientApps do: read the run's config.toml in a process of their own,
    in another folder, without PYTHONPATH."""
    folder, module = plugin_folder(tmp_path, 'plugins = ["{module}"]\nparadigm = "{module}"\n')
    run_config = tmp_path / "config.toml"
    run_config.write_text(to_toml(load_config(folder / "run.toml")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys, tomllib; from fedsilo.config import validate; "
            "print(validate(tomllib.loads(open(sys.argv[1]).read()), 'config from the ServerApp').paradigm)")
    done = subprocess.run([sys.executable, "-c", code, str(run_config)], cwd="/", env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == module


def test_a_study_imports_a_plugin_beside_the_study_file(tmp_path, monkeypatch):
    study = '[study]\nname = "s"\n[base]\nplugins = ["{module}"]\n[variants.a]\nparadigm = "{module}"\n'
    folder, module = plugin_folder(tmp_path, study)
    monkeypatch.chdir(tmp_path)
    _, configs = load_study(folder / "run.toml")
    assert configs["a"].paradigm == module and configs["a"].plugin_dir == str(folder.resolve())


def test_a_plugin_that_cannot_be_imported_is_one_line_naming_it_and_the_folder(tmp_path, capsys):
    folder, _ = plugin_folder(tmp_path, 'plugins = ["no_such_plugin_here"]\n')
    assert cli.main(["run", str(folder / "run.toml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"plugins: cannot import 'no_such_plugin_here' (searched {folder.resolve()}, then the Python path)" in err


def test_plugin_dir_is_relative_to_the_config_and_left_out_of_what_a_resume_compares(tmp_path):
    folder, module = plugin_folder(tmp_path, 'plugins = ["{module}"]\nplugin_dir = "lib"\nparadigm = "{module}"\n')
    (folder / "lib").mkdir()
    (folder / f"{module}.py").rename(folder / "lib" / f"{module}.py")
    cfg = load_config(folder / "run.toml")
    assert cfg.plugin_dir == str((folder / "lib").resolve())
    moved = cfg.model_copy(update={"plugin_dir": str(tmp_path)})
    assert config_hash(moved) == config_hash(cfg)
    assert "plugin_dir" not in tomllib.loads(to_toml(validate({})))  # no plugins: config.toml as before
