"""A run (or a study) mirrored into the trackers its `[tracking]` section names, never failing it.

The run directory is the record; trackers are given what it holds, as it is written: the config and
tags when the run is accepted, each round once its checkpoint is saved, then results.json, report.md,
plots/ (and the exported model when asked). A tracker that raises is named in one warning and left
out for the rest of the run: the next opening (a resume, `fedsilo track RUN`) logs what it missed.
On Flower only the server side tracks, and it holds only what the silos sent (docs/tracking.md).
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedsilo import __version__
from fedsilo.config import RunConfig
from fedsilo.rundir.layout import RunDir, config_hash
from fedsilo.tracking import FAILED, FINISHED, KILLED, TRACKERS, TrackedRun, Tracker, source_commit
from fedsilo.tracking.metrics import flat_params, part, result_metrics, round_metrics
from fedsilo.tracking.settings import TrackingConfig, require_packages

FINAL_KEY = "wall_seconds"  # every results.json has it: whether a run's final results are logged at a step
RUN_FILES = ("report.md", "results.json", "plots")  # what a finished run logs as artifacts, where it has them


def base_tags(path: Path) -> dict[str, str]:
    tags = {"fedsilo.version": __version__, "fedsilo.run_dir": str(Path(path).resolve())}
    commit = source_commit()
    if commit:
        tags.update({"fedsilo.git_commit": commit, "mlflow.source.git.commit": commit})
    return tags


class RunTracking:
    """One run's trackers, opened at `start` (a refused run opens none)."""

    def __init__(self, settings: TrackingConfig, run: TrackedRun, warn: Callable[[str], None],
                 parent: "RunTracking | None" = None, export: Callable[[Path], None] | None = None) -> None:
        self.settings, self.run, self.warn, self.parent, self.export = settings, run, warn, parent, export
        self._trackers: dict[str, Tracker] | None = None
        self.dropped: set[str] = set()  # backends that failed: left out, and so in every nested run

    @classmethod
    def of(cls, cfg: RunConfig, path: Path, warn: Callable[[str], None], parent: "RunTracking | None" = None,
           name: str | None = None, tags: Mapping[str, str] | None = None) -> "RunTracking":
        """A run directory's tracking, as `cfg` asks for it (a tracker whose package is missing: ConfigError)."""
        require_packages(cfg.tracking)
        experiment = cfg.tracking.experiment or (parent.run.experiment if parent else cfg.name)
        run = TrackedRun(Path(path), name or Path(path).name, experiment,
                         flat_params(cfg.model_dump(exclude_none=True)),
                         {**base_tags(path), "fedsilo.config_hash": config_hash(cfg), "fedsilo.task": cfg.task.name,
                          "fedsilo.paradigm": cfg.paradigm, **(tags or {})})
        export = (lambda folder: export_model(cfg, Path(path), folder)) if cfg.tracking.export else None
        return cls(cfg.tracking, run, warn, parent, export)

    def __enter__(self) -> "RunTracking":
        return self

    def __exit__(self, kind, err, tb) -> None:
        self.close(FINISHED if kind is None else FAILED if issubclass(kind, Exception) else KILLED)  # Ctrl-C, SIGTERM

    def _try(self, backend: str, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - tracking never fails a run
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            self.warn(f"tracking: {backend} could not {what} ({type(err).__name__}: {reason}); the run goes on "
                      f"without {backend}, its own files complete (a resume or `fedsilo track {self.run.path}` "
                      "logs what was missed)")
            self.dropped.add(backend)
            if self._trackers is not None:
                self._trackers.pop(backend, None)
            return None

    def tracker(self, backend: str) -> Tracker | None:
        self.start()
        return self._trackers.get(backend)

    def start(self, logged: Sequence[Mapping] = ()) -> None:
        """Open every tracker (a nested run under its parent's), then log the rounds it lacks of `logged`."""
        if self._trackers is None:
            self._trackers = {}
            for backend in self.settings.backends:
                if self.parent is not None and backend in self.parent.dropped:
                    self.dropped.add(backend)  # the parent's warning said it
                    continue
                above = self.parent.tracker(backend) if self.parent is not None else None
                opened = self._try(backend, f"start tracking {self.run.path}", lambda b=backend, p=above:
                                   TRACKERS.get(b)(self.settings, self.run, p))
                if opened is not None:
                    self._trackers[backend] = opened
        self.rounds(logged)

    def rounds(self, logged: Sequence[Mapping]) -> None:
        """Log each round of `logged` past what each tracker holds (every call after a checkpoint)."""
        def log(t: Tracker) -> None:
            since = t.logged_through()
            for record in logged:
                if record["round"] > since:
                    t.log_metrics(round_metrics(record), record["round"])
        self._each("log a round", log)

    def finish(self, logged: Sequence[Mapping], results: Mapping | None, files: Mapping[str, Path]) -> None:
        """The rounds still missing, the final results (once per step), the run's files and the exported model."""
        self.start(logged)
        model = self._exported() if self.export is not None and results is not None and self._trackers else None
        step = int((results or {}).get("rounds") or 0)

        def log(t: Tracker) -> None:
            if results is not None and not t.has_step(FINAL_KEY, step):
                t.log_metrics(result_metrics(results), step)
            t.log_files({**files, **({"model": Path(model.name)} if model else {})})
        try:
            self._each("log the results", log)
        finally:
            if model is not None:
                model.cleanup()

    def _exported(self) -> tempfile.TemporaryDirectory | None:
        folder = tempfile.TemporaryDirectory(prefix="fedsilo-export-")
        try:
            self.export(Path(folder.name))
        except Exception as err:  # noqa: BLE001 - a model that cannot be exported is not logged; the run stands
            folder.cleanup()
            self.warn(f"tracking: the model was not exported for tracking.export ({err}); try `fedsilo export "
                      f"{self.run.path} --out DIR`")
            return None
        return folder

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for backend, tracker in list((self._trackers or {}).items()):
            self._try(backend, what, lambda t=tracker: call(t))

    def log_text(self, text: str, name: str) -> None:
        self._each(f"log {name}", lambda t: t.log_text(text, name))

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """`metrics` at `step`, in each tracker that does not hold its first one there already (a rerun)."""
        first = next(iter(metrics), None)
        self._each("log metrics", lambda t: None if first is None or t.has_step(first, step) else
                   t.log_metrics(metrics, step))

    def log_files(self, files: Mapping[str, Path]) -> None:
        self._each("log files", lambda t: t.log_files(files))

    def close(self, status: str) -> None:
        self._each("end its run", lambda t: t.close(status))
        self._trackers = {} if self._trackers is not None else None


class Nest(NamedTuple):
    """Where a run is tracked inside another (a study's variant and seed): its parent, name and tags."""
    parent: RunTracking
    name: str
    tags: Mapping[str, str]


UNTRACKED = RunTracking(TrackingConfig(), TrackedRun(Path("."), "", ""), lambda message: None)


def finish_run(tracking: RunTracking, path: Path) -> None:
    """Everything a run directory holds, to its trackers (after its report is written)."""
    run = RunDir(path)
    files = {name: Path(path) / name for name in RUN_FILES if (Path(path) / name).exists()}
    tracking.finish(run.read_rounds(), run.read_results(), files)


def export_model(cfg: RunConfig, path: Path, folder: Path) -> None:
    """`fedsilo export` of the run into `folder`: its model, or each silo's own when each trained alone."""
    from .export import export_run

    if cfg.participation.per_silo_runs:
        for silo in cfg.task.client_names():
            export_run(path, folder / silo, silo=silo)
    else:
        export_run(path, folder / "global")


def study_tracking(cfg: RunConfig, out: Path, name: str, params: Mapping[str, Any],
                   warn: Callable[[str], None]) -> RunTracking:
    """A study's parent run: its settings as parameters; each variant's runs nest under it."""
    settings = cfg.tracking
    require_packages(settings)
    run = TrackedRun(Path(out), name, settings.experiment or name, flat_params(params, "study."),
                     {**base_tags(out), "fedsilo.study": name})
    return RunTracking(settings, run, warn)


def log_study(tracking: RunTracking, study: Mapping[str, Any], out: Path, table_md: str) -> None:
    """The study's comparison on its parent run: the table, each variant's mean over seeds as metrics
    (`<variant>/<metric>`, step = the runs compared: a rerun of the same study logs them once), the claims
    against the baseline, report.md and study.json."""
    means: dict[str, float] = {}
    for variant, by_seed in (study.get("per_seed") or {}).items():
        for metric in study.get("metrics") or []:
            values = [s["overall"].get(metric) for s in by_seed.values() if isinstance(s.get("overall"), Mapping)]
            values = [float(v) for v in values if isinstance(v, (int, float))]
            if values:
                means[f"{part(variant)}/{part(metric)}"] = sum(values) / len(values)
    claims = "\n".join([f"# Against {study.get('baseline')}", "", f"{study.get('rule', '')}.", "",
                        *(f"- {line}" for line in study.get("checks") or [])]) + "\n"
    tracking.start()
    tracking.log_metrics(means, step=sum(len(by_seed) for by_seed in (study.get("per_seed") or {}).values()))
    tracking.log_text(table_md, "study_table.md")
    if study.get("checks"):
        tracking.log_text(claims, "claims.md")
    tracking.log_files({name: Path(out) / name for name in ("report.md", "study.json") if (Path(out) / name).exists()})


def track_run(path: Path, assignments: Sequence[str], warn: Callable[[str], None]) -> dict | None:
    """`fedsilo track`: a run directory as it is, to the trackers of its config (`assignments`: [tracking]
    changes only); a finetune run's silos nested under it. Returns its results (None: unfinished)."""
    from fedsilo.config import load_config
    from fedsilo.errors import ConfigError
    from fedsilo.rundir.lock import RunLock

    other = [a for a in assignments if not a.strip().startswith("tracking.")]
    if other:
        raise ConfigError(f"--set {other[0]!r}: fedsilo track changes only the [tracking] section")
    run = RunDir(path)
    if not run.config.is_file():
        raise ConfigError(f"{run.path}: no config.toml (not a run directory)")
    cfg = load_config(run.config, assignments)
    if not cfg.tracking.backends:
        raise ConfigError(f"{run.config}: tracking.backend = \"off\"; say where with --tracking mlflow, tensorboard "
                          "or both")
    with RunLock(run.path), RunTracking.of(cfg, run.path, warn) as tracking:
        results = run.read_results()
        if cfg.participation.per_silo_runs:
            tracking.start()
            for silo, sub in ((results or {}).get("subruns") or {}).items():
                sub_cfg = load_config(run.path / sub / "config.toml").model_copy(update={"tracking": cfg.tracking})
                with RunTracking.of(sub_cfg, run.path / sub, warn, tracking, silo, {"fedsilo.silo": silo}) as alone:
                    finish_run(alone, run.path / sub)
        finish_run(tracking, run.path)
        tracking.close(FINISHED if results is not None else FAILED if run.failed.exists() else KILLED)
    return results
