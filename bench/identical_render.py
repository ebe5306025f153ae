"""Helper of bench/identical.py: runs a study script (or `fedsilo`) of the tree on PYTHONPATH over
committed records, so that it renders its tables without training anything.

    python bench/identical_render.py [--records-only] SCRIPT.py ARGS...    # a bench/*_study.py script
    python bench/identical_render.py [--records-only] -m fedsilo ARGS...   # e.g. study FILE --out DIR

Two changes to the tree's code, both before the script starts, neither touching what is rendered:

- A resume accepts a recorded config.toml that lacks a field the code has since gained with an empty
  default ({} or []): the committed study records were written before e.g. `exchange.upload_transforms`
  existed, and a finished run whose checkpoints are not kept returns its results.json only when its
  config matches (fedsilo.rundir.layout._comparable, here with empty tables and lists dropped on both sides).
- Any attempt to train (a round appended to a run's rounds.jsonl) stops the render with exit code 3:
  a run without results.json in the records would otherwise start training for hours.

With --records-only, `run_experiment` (fedsilo.runs.runner) returns a run folder's results.json
without building the run's model and data (the bench scripts already read their finished runs so;
`fedsilo study` and bench/qa_study.py resume each one, which takes minutes): what is rendered from
the records is the same, only the config check and the model and data building are skipped; and
each plot is saved as an empty file (the per-run report.md files' plots are not compared, and drawing
them takes most of a render's time).
Each change is reported on stderr (a module that moved is named, and that change is not made).
"""
from __future__ import annotations

import runpy
import sys


def _drop_empty(value):
    if isinstance(value, dict):
        return {k: _drop_empty(v) for k, v in value.items() if v != {} and v != []}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


def _module(*names: str):
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def patch(records_only: bool) -> None:
    found = _module("fedsilo.rundir.layout", "fedsilo.runs.rundir", "fedsilo.rundir")
    rundir = sys.modules[found.RunDir.__module__] if found is not None and hasattr(found, "RunDir") else None
    if rundir is None or not hasattr(rundir, "_comparable"):
        sys.stderr.write("identical_render: no RunDir and _comparable (fedsilo.runs.rundir): resume check and "
                         "training guard not patched\n")
    else:
        comparable = rundir._comparable
        rundir._comparable = lambda cfg: _drop_empty(comparable(cfg))

        def refuse(self, *args, **kwargs):
            sys.stderr.write(f"identical_render: {self.path} would train (no finished record): refused\n")
            sys.stderr.flush()
            raise SystemExit(3)

        rundir.RunDir.append_round = refuse
    if records_only:
        runner = _module("fedsilo.runs.runner")
        if runner is None or not hasattr(runner, "run_experiment"):
            sys.stderr.write("identical_render: no fedsilo.runs.runner.run_experiment: --records-only not applied\n")
            return
        import json
        from pathlib import Path

        def recorded(cfg, out, *args, **kwargs):
            results = Path(out) / "results.json"
            if not results.is_file():
                sys.stderr.write(f"identical_render: {out} has no results.json: refused\n")
                raise SystemExit(3)
            return json.loads(results.read_text())

        runner.run_experiment = recorded
        from matplotlib.figure import Figure  # plots are not compared: an empty file, not a drawn PNG

        Figure.savefig = lambda self, path, *args, **kwargs: Path(path).touch()


def main() -> None:
    records_only = sys.argv[1:2] == ["--records-only"]
    if records_only:
        del sys.argv[1]
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    patch(records_only)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
