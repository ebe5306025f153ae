"""User-caused errors, given as a careless or hostile user would (issue 7, docs/reliability.md): each is
one `fedsilo: error:` line naming the culprit (key, file or path), exit code 2, no traceback, and
nothing half-written that a resume would trust."""
import errno
import gzip
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fedsilo.cli import main
from fedsilo.config import to_toml, validate
from fedsilo.datafetch import DataChangedWarning, DataError
from fedsilo.tasks import TASKS
from fedsilo.tasks.text2sql.data import EXEC_DB
from tests.synth import REAL, needs_real, tiny_config, write_silos
from tests.test_plugins import toy_config
from tests.test_text2sql_task import write_geography

ROOT = Path(__file__).resolve().parents[1]
HUGE = "100000000000000000000000000000"  # 10**30


def fails(capsys, *argv: str, culprit: str) -> str:
    """Run the CLI in-process; the one error line it printed, checked to name `culprit`."""
    code = main(list(argv))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("fedsilo: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert culprit in errors[0], errors[0]
    return errors[0]


def toy_file(tmp_path: Path, **sections) -> Path:
    """A one-round toyrank config (seconds to run) as a TOML file."""
    path = tmp_path / "toy.toml"
    path.write_text(to_toml(toy_config(**{"federation": {"rounds": 1}, **sections})))
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished one-round toy run, copied by the tests that damage it."""
    tmp = tmp_path_factory.mktemp("finished")
    assert main(["run", str(toy_file(tmp)), "--out", str(tmp / "run"), "--no-progress"]) == 0
    return tmp / "run"


def damaged_copy(finished_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


# ---- the config file and --set -----------------------------------------------------------------

@pytest.mark.parametrize("content", [os.urandom(2000), gzip.compress(b'name = "x"\n')], ids=["random", "gzip"])
def test_binary_config_file(tmp_path, capsys, content):
    path = tmp_path / "exp.toml"
    path.write_bytes(content)
    fails(capsys, "run", str(path), culprit=str(path))


def test_binary_config_file_end_to_end(tmp_path):
    """The real command (python -m fedsilo), so nothing between main and the shell adds a traceback."""
    path = tmp_path / "exp.toml"
    path.write_bytes(bytes(range(256)))
    done = subprocess.run([sys.executable, "-m", "fedsilo", "run", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"fedsilo: error: {path}: not a text (TOML) file"


def test_config_that_is_a_folder_or_nested_too_deeply(tmp_path, capsys):
    fails(capsys, "run", str(tmp_path), culprit="is a folder, not a config file")
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000 + "]" * 100_000)
    fails(capsys, "run", str(deep), culprit="nested too deeply")


def test_huge_seed(tmp_path, capsys):
    path = tmp_path / "exp.toml"
    path.write_text(f"seed = {HUGE}\n")
    fails(capsys, "run", str(path), culprit="seed")
    fails(capsys, "run", str(toy_file(tmp_path)), "--set", f"seed={HUGE}", culprit="seed")


@pytest.mark.parametrize("item", ["noequals", "=3", "seed.x=3"])
def test_malformed_set(tmp_path, capsys, item):
    fails(capsys, "run", str(toy_file(tmp_path)), "--set", item, culprit=f"--set {item!r}")


@pytest.mark.parametrize("item, key", [
    ("federation.rounds=true", "federation.rounds"),
    ("server.lr=inf", "server.lr"),
    ("client.lr=inf", "client.lr"),
    ("clients.alpha.lr=inf", "clients.alpha.lr"),          # per-silo overrides keep the bounds
    ("clients.alpha.batch_size=0", "clients.alpha.batch_size"),
    (f"client.grad_accum={HUGE}", "client.grad_accum"),    # overflowed inside torch mid-round
    (f"model.d_model={HUGE}", "model.d_model"),            # overflowed inside torch while building
    (f"model.num_layers={HUGE}", "model.num_layers"),      # ran out of memory while building
    ("client.private_lr=1e-3", "client.private_lr"),       # the run keeps no tensors: it would change nothing
    ("clients.alpha.private_lr=1e-3", "client.private_lr"),
])
def test_impossible_values(tmp_path, capsys, item, key):
    fails(capsys, "run", str(toy_file(tmp_path)), "--set", item, culprit=key)


# ---- the model and the exchange plan ---------------------------------------------------------------

@pytest.mark.parametrize("device", ["meta", *([] if torch.cuda.is_available() else ["cuda", "cuda:1"])])
def test_unusable_device_fails_before_the_run_starts(tmp_path, capsys, device):
    out = tmp_path / "run"
    fails(capsys, "run", str(toy_file(tmp_path, model={"device": device})), "--out", str(out), culprit="model.device")
    assert not (out / "config.toml").exists()


@pytest.mark.parametrize("key", ["shared", "private"])
def test_exchange_glob_matching_nothing(tmp_path, capsys, key):
    cfg = toy_file(tmp_path, exchange={key: ["encoder.nothing.*"]})
    fails(capsys, "run", str(cfg), "--out", str(tmp_path / "run"), culprit=f"exchange.{key}: 'encoder.nothing.*'")


# ---- the run directory -----------------------------------------------------------------------------

def test_out_is_a_file(tmp_path, capsys):
    out = tmp_path / "results.txt"
    out.write_text("keep me")
    fails(capsys, "run", str(toy_file(tmp_path)), "--out", str(out), culprit=str(out))
    assert out.read_text() == "keep me"


def test_resume_tolerates_a_partly_written_last_round(tmp_path, capsys, finished_run):
    """What a crash while appending to rounds.jsonl leaves."""
    run = damaged_copy(finished_run, tmp_path)
    with open(run / "rounds.jsonl", "a") as fh:
        fh.write('{"round": 2, "clie')
    code = main(["run", str(toy_file(tmp_path)), "--out", str(run), "--resume", "--set", "federation.rounds=2",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert [json.loads(line)["round"] for line in (run / "rounds.jsonl").read_text().splitlines()] == [1, 2]


# ---- fedsilo report on damaged run files -------------------------------------------------------------

def test_report_tolerates_a_partly_written_last_line(tmp_path, capsys, finished_run):
    run = damaged_copy(finished_run, tmp_path)
    with open(run / "rounds.jsonl", "a") as fh:
        fh.write('{"round": 2, "clie')
    assert main(["report", str(run)]) == 0
    assert "partly written last line" in (run / "report.md").read_text()


@pytest.mark.parametrize("damage, culprit", [
    (lambda run: run.joinpath("rounds.jsonl").write_text('{"round": 1, "cl\n{"round": 2}\n'), "rounds.jsonl:1"),
    (lambda run: run.joinpath("rounds.jsonl").write_bytes(bytes(range(256))), "rounds.jsonl: not a text file"),
    (lambda run: run.joinpath("rounds.jsonl").write_text('{"round": 1, "clients": {"alpha": {"weight": "x"}}}\n'),
     "rounds.jsonl:1: clients.alpha: 'weight' must be a number"),
    (lambda run: run.joinpath("results.json").write_text('{"name": "toy", "test": {"ro'), "results.json:1"),
    (lambda run: run.joinpath("results.json").write_text("[]"), "results.json:1: expected a JSON object"),
    (lambda run: run.joinpath("results.json").write_text('{"test": {"rows": [1]}}'), "results.json: test.rows[0]"),
    (lambda run: run.joinpath("results.json").write_text('{"metric_spec": {"columns": [{"key": "map", '
                                                         '"label": "MAP", "fmt": ".2q"}]}}'), "'fmt' '.2q'"),
    (lambda run: run.joinpath("config.toml").write_bytes(bytes(range(256))), "config.toml: not a text file"),
], ids=["bad-middle-line", "binary-rounds", "wrong-type", "truncated-results", "results-list", "results-rows",
        "results-format", "binary-config"])
def test_report_of_damaged_run_files(tmp_path, capsys, finished_run, damage, culprit):
    run = damaged_copy(finished_run, tmp_path)
    damage(run)
    fails(capsys, "report", str(run), culprit=culprit)


def test_report_where_plots_is_a_file(tmp_path, capsys, finished_run):
    run = damaged_copy(finished_run, tmp_path)
    shutil.rmtree(run / "plots")
    (run / "plots").write_text("not a folder")
    fails(capsys, "report", str(run), culprit=str(run / "plots"))


# ---- disk full ---------------------------------------------------------------------------------

def test_disk_full_while_checkpointing_keeps_the_last_good_round(tmp_path, capsys, monkeypatch):
    """ENOSPC on round 2's checkpoint: one line saying so and where; the partial .tmp is never
    trusted, and --resume (with space again) continues from round 1."""
    real_save = torch.save

    def save_until_full(state, f, *args, **kwargs):
        if Path(f.name).name == "checkpoint.pt.tmp" and state["round"] == 2:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write error names no file
        return real_save(state, f, *args, **kwargs)

    cfg, out = toy_file(tmp_path, federation={"rounds": 2}), tmp_path / "run"
    monkeypatch.setattr(torch, "save", save_until_full)
    line = fails(capsys, "run", str(cfg), "--out", str(out), "--no-progress", culprit="the disk is full")
    assert str(out / "checkpoint.pt") in line and "--resume" in line
    assert torch.load(out / "checkpoint.pt", weights_only=True)["round"] == 1
    assert not (out / "checkpoint.pt.tmp").exists()  # the partial file is removed, never trusted
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["run", str(cfg), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert json.loads((out / "results.json").read_text())["rounds"] == 2


def test_disk_full_while_writing_the_report(tmp_path, capsys, finished_run, monkeypatch):
    run = damaged_copy(finished_run, tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "report.md"))

    monkeypatch.setattr("fedsilo.runs.report.write_report", full)
    fails(capsys, "report", str(run), culprit=f"the disk is full (No space left on device) writing {run}/report.md")


# ---- text2sql data -------------------------------------------------------------------------------

@pytest.fixture()
def t2s(tmp_path) -> Path:
    """A one-round text2sql config over three synthetic silos in tmp_path/data."""
    data = write_silos(tmp_path / "data")
    path = tmp_path / "t2s.toml"
    path.write_text(to_toml(validate(tiny_config(data, federation={"rounds": 1}))))
    return path


def without_folds(path: Path, folds: set[str]) -> None:
    records = json.loads(path.read_text())
    for record in records:
        record["sentences"] = [s for s in record["sentences"] if s["question-split"] not in folds]
    path.write_text(json.dumps(records))


@pytest.mark.parametrize("damage, culprit", [
    (lambda data: data.joinpath("yelp.json").write_text("[]"), "yelp.json: no train / dev / test examples"),
    (lambda data: without_folds(data / "yelp.json", {"6", "7"}), "yelp.json: no dev examples"),
    (lambda data: data.joinpath("yelp.json").write_bytes(b"[\xff\xfe]"), "yelp.json"),
    (lambda data: data.joinpath("yelp-schema.csv").write_bytes(b"Table Name, Field Name\nT\xff, c\n"),
     "yelp-schema.csv: not a CSV text file"),
    (lambda data: data.joinpath("yelp-schema.csv").write_text("id;name\n1;x\n"), "yelp-schema.csv: line 1: expected"),
    (lambda data: data.joinpath("yelp-schema.csv").write_text(""), "yelp-schema.csv: line 1: expected"),
    (lambda data: data.joinpath("yelp-schema.csv").unlink(), "text2sql data file not found"),
    (lambda data: data.joinpath("yelp.json").write_text('[{"sql": ["S"], "sentences": [], "variables": 5}]'),
     "yelp.json: record 0: 'variables' must be a list"),
], ids=["empty-silo", "no-dev", "non-utf8-json", "non-utf8-csv", "wrong-columns", "empty-csv", "missing-file",
        "variables-not-a-list"])
def test_bad_silo_data_is_named_before_training(tmp_path, capsys, t2s, damage, culprit):
    damage(tmp_path / "data")
    out = tmp_path / "run"
    fails(capsys, "run", str(t2s), "--out", str(out), "--no-progress", culprit=culprit)
    assert not (out / "checkpoint.pt").exists()


@pytest.mark.parametrize("where", ["missing", "file"])
def test_data_dir_that_is_not_a_folder(tmp_path, capsys, t2s, where):
    path = tmp_path / "nowhere"
    if where == "file":
        path.write_text("x")
    fails(capsys, "run", str(t2s), "--set", f'task.data_dir="{path}"', culprit=f"task.data_dir: {path} is not a folder")


def verify(data_dir: Path, silos: list[str], **settings) -> None:
    """The text2sql plug-in's check of an explicit data_dir, as build_task runs it."""
    from fedsilo.tasks.text2sql.plugin import Text2SQLSettings
    TASKS.get("text2sql").data_dir(Text2SQLSettings(data_dir=str(data_dir), silos=silos, **settings))


@pytest.mark.filterwarnings("ignore::fedsilo.datafetch.DataChangedWarning")  # synthetic files
@pytest.mark.parametrize("db, culprit", [
    (b"junk" * 100, "not a readable SQLite database"),
    (b"", "has no tables"),  # an empty file is a valid, empty database
], ids=["junk", "empty"])
def test_execution_database_is_checked(tmp_path, db, culprit):
    data = write_geography(tmp_path)
    verify(data, ["geography"])
    (data / EXEC_DB["geography"]).write_bytes(db)
    with pytest.raises(DataError, match=culprit):
        verify(data, ["geography"])
    verify(data, ["geography"], exec_accuracy=False)  # not needed then: not checked


def test_missing_execution_database_says_how_to_go_without(tmp_path, capsys):
    data = write_geography(tmp_path / "data")
    (data / EXEC_DB["geography"]).unlink()
    cfg = tmp_path / "geo.toml"
    cfg.write_text(to_toml(validate(tiny_config(data, task={"silos": ["geography"]}, clients={}))))
    fails(capsys, "run", str(cfg), "--no-progress", culprit="exec_accuracy = false")


@needs_real
def test_edited_benchmark_file_is_warned_about_not_refused(tmp_path):
    for name in ("restaurants.json", "restaurants-schema.csv", "yelp.json", "yelp-schema.csv"):
        shutil.copy(REAL / name, tmp_path / name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataChangedWarning)
        verify(tmp_path, ["restaurants", "yelp"])  # pinned files: silent
    records = json.loads((tmp_path / "yelp.json").read_text())
    (tmp_path / "yelp.json").write_text(json.dumps(records[:-1]))
    with pytest.warns(DataChangedWarning, match=r"not the pinned benchmark files \(sha256\).*: yelp\.json$"):
        verify(tmp_path, ["restaurants", "yelp"])


def test_torch_wrapped_disk_full_is_reported_as_disk_full(tmp_path, monkeypatch):
    """On a real full disk torch.save raises a RuntimeError whose context is the OSError; RunDir.save
    turns it back into the OSError naming the checkpoint, and leaves no .tmp."""
    from fedsilo.rundir.layout import RunDir

    def full(state, f, *args, **kwargs):
        f.write(b"partial")
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None

    monkeypatch.setattr(torch, "save", full)
    run = RunDir(tmp_path)
    with pytest.raises(OSError) as caught:
        run.save(run.checkpoint, {"round": 1})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(run.checkpoint)
    assert not list(tmp_path.iterdir())
