"""Runs an experiment end to end: paradigm → rounds → model selection → test → results.

The loop is engine-agnostic: the in-process engine and Flower's are both an `Engine`
(fedsilo.engines): `client_names`, `train_round`, `evaluate`, and client state behind a store
(`set_round`, `truncate`, `after_checkpoint`, `state_dict`); the cross-domain matrix is tested
where the engine is a `CrossDomainEngine`.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

from fedsilo.client.store import make_store
from fedsilo.config import RunConfig
from fedsilo.core.tensors import is_finite
from fedsilo.engines import CrossDomainEngine, Engine
from fedsilo.engines.local import LocalEngine
from fedsilo.errors import ConfigError, RunFailed
from fedsilo.features.robust import uncapped_weights
from fedsilo.progress import Display, Heard, Progress
from fedsilo.recipe import (TOKENIZER_DIR, build_model, build_recipe, build_server, build_task,
                            give_ledgers, store_root, task_tokenizer)
from fedsilo.rundir.answers import read_answers, task_answers, write_answers
from fedsilo.rundir.datacheck import check_at_start
from fedsilo.rundir.layout import LEDGER_FOLDER, RunDir, RunDirError, config_hash, tokenizer_identity
from fedsilo.rundir.lock import RunLock
from fedsilo.rundir.records import item_records, privacy_spent, read_items, spent_silos, write_items
from fedsilo.rundir.refusal import left_as_found
from fedsilo.server import Server, sample_clients
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import NONFINITE, MetricSpec, WithReferences, select_best

from .report import write_report
from .tracked import UNTRACKED, Nest, RunTracking, finish_run


def _dev_line(spec: MetricSpec, dev: dict) -> str:
    label = next((c.label for c in spec.columns if c.key == spec.primary), spec.primary)
    score = dev.get("score")
    return f", dev {label} {score:.2f}" if score is not None else ""


def _round_warnings(cfg: RunConfig, record: dict) -> list[str]:
    """What a user must hear about a round beyond rejections (which engines report as they come)."""
    r, out = record["round"], []
    for client, entry in record.get("clients", {}).items():
        if entry.get("fallback"):
            stat = f"statistic {cfg.federation.weighting_stat!r}" if cfg.federation.weighting_stat else "weighting statistic"
            out.append(f"round {r}: {client}'s {stat} is not usable for {cfg.federation.weighting} weights "
                       "(NaN, negative, infinite, or zero for every silo); it took its size share")
        if entry.get("capped"):
            out.append(f"round {r}: {client}'s weight was capped (federation.max_weight_ratio = "
                       f"{cfg.federation.max_weight_ratio}, max_client_weight = {cfg.federation.max_client_weight})")
    for client, reason in record.get("rejected_at_end", {}).items():
        out.append(f"round {r}: rejected {client}: {reason}")
    if record.get("not_robust"):
        out.append(f"round {r}: {record['not_robust']}")
    if record.get("skipped"):
        out.append(f"round {r}: no update applied: {record['skipped']}")
    return out


def _failure_cause(record: dict) -> str:
    """The reasons in the last failed round: the skip reason, else each client's rejection or absence."""
    if record.get("skipped") and record.get("clients") and any(
            not e.get("rejected") for e in record["clients"].values()):
        return record["skipped"]
    why = [f"{c}: {e['rejected']}" for c, e in record.get("clients", {}).items() if e.get("rejected")]
    why += [f"{c}: {m}" for c, m in (record.get("missing_reasons") or {}).items()]
    return "; ".join(why) or record.get("skipped") or "no client took part"


def _check_progress(cfg: RunConfig, logged: list[dict], rounds: int) -> None:
    """Raise RunFailed after `max_failed_rounds` rounds in a row without an update, or at the last
    round of a run that never applied one."""
    streak = 0
    for record in reversed(logged):
        if record.get("applied", True):
            break
        streak += 1
    if not streak:
        return
    last = logged[-1]
    finished_empty = last["round"] >= rounds and streak == len(logged)
    if streak >= cfg.federation.max_failed_rounds or finished_empty:
        first = last["round"] - streak + 1
        span = f"round {first}" if streak == 1 else f"rounds {first}-{last['round']}"
        raise RunFailed(f"{span} applied no update to the global model ({_failure_cause(last)}); the run "
                        f"stopped (federation.max_failed_rounds = {cfg.federation.max_failed_rounds})",
                        lasting=any(r.get("clients") for r in logged[-streak:]))  # some silo replied


def run_federation(cfg: RunConfig, run: RunDir, engine: Engine, server: Server, spec: MetricSpec, task_name: str,
                   resume: bool = False, progress: Progress | None = None, display: dict | None = None,
                   tokenizer: str | None = None, tracking: RunTracking = UNTRACKED) -> dict:
    """Rounds on any engine, model selection on the merged dev set, test of the selected model. A run
    that diverged (a lasting RunFailed) stays failed: the reason is recorded, and a resume repeats it.
    `tokenizer`: its identity (`tokenizer_identity`), recorded in every checkpoint for `model.init_from`;
    `tracking`: started once the run is accepted, given each round once its checkpoint is saved."""
    run.prepare(cfg, resume)
    failed = run.failure()
    if failed is not None:
        raise RunFailed(f"{run.path} stopped with an error earlier: {failed}. A resume with the same settings "
                        f"would repeat it (federation.rounds, engine.threads and engine.workers do not clear it): "
                        f"change a setting (e.g. server.lr or client.lr) and start a new run with another --out "
                        f"(to try once more anyway, delete {run.failed} and resume)", lasting=True)
    try:
        return _federate(cfg, run, engine, server, spec, task_name, progress or Progress(enabled=False), display,
                         tokenizer, tracking)
    except RunFailed as err:
        if err.lasting:
            run.record_failure(str(err))
        raise


def _federate(cfg: RunConfig, run: RunDir, engine, server: Server, spec: MetricSpec, task_name: str,
              progress: Progress, display: dict | None, tokenizer: str | None, tracking: RunTracking) -> dict:
    server.register(engine.client_sizes)
    uncapped = uncapped_weights(build_recipe(cfg))  # on every engine: the weights are the server's business
    if uncapped:
        progress.warn(uncapped)
    device = next(iter(server.params.values())).device  # checkpoints load where the server lives
    identity = {"run_id": run.run_id(), "config": config_hash(cfg)}
    if tokenizer is not None:  # saved with each checkpoint, not checked on resume (the config hash covers it)
        identity["tokenizer"] = tokenizer
    rounds = cfg.federation.rounds if cfg.participation.trains else 0
    start, best = 1, None
    state = run.load_checkpoint(run.checkpoint, identity, server.params, device, server.state_problem)
    if state is not None:
        if state["round"] > rounds:  # results, rounds.jsonl and config.toml would disagree
            raise RunDirError(f"{run.path} has already completed {state['round']} rounds: federation.rounds = "
                              f"{rounds} cannot be resumed; resume with federation.rounds >= {state['round']}, or "
                              "start a new run with another --out")
        server.load_state_dict(state["server"])
        try:
            engine.load_state_dict(state["clients"])
        except RunDirError as err:
            raise RunDirError(f"{run.path} cannot be resumed here: {err}") from None
        start, best = state["round"] + 1, state["best"]
    elif (recorded := run.read_results()) is not None:  # finished, its checkpoint gone (e.g. bench/results)
        if recorded.get("rounds") == rounds:  # prepare() checked the config: the same run, as recorded
            progress.log(f"{run.path} is finished ({rounds} rounds, no checkpoint): results as recorded")
            return recorded
        raise RunDirError(f"{run.path} finished {recorded.get('rounds')} rounds but has no checkpoint.pt to "
                          f"continue to {rounds} from; start a new run with another --out")
    run.write_config(cfg)  # only now: a refused resume leaves the run directory as it was
    tracking.start([r for r in run.read_rounds() if r["round"] < start])  # the rounds its checkpoint holds
    if state is not None:
        done = run.read_results()
        if done is not None and (state["round"] >= rounds or done.get("stopped")) and done.get("rounds") == state["round"]:
            progress.log(f"{run.path} is finished ({state['round']} rounds): results as recorded")
            return done
    last = start - 1
    run.truncate_rounds(last)
    engine.truncate(last)
    stopped, spent = None, spent_silos(run.read_rounds())
    if not cfg.participation.trains and state is None:  # the starting model is the run's model: round 0
        best = _evaluate_dev(0, engine, server, spec, progress)[0]
        for path, extra in ((run.best, {}), (run.checkpoint, {"best": best})):
            run.save(path, {"round": 0, **identity, **extra, "server": server.state_dict(),
                            "clients": engine.state_dict()})

    for r in range(start, rounds + 1):
        sampled = sample_clients(engine.client_names, r, cfg.seed, cfg.federation.sample_fraction,
                                 cfg.federation.sample_count)
        sampled = [c for c in sampled if c not in spent]  # a silo that refused for good is not asked again
        refused = server.refuses(r, sampled)
        if refused:  # silo-level DP: the federation's budget does not allow this round
            progress.warn(refused)
            stopped, rounds = refused, r - 1
            break
        engine.set_round(r)
        record = engine.train_round(server, sampled, r, progress)
        for message in _round_warnings(cfg, record):
            progress.warn(message)
        if not is_finite(server.params):  # the server skips such steps; never checkpoint a broken model
            raise RunFailed(f"round {r}: the global model holds NaN/Inf values", lasting=True)
        record["dev"] = None
        if r % cfg.federation.eval_every == 0 or r == rounds:
            candidate, record["dev"], record["eval_seconds"] = _evaluate_dev(r, engine, server, spec, progress)
            if select_best([c for c in (best, candidate) if c]) is candidate:
                best = candidate
                run.save(run.best, {"round": r, **identity, "server": server.state_dict(),
                                    "clients": engine.state_dict()})
        progress.log(f"round {r}/{rounds} done in {record['seconds']:.1f}s" +
                     (_dev_line(spec, record["dev"]) if record["dev"] else ""))
        run.append_round(record)
        run.save(run.checkpoint, {"round": r, **identity, "best": best, "server": server.state_dict(),
                                  "clients": engine.state_dict()})
        engine.after_checkpoint([r] + ([best["round"]] if best else []))
        logged = run.read_rounds()
        tracking.rounds(logged)
        spent = spent_silos(logged)
        if set(engine.client_names) <= spent:
            stopped = (f"every silo refused round {r} and all later rounds (each has spent its privacy budget); "
                       f"the run ends after round {r} of {rounds}")
            progress.warn(stopped)
            rounds = r
            break
        _check_progress(cfg, logged, rounds)

    if best is None and stopped:
        raise RunFailed(f"no round trained: {stopped}", lasting=True)
    if best is None:
        raise RunFailed(f"every dev evaluation was invalid (NaN/Inf model scores or a NaN dev {spec.primary}; "
                        f"see rounds.jsonl): no round can be selected, so there is no model to test", lasting=True)
    best_state = run.load_checkpoint(run.best, identity, server.params, device, server.state_problem)
    if best_state is None:
        raise RunDirError(f"{run.path}: no best.pt; the run has no evaluated round")
    t0 = time.perf_counter()
    server.load_state_dict(best_state["server"])
    engine.load_state_dict(best_state["clients"])
    engine.set_round(best_state["round"])
    test_rows = engine.evaluate(server, "test", progress, final=True)  # with each test item's stats, where kept
    test = spec.summarize(test_rows)
    matrix = engine.evaluate_matrix(server, "test", progress) if isinstance(engine, CrossDomainEngine) else {}
    logged = run.read_rounds()
    wall = sum(x.get("seconds", 0) + x.get("eval_seconds", 0) for x in logged) + time.perf_counter() - t0
    results = {"paradigm": cfg.paradigm, "name": cfg.name, "task": task_name, "rounds": rounds,
               "best_round": best_state["round"], "best_dev": best["score"], "wall_seconds": wall,
               "metric_spec": spec.describe(), "display": dict(display or {}), "test": test}
    if matrix:
        results["matrix"] = {"split": "test", "models": {m: spec.summarize(rows) for m, rows in matrix.items()}}
    privacy = privacy_spent(logged)
    if privacy:
        results["privacy"] = privacy
    silo_level = [x["silo_dp"] for x in logged if x.get("silo_dp")]
    if silo_level:
        results["silo_privacy"] = silo_level[-1]
    if stopped:
        results["stopped"] = stopped
    write_items(run.path, item_records(test_rows, "test"))  # before results.json: a reported test has its items
    write_answers(run.path, task_answers(getattr(engine, "task", None), "test"))  # in-process: the text is ours
    run.write_results(results)
    # Leave the engine where the run ended, so a resume with more rounds continues from there.
    state = run.load_checkpoint(run.checkpoint, identity, server.params, device, server.state_problem)
    server.load_state_dict(state["server"])
    engine.load_state_dict(state["clients"])
    return results


def _evaluate_dev(r: int, engine, server: Server, spec: MetricSpec, progress: Progress) -> tuple[dict, dict, float]:
    """(the round's candidate for best, its dev summary, seconds) after round `r` (0: the starting model)."""
    t0 = time.perf_counter()
    dev = spec.summarize(engine.evaluate(server, "dev", progress))
    if dev.get(NONFINITE):
        progress.warn(f"round {r}: invalid dev evaluation, the model scored {dev[NONFINITE]:.0f} "
                      f"item(s) NaN/Inf; this round is never selected as best")
    return {"key": dev["key"], "round": r, "score": dev["score"]}, dev, time.perf_counter() - t0


def busy_machine(setting, threads: int, device: str) -> str | None:
    """A warning when auto threads meet a machine whose cores are taken: torch's threads then wait
    for each other (a busy 2-core machine ran about 10x slower per step than with one thread)."""
    if setting != "auto" or device != "cpu" or threads < 2:
        return None
    others, cores = others_running(), usable_cores()
    if others is None or others + threads <= cores:
        return None
    return (f"this machine is busy (other work takes cores of its {cores}) and engine.threads = auto takes "
            f"{threads} threads: on a busy machine that can be many times slower per step than one thread; try "
            "--set engine.threads=1 (docs/speed.md)")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def others_running(samples: int = 10) -> float | None:
    """How many tasks the machine runs besides this process now: the mean over a tenth of a second
    of the runnable tasks in /proc/stat, less this one (a study's earlier runs, whose threads have
    stopped, do not count, as they would in the load average); elsewhere the 1-minute load
    average; None where neither is known."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/stat", "rb") as f:
                running = next(line for line in f if line.startswith(b"procs_running"))
        except (OSError, StopIteration):
            break
        counts.append(int(running.split()[1]) - 1)
        time.sleep(0.01)
    if counts:
        return max(0.0, sum(counts) / len(counts))
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _surface(caught: list) -> list[str]:
    """Each warning once (the data check and the task both verify a data folder)."""
    return list(dict.fromkeys(str(w.message) for w in caught))


def run_local(cfg: RunConfig, run: RunDir, resume: bool = False, progress: Progress | None = None,
              policies: dict[str, str] | None = None, tracking: RunTracking = UNTRACKED) -> dict:
    """One federation (or pooled/single-silo run) on the in-process engine; `policies`: {silo: its policy
    file} (fedsilo.client.policy), as each silo's operator gives it, not the config."""
    progress = progress or Progress(enabled=False)
    recipe = build_recipe(cfg)  # a combination that cannot hold is refused before anything is built
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        model, tokenizer = build_model(cfg)  # an unusable device fails here, the run directory untouched
        run.prepare(cfg, resume)  # a refused run directory is left as it was, before the data is read
        checks = check_at_start(cfg, run.path, resume, progress.warn)
        task = build_task(cfg, tokenizer)
    for message in _surface(caught):
        progress.warn(message)
    if task_tokenizer(cfg) is not None and hasattr(tokenizer, "save_pretrained"):
        run.path.mkdir(parents=True, exist_ok=True)  # for a later run's model.init_from
        tokenizer.save_pretrained(str(run.path / TOKENIZER_DIR))
    store = make_store(cfg.engine.store, store_root(run.path), run.run_id)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a token cache entry rebuilt
        warnings.simplefilter("always", UserWarning)
        engine = LocalEngine(cfg, task, model, store, recipe, policies)
    give_ledgers(engine.clients, run.path / LEDGER_FOLDER, run.run_id,  # each DP silo's privacy ledger
                 {c.name: c.files for c in checks})
    for message in _surface(caught):
        progress.warn(message)
    progress.log(f"{len(engine.client_names)} silo(s) on {engine.device}: {engine.threads} CPU thread(s) "
                 f"(engine.threads = {cfg.engine.threads}), {engine.workers} worker process(es)")
    busy = busy_machine(cfg.engine.threads, engine.threads, engine.device.type)
    if busy:
        progress.warn(busy)
    try:
        results = run_federation(cfg, run, engine, build_server(cfg, model, recipe), task.spec, task.name, resume,
                                 progress, display=task.display, tokenizer=tokenizer_identity(tokenizer),
                                 tracking=tracking)
    finally:
        engine.close()
    if isinstance(task, WithReferences) and task.reference_names and "reference" not in results:
        results["reference"] = {name: task.spec.summarize(reference_rows(task, name, "test"))
                                for name in task.reference_names}
        run.write_results(results)
    return results


def reference_rows(task, name: str, split: str) -> list[dict]:
    """Rows of the task's untrained reference ranker `name` (e.g. BM25) on every client's `split`."""
    return [row for client in task.clients for row in task.reference(name, client, split)]


def run_experiment(cfg: RunConfig, out: str | Path, resume: bool = False, show_progress: Display = True,
                   policies: dict[str, str] | None = None, heard: Heard | None = None, nest: Nest | None = None) -> dict:
    """Any paradigm into run directory `out`, its report written; returns results.json's content.
    `heard`: the warnings earlier runs of a study gave (each is shown once per study); `nest`: the study
    run this one is tracked under."""
    out = Path(out)
    build_recipe(cfg)  # refused before the run directory is touched
    # refused at its start, the run leaves `out` as it found it: what it made there removed, then the lock
    with RunLock(out), left_as_found(out), Progress(enabled=show_progress, heard=heard) as progress, \
            RunTracking.of(cfg, out, progress.warn, *(nest or ())) as tracking:
        if cfg.participation.per_silo_runs:
            if policies:
                raise ConfigError(f"--policy: paradigm {cfg.paradigm!r} trains each silo alone; nothing leaves a silo")
            results = _finetune(cfg, out, resume, progress, tracking)
        else:
            results = run_local(cfg, RunDir(out), resume, progress, policies, tracking)
        write_report(out)
        finish_run(tracking, out)
        return results


def _finetune(cfg: RunConfig, out: Path, resume: bool, progress: Progress, tracking: RunTracking) -> dict:
    """Each silo alone (its own dev selection), in sub-run directories; results pooled exactly."""
    top = RunDir(out)
    top.prepare(cfg, resume)
    tracking.start()  # the parent of each silo's tracked run
    rows, subruns, spec_desc, display, wall, matrices, references = [], {}, None, {}, 0.0, {}, {}
    for silo in cfg.task.client_names():
        sub = cfg.model_copy(update={
            "paradigm": "federated", "name": f"{cfg.name}/{silo}",
            "task": cfg.task.alone(silo),
            "clients": {k: v for k, v in cfg.clients.items() if k == silo},
            "client": cfg.client.model_copy(update={"persist_optimizer": cfg.persist_optimizer}),
            "federation": cfg.federation.model_copy(update={"weighting": "size", "sample_count": None,
                                                            "sample_fraction": 1.0, "weighting_stat": None}),
            "server": cfg.server.model_copy(update={"optimizer": "fedavg", "lr": 1.0}),
        })
        sub_run = RunDir(out / "silos" / silo)
        progress.log(f"finetuning {silo} alone")
        with RunTracking.of(sub, sub_run.path, progress.warn, tracking, silo, {"fedsilo.silo": silo}) as alone:
            done = run_local(sub, sub_run, resume and sub_run.config.exists(), progress, tracking=alone)
            finish_run(alone, sub_run.path)
        rows += done["test"]["rows"]
        if "matrix" in done:
            matrices[silo] = done["matrix"]["models"]["global"]
        for name, summary in (done.get("reference") or {}).items():
            references.setdefault(name, []).extend(summary["rows"])
        subruns[silo] = f"silos/{silo}"
        spec_desc, display = done["metric_spec"], {**display, **done.get("display", {})}
        wall += done.get("wall_seconds", 0.0)
    results = {"paradigm": cfg.paradigm, "name": cfg.name, "task": cfg.task.name, "rounds": cfg.federation.rounds,
               "best_round": None, "best_dev": None, "wall_seconds": wall, "metric_spec": spec_desc,
               "display": display,
               "test": TASKS.get(cfg.task.name).spec().summarize(rows), "subruns": subruns}
    if matrices:  # each silo's own model on every domain (the paper's Table 2)
        results["matrix"] = {"split": "test", "models": matrices}
    if references:
        spec = TASKS.get(cfg.task.name).spec()
        results["reference"] = {name: spec.summarize(rows) for name, rows in references.items()}
    top.write_config(cfg)  # a resume's, once every silo's run has accepted it
    write_items(out, [r for path in subruns.values() for r in read_items(out / path) or []])  # the rows' order
    write_answers(out, [r for path in subruns.values() for r in read_answers(out / path) or []])
    top.write_results(results)
    return results
