"""Bad input: one clear message naming the culprit, a non-zero exit, and nothing half-written."""
import json
import shutil

import pytest

from fedsilo.cli import main
from tests.synth import REAL, needs_real, tiny_config, write_silos


def toml_of(raw: dict) -> str:
    from fedsilo.config import to_toml, validate
    return to_toml(validate(raw))


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture()
def config_file(tmp_path):
    data = write_silos(tmp_path / "data")
    path = tmp_path / "exp.toml"
    path.write_text(toml_of(tiny_config(data, federation={"rounds": 1})))
    return path


def test_unknown_key_is_named(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[federation]\nroundz = 3\n")
    code, err = run_cli(capsys, "run", str(path))
    assert code == 2 and "federation.roundz" in err and "unknown key" in err


def test_impossible_value_is_named(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('[server]\noptimizer = "nadam"\n')
    code, err = run_cli(capsys, "run", str(path))
    assert code == 2 and "server.optimizer" in err and "nadam" in err


def test_bad_set_override(config_file, capsys):
    code, err = run_cli(capsys, "run", str(config_file), "--set", "federation.rounds=-1")
    assert code == 2 and "federation.rounds" in err


def test_missing_config_file(tmp_path, capsys):
    code, err = run_cli(capsys, "run", str(tmp_path / "nope.toml"))
    assert code == 2 and "nope.toml" in err


def test_malformed_record_names_file_and_record(tmp_path, config_file, capsys):
    data = tmp_path / "data"
    records = json.loads((data / "yelp.json").read_text())
    del records[3]["sql"]
    (data / "yelp.json").write_text(json.dumps(records))
    out = tmp_path / "run"
    code, err = run_cli(capsys, "run", str(config_file), "--out", str(out), "--no-progress")
    assert code == 2 and "yelp.json: record 3: missing key 'sql'" in err
    assert not (out / "checkpoint.pt").exists()


def test_corrupt_data_file(tmp_path, config_file, capsys):
    (tmp_path / "data" / "academic.json").write_text("[{not json")
    code, err = run_cli(capsys, "run", str(config_file), "--out", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and "academic.json" in err


def test_missing_data_file(tmp_path, config_file, capsys):
    (tmp_path / "data" / "restaurants-schema.csv").unlink()
    code, err = run_cli(capsys, "run", str(config_file), "--out", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and "restaurants-schema.csv" in err


def test_existing_run_needs_resume_and_resume_needs_same_config(tmp_path, config_file, capsys):
    out = str(tmp_path / "run")
    assert run_cli(capsys, "run", str(config_file), "--out", out, "--no-progress")[0] == 0
    code, err = run_cli(capsys, "run", str(config_file), "--out", out, "--no-progress")
    assert code == 2 and "--resume" in err
    code, err = run_cli(capsys, "run", str(config_file), "--out", out, "--resume", "--set", "client.lr=0.5",
                        "--no-progress")
    assert code == 2 and "config differs" in err
    code, err = run_cli(capsys, "run", str(config_file), "--out", out, "--resume", "--set",
                        "federation.rounds=2", "--no-progress")
    assert code == 0
    assert len((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()) == 2


def test_corrupt_checkpoint_is_named(tmp_path, config_file, capsys):
    out = tmp_path / "run"
    assert run_cli(capsys, "run", str(config_file), "--out", str(out), "--no-progress")[0] == 0
    (out / "checkpoint.pt").write_bytes(b"garbage")
    code, err = run_cli(capsys, "run", str(config_file), "--out", str(out), "--resume", "--no-progress")
    assert code == 2 and "checkpoint.pt" in err


def test_report_of_missing_dir(tmp_path, capsys):
    code, err = run_cli(capsys, "report", str(tmp_path / "nothing"))
    assert code == 2 and "nothing" in err




@needs_real
def test_data_command_with_corrupt_mirror(tmp_path, capsys):
    mirror = tmp_path / "mirror" / "text2sql"
    shutil.copytree(REAL, mirror)
    (mirror / "yelp.json").write_text("tampered")
    code, err = run_cli(capsys, "data", "text2sql", "--mirror", str(tmp_path / "mirror"),
                        "--dest", str(tmp_path / "dest"))
    assert code == 2 and "checksum mismatch" in err and "yelp.json" in err
    assert not (tmp_path / "dest" / "yelp.json").exists()
    assert (tmp_path / "dest" / "academic.json").exists()  # files verified before it are kept


def test_a_stop_signal_wrapped_by_a_library_still_ends_as_a_stop(monkeypatch, capsys, tmp_path):
    """torch turns an exception raised inside its C++ call (a SIGTERM landing in torch.save) into a
    RuntimeError; the command still ends as terminated (143) or interrupted (130), no traceback."""
    from fedsilo import cli, commands

    for stop, code, line in ((cli.Terminated(), 143, "terminated (SIGTERM)"), (KeyboardInterrupt(), 130, "interrupted")):
        def wrapped(args, stop=stop):
            try:
                raise stop
            except BaseException as inner:
                raise RuntimeError("torch: an exception was raised in a callback") from inner
        monkeypatch.setattr(commands, "cmd_report", wrapped)
        assert cli.main(["report", str(tmp_path)]) == code
        assert capsys.readouterr().err.startswith(f"fedsilo: {line}")

    def broken(args):
        raise RuntimeError("a real bug")
    monkeypatch.setattr(commands, "cmd_report", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["report", str(tmp_path)])
