"""The command line around `fedsilo deploy`: paths handed to Flower, progress while it runs,
help texts, --version, the data command's destination, and one-line errors."""
import argparse
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import fedsilo
from fedsilo import commands
from fedsilo.cli import main, parser
from fedsilo.engines.flower import deploy
from fedsilo.engines.flower.deploy import DeploymentError, LocalDeployment, RoundsPrinter
from tests.synth import tiny_config, write_silos

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"


def toml_of(raw: dict) -> str:
    from fedsilo.config import to_toml, validate
    return to_toml(validate(raw))


# ------------------------------------------------------------------------- the parser


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fedsilo {fedsilo.__version__}"


def _parsers(p: argparse.ArgumentParser, name: str = "fedsilo"):
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_of_every_command_has_help():
    seen = []
    for name, p in _parsers(parser()):
        for action in p._actions:
            label = action.option_strings or [action.dest]
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {label[0]}: no help text"
            seen.append((name, label[0]))
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{name} {choice.dest}: no help text"
    assert {n for n, _ in seen} == {"fedsilo", "fedsilo run", "fedsilo deploy", "fedsilo report", "fedsilo track", "fedsilo data",
                                    "fedsilo study", "fedsilo compare", "fedsilo init", "fedsilo export", "fedsilo generate",
                                    "fedsilo keys", "fedsilo keys new", "fedsilo keys roster", "fedsilo ledger",
                                    "fedsilo ledger show", "fedsilo ledger reset"}
    assert ("fedsilo deploy", "--no-progress") in seen and ("fedsilo deploy", "--workdir") in seen


def test_top_level_help_names_every_command_and_how_threads_are_chosen(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = text.split("COMMAND ", 2)[2].split(" (COMMAND --help")[0]  # the summary line of the commands
    assert sorted(listed.replace(" or ", ", ").split(", ")) == sorted(commands.choices)
    assert "engine.threads" in text and "threads // N" in text


def test_subcommands_keep_their_options():
    p = parser()
    a = p.parse_args(["deploy", "c.toml", "--set", "a=1", "--set", "b=2", "--out", "o", "--resume",
                      "--workdir", "w", "--no-progress"])
    assert (a.config, a.set, a.out, a.resume, a.workdir, a.no_progress) == ("c.toml", ["a=1", "b=2"], "o", True,
                                                                          "w", True)
    a = p.parse_args(["run", "c.toml", "--engine", "flower-sim", "--no-progress", "--resume", "--out", "o"])
    assert (a.engine, a.no_progress, a.resume, a.out) == ("flower-sim", True, True, "o")
    assert p.parse_args(["report", "r"]).run_dir == "r"
    a = p.parse_args(["data", "text2sql", "--mirror", "m", "--dest", "d"])
    assert (a.task, a.mirror, a.dest) == ("text2sql", "m", "d")


def test_usage_error_is_one_line_and_code_2(capsys):
    assert main(["deploy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: ") and "config" in err and err.count("\n") == 1


# ------------------------------------------------------------------------ fedsilo data


def test_data_names_its_destination_before_fetching(tmp_path, monkeypatch, capsys):
    import fedsilo.datafetch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mirror").mkdir()
    calls = []

    def fake_ensure(task, dest, mirror=None, *a, **k):
        calls.append((task, dest, mirror, capsys.readouterr().out))  # what was printed before fetching
        return dest

    monkeypatch.setattr(fedsilo.datafetch, "ensure", fake_ensure)
    assert main(["data", "text2sql", "--dest", "here/t2s", "--mirror", "mirror"]) == 0
    (task, dest, mirror, printed_before), = calls
    assert task == "text2sql" and dest == tmp_path / "here" / "t2s" and dest.is_absolute()
    assert str(tmp_path / "here" / "t2s") in printed_before and str(tmp_path / "mirror") in printed_before
    assert f"verified in {dest}" in capsys.readouterr().out


def test_data_destination_default_and_public_source(tmp_path, monkeypatch, capsys):
    import fedsilo.datafetch

    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "cache"))
    monkeypatch.setattr(fedsilo.datafetch, "find_mirror", lambda: None)
    printed = []
    monkeypatch.setattr(fedsilo.datafetch, "ensure",
                        lambda task, dest, mirror=None, **k: printed.append(capsys.readouterr().out) or dest)
    assert main(["data", "text2sql"]) == 0
    assert str(tmp_path / "cache" / "text2sql") in printed[0] and "public source" in printed[0]


def test_data_copies_from_a_mirror_into_the_named_destination(tmp_path, monkeypatch, capsys):
    """The real `ensure` with a one-file manifest: the file lands where the first line said."""
    import hashlib

    import fedsilo.datafetch

    body = b'{"tiny": true}\n'
    tasks = tmp_path / "tasks" / "text2sql"
    tasks.mkdir(parents=True)
    (tasks / "sources.tsv").write_text("path\tsize\tsha256\trepo\tpath-in-repo\tcommit\n"
                                       f"tiny.json\t{len(body)}\t{hashlib.sha256(body).hexdigest()}\t"
                                       "someone/somewhere\tdata/tiny.json\tabc123\n")
    (tmp_path / "mirror" / "text2sql").mkdir(parents=True)
    (tmp_path / "mirror" / "text2sql" / "tiny.json").write_bytes(body)
    monkeypatch.setattr(fedsilo.datafetch, "_TASKS_DIR", tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    assert main(["data", "text2sql", "--mirror", "mirror", "--dest", "dest"]) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    assert str(tmp_path / "dest") in first and "goes to" in first
    assert (tmp_path / "dest" / "tiny.json").read_bytes() == body and "copying tiny.json" in err


# ------------------------------------------------------------------ one-line errors


def test_malformed_rounds_log_is_one_line_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rounds.jsonl").write_text('{"round": 1, "clients": {}}\n{"round": 2, "cli\n{"round": 3, "clients": {}}\n')
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: ") and err.count("\n") == 1
    assert "rounds.jsonl:2" in err and "Traceback" not in err


def test_malformed_results_is_one_line_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rounds.jsonl").write_text('{"round": 1, "clients": {}}\n')
    (run / "results.json").write_text("{not json")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: ") and "results.json" in err and err.count("\n") == 1


def test_unknown_choice_is_a_user_error(monkeypatch, capsys):
    from fedsilo.registry import Registry

    def unknown(args):
        Registry("weighting policy").get("lorax")

    monkeypatch.setattr(commands, "cmd_report", unknown)
    assert main(["report", "anything"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: ") and "'lorax' is not a known weighting policy" in err


# ---------------------------------------------------------------------- paths handed to Flower


class RecordingDeployment(LocalDeployment):
    """Starts nothing: records every command it would run."""

    def _start(self, name, cmd, log_name=None):
        self.commands = {**getattr(self, "commands", {}), name: cmd}
        self.logs = {**getattr(self, "logs", {}), name: log_name or name}
        return SimpleNamespace(pid=4242)


def test_local_deployment_hands_flower_absolute_paths(tmp_path, monkeypatch):
    from flwr.common.config import parse_config_args

    monkeypatch.chdir(tmp_path)
    Path("my runs").mkdir()  # a space in a path, too
    Path("my runs/exp.toml").write_text("[federation]\nrounds = 2\n")
    dep = RecordingDeployment(Path("my runs/dep-flower/processes"), {"yelp": {"data-dir": "silo data"}})
    assert dep.workdir == tmp_path / "my runs" / "dep-flower" / "processes"
    assert dep.silos == {"yelp": {"data-dir": str(tmp_path / "silo data")}}
    assert dep.home.is_absolute() and deploy.flower_env(dep.home)["FLWR_HOME"] == str(dep.home)
    assert deploy.flower_env(dep.home)["FLWR_TELEMETRY_ENABLED"] == "0"
    # an unactivated venv: Flower finds its own executables (the SuperLink starts flower-superexec by name)
    monkeypatch.setenv("PATH", "/usr/bin")
    assert deploy.flower_env(dep.home)["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    dep.workdir.mkdir(parents=True)

    dep.start_supernode("yelp", {"data-dir": str(tmp_path / "silo data"), "silo-path": str(tmp_path / "my silo.csv")})
    cmd = dep.commands["supernode-yelp"]
    node = parse_config_args([cmd[cmd.index("--node-config") + 1]])
    assert node == {"silo": "yelp", "data-dir": str(tmp_path / "silo data"), "silo-path": str(tmp_path / "my silo.csv"),
                    "state-dir": str(dep.workdir / "state" / "yelp")}
    # its ClientApps come from fedsilo's warm SuperExec on the SuperNode's Runtime API, logging to the node's log
    assert cmd[cmd.index("--isolation") + 1] == "process"
    superexec = dep.commands["superexec-yelp"]
    assert superexec[:3] == [sys.executable, "-m", "fedsilo.engines.flower.warm"]
    assert superexec[superexec.index("--runtime-api-address") + 1] == f"127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    assert superexec[superexec.index("--parent-pid") + 1] == "4242" and dep.logs["superexec-yelp"] == "supernode-yelp"
    cold = RecordingDeployment(dep.workdir, {}, warm=False)
    cold.start_supernode("yelp", {})
    assert set(cold.commands) == {"supernode-yelp"} and "--isolation" not in cold.commands["supernode-yelp"]

    dep.submit(Path("my runs/exp.toml"), Path("my runs/dep"), overrides=["task.silos=[\"yelp\"]"])
    cmd = dep.commands["flwr-run"]
    app = Path(cmd[2])
    assert app == dep.workdir / "app" and (app / "pyproject.toml").is_file()
    rc = parse_config_args([cmd[cmd.index("--run-config") + 1]])
    assert rc == {"config": str(tmp_path / "my runs" / "exp.toml"), "out": str(tmp_path / "my runs" / "dep"),
                  "resume": False, "set": 'task.silos=["yelp"]'}


class FakeDeployment:
    """Stands in for LocalDeployment in the CLI: records what it was given, starts nothing."""
    seen: dict = {}

    def __init__(self, workdir, silos, warm=True):
        FakeDeployment.seen.update(workdir=workdir, silos=silos, warm=warm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        FakeDeployment.seen["stopped"] = True

    def run(self, config, out, resume=False, progress=True):
        FakeDeployment.seen.update(config=config, out=out, resume=resume, progress=progress,
                                   config_text=Path(config).read_text())
        Path(out).mkdir(parents=True, exist_ok=True)


def test_deploy_cli_resolves_a_relative_out(tmp_path, monkeypatch, capsys):
    """`fedsilo deploy exp.toml --out runs/dep` (the README's form), run from the config's folder
    with a relative data_dir: every path that reaches the deployment is absolute."""
    FakeDeployment.seen = {}
    monkeypatch.chdir(tmp_path)
    write_silos(tmp_path / "data")
    raw = tiny_config(Path("data"), federation={"rounds": 1})
    Path("exp.toml").write_text(toml_of(raw))
    monkeypatch.setattr(deploy, "LocalDeployment", FakeDeployment)
    monkeypatch.setattr(commands, "_report", lambda out, show=True: Path(out) / "report.md")
    assert main(["deploy", "exp.toml", "--out", "runs/dep", "--no-progress"]) == 0, capsys.readouterr().err
    seen = FakeDeployment.seen
    assert seen["out"] == tmp_path / "runs" / "dep"
    assert seen["workdir"] == tmp_path / "runs" / "dep-flower" / "processes"
    assert seen["config"] == tmp_path / "runs" / "dep-flower" / "config.toml"
    # every SuperNode reads the data folder where it is: nothing is copied
    assert seen["silos"] == {s: {"data-dir": str(tmp_path / "data")} for s in ("restaurants", "academic", "yelp")}
    assert not (tmp_path / "runs" / "dep-flower" / "silo-data").exists()
    assert f'data_dir = "{tmp_path / "data"}"' in seen["config_text"]
    assert seen["progress"] is False and seen["stopped"]
    assert seen["warm"] is True  # fedsilo's warm ClientApps unless --cold-clientapps
    assert f"run directory: {tmp_path / 'runs' / 'dep'}" in capsys.readouterr().out
    assert main(["deploy", "exp.toml", "--out", "runs/dep2", "--no-progress", "--cold-clientapps"]) == 0
    assert FakeDeployment.seen["warm"] is False


def test_deploy_without_results_is_an_error_quoting_the_log(tmp_path, monkeypatch, capsys):
    """A run that ends without results: `fedsilo: error:` naming flwr-run.log with its last lines."""
    monkeypatch.chdir(tmp_path)
    write_silos(tmp_path / "data")
    Path("exp.toml").write_text(toml_of(tiny_config(tmp_path / "data", federation={"rounds": 1})))

    def submit(self, config, out, overrides=(), resume=False):
        script = "print('Starting run'); print('ConfigError: model.name: no such model'); raise SystemExit(1)"
        return self._start("flwr-run", [sys.executable, "-c", script])

    def start(self):  # no SuperLink, no SuperNodes
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    monkeypatch.setattr(LocalDeployment, "start", start)
    monkeypatch.setattr(LocalDeployment, "submit", submit)
    assert main(["deploy", "exp.toml", "--out", "runs/dep"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    first, *rest = lines[next(i for i, ln in enumerate(lines) if ln.startswith("fedsilo: error:")):]
    log = tmp_path / "runs" / "dep-flower" / "processes" / "flwr-run.log"
    assert first == ("fedsilo: error: the Flower run ended without results: ConfigError: model.name: "
                     f"no such model; last lines of {log}:")
    assert [ln.strip() for ln in rest] == ["Starting run", "ConfigError: model.name: no such model"]
    assert "Traceback" not in err


# ------------------------------------------------------------------------- progress


def record(r, seconds, score=None, rejected=(), missing=()):
    return {"round": r, "seconds": seconds, "dev": None if score is None else {"score": score, "loss": 1.0},
            "clients": {"academic": {"weight": 0.5, **({"rejected": "NaN in update"} if "academic" in rejected
                                                       else {})}},
            "missing": list(missing), "missing_reasons": {m: "error: Node Unavailable" for m in missing}}


def test_rounds_printer_follows_an_appended_log_with_a_partial_last_line(tmp_path):
    path = tmp_path / "run" / "rounds.jsonl"
    stream = io.StringIO()
    printer = RoundsPrinter(path, total=3, stream=stream)
    assert printer.poll() == []  # no file yet
    path.parent.mkdir()
    one, two, three = (json.dumps(record(1, 31.04, 12.5)), json.dumps(record(2, 29.96, rejected=["academic"])),
                       json.dumps(record(3, 30.0, 25.0, missing=["yelp"])))
    with open(path, "a") as fh:
        fh.write(one + "\n" + two[:40])
        fh.flush()
        assert printer.poll() == ["round 1/3 done in 31.0s, dev score 12.50"]
        assert printer.poll() == []  # the partial line waits
        fh.write(two[40:])
        fh.flush()
        assert printer.poll() == []  # complete JSON but no newline yet
        fh.write("\n" + three + "\n")
        fh.flush()
    assert printer.poll() == ["round 2/3 done in 30.0s", "  rejected academic: NaN in update",
                              "round 3/3 done in 30.0s, dev score 25.00", "  missing yelp: error: Node Unavailable"]
    assert printer.poll() == []
    assert stream.getvalue().splitlines() == ["round 1/3 done in 31.0s, dev score 12.50", "round 2/3 done in 30.0s",
                                              "  rejected academic: NaN in update",
                                              "round 3/3 done in 30.0s, dev score 25.00",
                                              "  missing yelp: error: Node Unavailable"]


def test_rounds_printer_on_resume_skips_old_rounds_and_survives_a_rewrite(tmp_path):
    path = tmp_path / "rounds.jsonl"
    lines = [json.dumps(record(r, 10.0 + r)) for r in (1, 2, 3)]
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2] + "\n")
    printer = RoundsPrinter(path, total=4, stream=io.StringIO())
    assert printer.poll() == []  # rounds from before this run are not printed again
    tmp = path.with_name("rounds.tmp")  # a resume truncates the log atomically to the checkpoint's round
    tmp.write_text(lines[0] + "\n" + lines[1] + "\n")
    os.replace(tmp, path)
    with open(path, "a") as fh:
        fh.write(json.dumps(record(3, 9.5)) + "\n" + json.dumps(record(4, 8.25)) + "\n")
    assert printer.poll() == ["round 3/4 done in 9.5s", "round 4/4 done in 8.2s"]


def test_total_rounds_from_config_and_overrides(tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text("[federation]\nrounds = 6\n")
    assert deploy.total_rounds(config) == 6
    assert deploy.total_rounds(config, ["federation.rounds=8"]) == 8
    assert deploy.total_rounds(tmp_path / "none.toml") is None


def test_deployment_run_prints_rounds_while_waiting(tmp_path):
    """`LocalDeployment.run` with a stand-in for `flwr run` that writes rounds slowly."""
    out = tmp_path / "run"
    config = tmp_path / "exp.toml"
    config.write_text("[federation]\nrounds = 2\n")
    rounds = [json.dumps(record(1, 31.0, 12.5)), json.dumps(record(2, 30.0, 25.0, missing=["yelp"]))]
    script = (
        "import pathlib, sys, time\n"
        f"out = pathlib.Path({str(out)!r}); out.mkdir()\n"
        "fh = open(out / 'rounds.jsonl', 'a')\n"
        f"for line in {rounds!r}:\n"
        "    fh.write(line[:25]); fh.flush(); time.sleep(0.7)\n"
        "    fh.write(line[25:] + '\\n'); fh.flush(); time.sleep(0.7)\n"
        "(out / 'results.json').write_text('{}')\n"
    )

    class Scripted(LocalDeployment):
        def submit(self, config, out, overrides=(), resume=False):
            return self._start("flwr-run", [sys.executable, "-c", script])

    dep = Scripted(tmp_path / "fl", {})
    dep.workdir.mkdir()
    stream = io.StringIO()
    dep.run(config, out, stream=stream)
    submitted, *rounds = stream.getvalue().splitlines()
    assert submitted.startswith("run submitted") and str(dep.workdir / "flwr-run.log") in submitted
    assert rounds == ["round 1/2 done in 31.0s, dev score 12.50",
                                              "round 2/2 done in 30.0s, dev score 25.00",
                                              "  missing yelp: error: Node Unavailable"]
    dep.stop()


def test_deployment_that_ends_without_results_raises_with_log_tail(tmp_path):
    class Failing(LocalDeployment):
        def submit(self, config, out, overrides=(), resume=False):
            return self._start("flwr-run", [sys.executable, "-c", "print('line one'); print('the reason')"])

    dep = Failing(tmp_path / "fl", {})
    dep.workdir.mkdir()
    with pytest.raises(DeploymentError) as err:
        dep.run(tmp_path / "exp.toml", tmp_path / "run", progress=False)
    assert str(dep.workdir / "flwr-run.log") in str(err.value)
    assert str(err.value).splitlines()[-2:] == ["    line one", "    the reason"]
    assert isinstance(err.value, RuntimeError)


# ------------------------------------------------------------------- the real thing


def test_deploy_cli_with_a_relative_out_runs_to_results(tmp_path, monkeypatch, capsys):
    """The README's form end to end: `fedsilo deploy exp.toml --out runs/dep`, relative paths
    everywhere, a real SuperLink and three SuperNodes; progress lines while it runs."""
    monkeypatch.chdir(tmp_path)
    write_silos(tmp_path / "data")
    Path("exp.toml").write_text(toml_of(tiny_config(Path("data"), federation={"rounds": 1})))
    code = main(["deploy", "exp.toml", "--out", "runs/dep"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    assert [ln.split(" done in ")[0] for ln in err.splitlines() if ln.startswith("round ")] == ["round 1/1"]
    run = tmp_path / "runs" / "dep"
    test = json.loads((run / "results.json").read_text())["test"]
    assert [r["client"] for r in test["rows"]] == ["restaurants", "academic", "yelp"]
    assert (run / "report.md").is_file() and f"run directory: {run}" in out
    assert not (tmp_path / "runs" / "dep-flower" / "processes" / "runs").exists()  # nothing under a doubled path


def test_deploy_makes_local_paths_absolute_for_flowers_processes(tmp_path, monkeypatch):
    from fedsilo.config import validate
    monkeypatch.chdir(tmp_path)
    (tmp_path / "generic").mkdir()
    cfg = commands.absolute_config(validate({"task": {"data_dir": "data"}, "model": {"init_from": "generic/best.pt"}}))
    assert cfg.task.data_dir == str(tmp_path / "data")
    assert cfg.model.init_from == str(tmp_path / "generic" / "best.pt")


def test_fedsilo_data_knows_the_benchmarks_in_a_fresh_process():
    """The task choices come from the registry, which the CLI must fill itself (it did not, and `fedsilo
    data text2sql` was refused as an invalid choice unless something else had imported the plug-ins)."""
    import subprocess
    import sys

    code = "from fedsilo.cli import parser; print(parser().parse_args(['data', 'text2sql']).task)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "text2sql", done.stderr[-500:]
