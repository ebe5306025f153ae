"""A buggy or hostile client cannot break the federation, and a run cannot lie about its state
(docs/reliability.md): poisoned and malformed updates, bounded self-reports, robust aggregation with
a Byzantine client, diverged runs, foreign checkpoints, one writer per run directory."""
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedsilo.cli import main
from fedsilo.config import ConfigError, to_toml
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.messages import ClientUpdate
from fedsilo.core.aggregate import AGGREGATIONS
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.server import Server
from tests.toy import server_with
from tests.killed_run import past_round_1
from tests.test_plugins import rounds_of, toy_config

ROOT = Path(__file__).resolve().parents[1]
HONEST = ("h1", "h2", "h3", "h4")


def _server(weighting="size", lr=1.0, **kw) -> Server:
    params = {"w": torch.ones(4), "b": torch.zeros(2)}
    limits = {"max_update_ratio": 100.0, "max_step_ratio": 1000.0, "max_weight_ratio": 10.0}  # the defaults
    if "aggregation" in kw:
        kw["aggregation"] = AGGREGATIONS.resolve(kw["aggregation"], kw.pop("aggregation_options", None))
    server = server_with(params, ServerOptimizer("fedavg", lr), WEIGHTINGS.resolve(weighting), **{**limits, **kw})
    server.register({c: 10 for c in (*HONEST, "evil")})
    server.begin_round(1)
    return server


def _update(w, b=None, n=10, delta_loss=0.5) -> ClientUpdate:
    w = w if isinstance(w, torch.Tensor) else torch.full((4,), float(w))
    return ClientUpdate({"w": w, "b": torch.zeros(2) if b is None else b}, n, delta_loss=delta_loss)


def _honest_round(server, evil: ClientUpdate | None = None, values=(1.1, 1.1)):
    for name, v in zip(HONEST, values):
        assert server.receive(name, _update(v)) is None
    reason = server.receive("evil", evil) if evil is not None else None
    record = server.end_round()
    return reason or record["clients"].get("evil", {}).get("rejected"), record


POISON = {
    "float32 1e37": (torch.full((4,), 1e37), "median of the other"),
    "float64 1e300": (torch.full((4,), 1e300, dtype=torch.float64), "overflow the server's dtype"),
    "float32 1e30": (torch.full((4,), 1e30), "median of the other"),
    "complex": (torch.ones(4, dtype=torch.complex64), "dtype"),
    "NaN": (torch.tensor([1.0, math.nan, 1.0, 1.0]), "non-finite"),
    "integer": (torch.ones(4, dtype=torch.int64), "dtype"),
}


@pytest.mark.parametrize("name", POISON)
def test_poisoned_update_is_rejected_and_honest_clients_still_count(name):
    tensor, why = POISON[name]
    server = _server()
    reason, record = _honest_round(server, _update(tensor))
    assert reason is not None and why in reason
    assert record["clients"]["evil"]["rejected"] == reason and record["applied"]
    assert torch.allclose(server.params["w"], torch.full((4,), 1.1))  # the honest mean, nothing else


@pytest.mark.parametrize("n, why", [(1e300, "not a positive count"), (10**12, "more than the 10 examples"),
                                    (0, "not a positive count"), (-3, "not a positive count"),
                                    (True, "not a positive count"), (math.nan, "not a positive count")])
def test_self_reported_size_is_bounded_by_what_the_silo_registered(n, why):
    server = _server()
    reason, record = _honest_round(server, _update(50.0, n=n))
    assert why in reason and record["applied"]
    assert torch.allclose(server.params["w"], torch.full((4,), 1.1))
    import json
    json.dumps(record, allow_nan=False)  # rounds.jsonl stays valid JSON


def test_overflowing_aggregate_is_skipped_not_applied():
    """With the limits off (streaming mean), a finite 3e38 update passes the per-client checks, but
    its size-weighted sum overflows float32: the round is skipped and the model is unchanged."""
    server = _server(max_update_ratio=None, max_step_ratio=None, max_weight_ratio=None)
    before = {k: v.clone() for k, v in server.params.items()}
    reason, record = _honest_round(server, _update(3e38))
    assert reason is None
    assert not record["applied"] and "not finite" in record["skipped"]
    assert all(torch.equal(before[k], server.params[k]) for k in before)


@pytest.mark.parametrize("lr, ratio, why", [(1e30, 1000.0, "norm"), (1e38, None, "non-finite")])
def test_diverging_server_step_is_skipped(lr, ratio, why):
    server = _server(lr=lr, max_step_ratio=ratio)
    _, record = _honest_round(server, values=(1.0 + 10, 1.0 + 10))
    assert not record["applied"] and why in record["skipped"]
    assert torch.equal(server.params["w"], torch.ones(4))
    assert server.optimizer.steps == 0


def test_lorar_client_claiming_a_huge_delta_loss_is_capped():
    server = _server("lorar", max_client_weight=0.4)
    for name in HONEST:
        server.receive(name, _update(1.1, delta_loss=0.5))
    server.receive("evil", _update(5.0, delta_loss=1e30))
    record = server.end_round()
    weights = {c: e["weight"] for c, e in record["clients"].items()}
    assert weights["evil"] == pytest.approx(0.4) and record["clients"]["evil"]["capped"]
    assert sum(weights.values()) == pytest.approx(1.0)
    assert server.params["w"][0].item() == pytest.approx(0.4 * 5.0 + 0.6 * 1.1)


@pytest.mark.parametrize("bad", [math.nan, -2.0, math.inf])
def test_one_bad_delta_loss_falls_back_alone(bad):
    server = _server("lorar")
    for name, dl in zip(HONEST, (0.1, 0.3, 0.0, 0.2)):
        server.receive(name, _update(1.1, delta_loss=dl))
    server.receive("evil", _update(2.0, delta_loss=bad))
    record = server.end_round()
    entries = record["clients"]
    assert entries["evil"].get("fallback") and not any(entries[c].get("fallback") for c in HONEST)
    assert entries["evil"]["weight"] == pytest.approx(10 / 50)  # its size share
    assert entries["h2"]["weight"] == pytest.approx(0.8 * 0.3 / 0.6)  # the rest by n·ΔL


def _byzantine_round(aggregation, options=None, **limits):
    """Four honest clients near w = 1.1, one Byzantine at −50 (passes every per-client check)."""
    server = _server(aggregation=aggregation, aggregation_options=options, **limits)
    g = torch.Generator().manual_seed(0)
    sent = {}
    for name in HONEST:
        sent[name] = 1.1 + 0.01 * torch.randn(4, generator=g)
        server.receive(name, _update(sent[name]))
    sent["evil"] = torch.full((4,), -50.0)
    server.receive("evil", _update(sent["evil"]))
    record = server.end_round()
    return server.params["w"], [(s - 1.0).numpy() for s in sent.values()], record


def test_median_and_trimmed_mean_resist_one_byzantine_client_and_match_flower():
    from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg

    mean, _, _ = _byzantine_round("mean", max_update_ratio=None)
    assert mean.max().item() < -5  # the plain mean is dragged far away
    guarded, _, record = _byzantine_round("mean")  # the default update limit: −51 vs ~0.1 from the others
    assert "median of the other 4" in record["clients"]["evil"]["rejected"]
    assert torch.allclose(guarded, torch.full((4,), 1.1), atol=0.05)
    median, deltas, record = _byzantine_round("median", max_update_ratio=None)
    ref = aggregate_median([([d], 10) for d in deltas])[0]
    np.testing.assert_allclose(median.numpy(), 1.0 + ref, rtol=1e-6)
    assert torch.allclose(median, torch.full((4,), 1.1), atol=0.05)
    assert record["aggregation"] == "median" and record["clients"]["evil"]["weight"] is None
    trimmed, deltas, _ = _byzantine_round("trimmed_mean", {"trim": 0.2}, max_update_ratio=None)
    ref = aggregate_trimmed_avg([([d], 10) for d in deltas], 0.2)[0]
    np.testing.assert_allclose(trimmed.numpy(), 1.0 + ref, rtol=1e-6)
    assert torch.allclose(trimmed, torch.full((4,), 1.1), atol=0.05)


def test_clip_norm_bounds_each_clients_pull():
    server = _server(clip_norm=0.5, max_update_ratio=None)  # 390× the others: the default limit rejects it
    reason, record = _honest_round(server, _update(40.0))
    assert reason is None and record["clients"]["evil"]["clipped_from"] == pytest.approx(78.0)
    # evil's Δ is clipped to norm 0.5 (0.25 per coordinate), then size-weighted with two honest 0.1s
    assert server.params["w"][0].item() == pytest.approx(1.0 + (0.1 + 0.1 + 0.25) / 3, rel=1e-5)


def test_robust_aggregation_refuses_weighting_settings():
    with pytest.raises(ConfigError, match="counts every client once"):
        toy_config(federation={"aggregation": "median", "weighting": "lorar"})
    with pytest.raises(ConfigError, match="trim"):
        toy_config(federation={"aggregation": "trimmed_mean", "aggregation_options": {"trim": 0.6}})


# --- through Flower's codec and ServerApp engine ---

def test_poisoned_update_through_the_flower_codec_is_rejected():
    from fedsilo.engines.flower.codec import content_to_update, update_to_content

    for tensor in (torch.full((4,), 1e300, dtype=torch.float64), torch.ones(4, dtype=torch.complex64)):
        server = _server()
        decoded = content_to_update(update_to_content(_update(tensor), "evil"))
        reason, record = _honest_round(server, decoded)
        assert reason and record["applied"]
        assert torch.allclose(server.params["w"], torch.full((4,), 1.1))


def _malformed_replies():
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from fedsilo.engines.flower.codec import update_to_content

    good = update_to_content(_update(1.1), "x")
    metrics = dict(good["metrics"])

    def with_metrics(**change):
        m = {**metrics, **change}
        return RecordDict({"arrays": good["arrays"], "metrics": MetricRecord({k: v for k, v in m.items()
                                                                              if v is not None})})
    return {
        "n_examples NaN": (with_metrics(n_examples=math.nan), "n_examples"),
        "n_examples 1e300": (with_metrics(n_examples=1e300), "more than"),
        "missing metric": (with_metrics(steps=None), "lack steps"),
        "missing arrays": (RecordDict({"metrics": good["metrics"]}), "'arrays'"),
        "complex tensor": (RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(4, dtype=np.complex64)),
                                                              "b": Array(np.zeros(2, dtype=np.float32))}),
                                       "metrics": good["metrics"]}), "dtype"),
    }


def test_malformed_flower_replies_are_rejected_clients_not_crashes():
    from fedsilo.engines.flower.engine import FlowerEngine

    cases = _malformed_replies()
    engine = FlowerEngine.__new__(FlowerEngine)  # no Grid: the exchange is replaced below
    engine.cfg, engine.config_text, engine.run_key = toy_config(), "", "k"
    names = list(cases)
    replies = {name: SimpleNamespace(content=cases[name][0]) for name in names}
    engine._exchange = lambda silos, kind, contents, group: ({s: replies[s] for s in silos}, {})
    server = _server()
    server.register({name: 10 for name in names})
    record = engine.train_round(server, names, 1, None)
    for name, (_, why) in cases.items():
        assert why in record["clients"][name]["rejected"], name
    assert not record["applied"]


def test_malformed_or_foreign_evaluation_rows_leave_that_silo_out():
    """A silo's evaluate reply must hold its own numeric rows; otherwise it is left out of the
    evaluation (with the reason), never a crash and never counted for another silo."""
    from flwr.app import ConfigRecord, RecordDict

    from fedsilo.engines.flower.codec import rows_to_record
    from fedsilo.engines.flower.engine import FlowerEngine
    from fedsilo.progress import Progress

    def content(rows):
        return RecordDict({"rows": rows_to_record(rows)})

    replies = {
        "alpha": content([{"client": "alpha", "task": "toyrank", "stats": {"questions": 4, "ap_sum": 2.0}}]),
        "beta": content([{"client": "alpha", "task": "toyrank", "stats": {"questions": 400, "ap_sum": 400.0}}]),
        "gamma": RecordDict({"rows": ConfigRecord({"rows": "{not json"})}),
    }
    engine = FlowerEngine.__new__(FlowerEngine)
    engine.cfg, engine.config_text, engine.run_key = toy_config(), "", "k"
    engine._exchange = lambda silos, kind, contents, group: (
        {s: SimpleNamespace(content=replies[s]) for s in silos}, {})
    warned = []
    progress = Progress(enabled=False)
    progress.warn = warned.append
    rows = engine.evaluate(_server(), "dev", progress)
    assert rows == [{"client": "alpha", "task": "toyrank", "stats": {"questions": 4, "ap_sum": 2.0}}]
    assert "beta (rejected: an evaluation row is not beta's own" in warned[0]
    assert "gamma (rejected: unreadable evaluation rows" in warned[0]


# --- runs that cannot go on stop with an error; checkpoints must be this run's ---

def _write_config(tmp_path, **sections) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(to_toml(toy_config(**sections)))
    return path


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("sections, cause", [
    ({"server": {"lr": 1e30}}, "server step"),
    ({"client": {"lr": 1e30}}, "alpha:"),
])
def test_diverged_run_stops_with_an_error_and_no_results(tmp_path, capsys, sections, cause):
    config = _write_config(tmp_path, federation={"rounds": 3}, **sections)
    out = tmp_path / "run"
    code, err = _cli(capsys, "run", str(config), "--out", str(out), "--no-progress")
    errors = [ln for ln in err.splitlines() if ln.startswith("fedsilo: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert "rounds 1-3 applied no update" in errors[0] and cause in errors[0]
    assert not (out / "results.json").exists()
    assert [r["applied"] for r in rounds_of(out)] == [False] * 3
    best = torch.load(out / "best.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in best["server"]["params"].values())


def test_every_client_rejected_in_a_one_round_run_is_an_error(tmp_path, capsys):
    config = _write_config(tmp_path, federation={"rounds": 1}, client={"lr": 1e30})
    code, err = _cli(capsys, "run", str(config), "--out", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and "round 1 applied no update" in err
    for silo in ("alpha", "beta", "gamma"):  # each rejection is printed, also with --no-progress
        assert f"fedsilo: warning: round 1: rejected {silo}: non-finite values (NaN/Inf) in the update" in err


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """Two 1-round toy runs: A (to be resumed with 2 rounds) and B (a foreign run)."""
    from fedsilo.runs.runner import run_experiment

    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        run_experiment(toy_config(federation={"rounds": 1}), root / name, show_progress=False)
    config = root / "exp.toml"
    config.write_text(to_toml(toy_config(federation={"rounds": 1})))
    return root, config


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _tamper(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    torch.save(change(state), path)


def _nan_params(state):
    name = next(iter(state["server"]["params"]))
    state["server"]["params"][name][..., 0] = math.nan
    return state


@pytest.mark.parametrize("tamper, why", [
    ("foreign", "belongs to another run"),
    ("nan", "NaN/Inf"),
    ("structure", "lacks"),
    ("shape", "wrong shape"),
    ("rounds", "rounds.jsonl holds rounds"),
])
def test_resume_refuses_a_checkpoint_that_is_not_this_runs(finished_runs, tmp_path, capsys, tamper, why):
    root, config = finished_runs
    run = _copy_run(root / "a", tmp_path / "a")
    ckpt = run / "checkpoint.pt"
    if tamper == "foreign":
        ckpt.write_bytes((root / "b" / "checkpoint.pt").read_bytes())
    elif tamper == "nan":
        _tamper(ckpt, _nan_params)
    elif tamper == "structure":
        torch.save({"round": 1, "weights": {}}, ckpt)
    elif tamper == "shape":
        def reshape(state):
            name = next(iter(state["server"]["params"]))
            state["server"]["params"][name] = torch.zeros(3)
            return state
        _tamper(ckpt, reshape)
    elif tamper == "rounds":
        (run / "rounds.jsonl").write_text("")
    before = ckpt.read_bytes()
    code, err = _cli(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                     "--set", "federation.rounds=2")
    assert code == 2 and why in err and str(ckpt) in err and "Traceback" not in err
    assert ckpt.read_bytes() == before  # nothing overwritten


def test_resume_of_an_untouched_copy_still_works(finished_runs, tmp_path, capsys):
    """The refusals above are about the tampering, not about copying a run directory."""
    root, config = finished_runs
    run = _copy_run(root / "a", tmp_path / "a")
    code, err = _cli(capsys, "run", str(config), "--out", str(run), "--resume", "--no-progress",
                     "--set", "federation.rounds=2")
    assert code == 0, err
    assert [r["round"] for r in rounds_of(run)] == [1, 2]


# --- one run directory, one writer ---

def test_a_held_run_directory_is_refused_at_once(tmp_path, capsys):
    from fedsilo.rundir.lock import RunLock

    config = _write_config(tmp_path)
    out = tmp_path / "run"
    with RunLock(out):
        code, err = _cli(capsys, "run", str(config), "--out", str(out), "--no-progress")
    assert code == 2 and "in use by another fedsilo run" in err and str(out) in err
    assert not (out / "rounds.jsonl").exists()


def test_two_concurrent_runs_on_one_directory(tmp_path, capsys):
    """The second run fails at once; the first finishes with rounds 1..N in order, none interleaved."""
    config = _write_config(tmp_path, federation={"rounds": 6})
    out = tmp_path / "run"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "fedsilo", "run", str(config), "--out", str(out),
                              "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not (out / "rounds.jsonl").exists() or not (out / "rounds.jsonl").read_text():
            assert first.poll() is None, first.communicate()[1].decode()[-2000:]
            time.sleep(0.2)
        code, err = _cli(capsys, "run", str(config), "--out", str(out), "--no-progress")
        assert first.poll() is None  # the check below is only meaningful while the first still runs
        assert code == 2 and "in use by another fedsilo run" in err
    finally:
        _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err.decode()[-2000:]
    assert [r["round"] for r in rounds_of(out)] == [1, 2, 3, 4, 5, 6]


def test_deploy_prints_rejections_fallbacks_and_skips_also_without_progress(tmp_path):
    """`fedsilo deploy --no-progress` follows rounds.jsonl: each round's line, then its warnings."""
    import io
    import json

    from fedsilo.engines.flower.deploy import RoundsPrinter

    path = tmp_path / "rounds.jsonl"
    stream = io.StringIO()
    printer = RoundsPrinter(path, total=2, stream=stream, plain=True)
    record = {"round": 2, "seconds": 3.0, "applied": False, "skipped": "the server step would make 'w' non-finite",
              "clients": {"a": {"rejected": "non-finite values"}, "b": {"fallback": True}, "c": {"capped": True}},
              "missing": ["d"], "missing_reasons": {"d": "no reply within 5s"}}
    path.write_text(json.dumps(record) + "\n")
    printer.poll()
    assert stream.getvalue().splitlines() == [
        "fedsilo: round 2/2 done in 3.0s",  # the round's own line too (issue 41, item 8)
        "fedsilo: warning: round 2: rejected a: non-finite values",
        "fedsilo: warning: round 2: fallback b: its weighting statistic was not usable; it took its size share",
        "fedsilo: warning: round 2: capped c: its weight was held (federation.max_weight_ratio / max_client_weight)",
        "fedsilo: warning: round 2: missing d: no reply within 5s",
        "fedsilo: warning: round 2: no update applied: the server step would make 'w' non-finite",
    ]


def test_kill_9_mid_run_resumes_bit_identical(tmp_path):
    """SIGKILL once round 1 is logged (wherever round 2 then is), then --resume: the final global
    tensors equal an uninterrupted run's exactly."""
    from fedsilo.runs.runner import run_experiment

    cfg = toy_config(federation={"rounds": 3})
    config = tmp_path / "exp.toml"
    config.write_text(to_toml(cfg))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess (OMP_NUM_THREADS=1): the same float reductions
    try:
        whole = run_experiment(cfg, tmp_path / "whole", show_progress=False)
        out = tmp_path / "killed"
        _kill_after_round_1(config, out)
        resumed = run_experiment(cfg, out, resume=True, show_progress=False)
    finally:
        torch.set_num_threads(threads)
    assert resumed["test"] == whole["test"]
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)["server"]["params"]
    b = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _kill_after_round_1(config: Path, out: Path) -> None:
    with past_round_1(config, out, OMP_NUM_THREADS="1"):
        pass
