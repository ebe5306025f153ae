"""`fedsilo run | report | data`: the command line."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from fedsilo.config import load_config
    from fedsilo.runs.report import print_results, write_report
    from fedsilo.runs.runner import run_experiment

    cfg = load_config(args.config, args.set or [])
    out = Path(args.out) if args.out else Path(cfg.out_dir) / cfg.name
    if args.engine == "flower-sim":
        from fedsilo.engines.flower.simulation import run_simulation
        results = run_simulation(cfg, out, resume=args.resume, show_progress=not args.no_progress)
    else:
        results = run_experiment(cfg, out, resume=args.resume, show_progress=not args.no_progress)
    print_results(results)
    report = write_report(out)
    print(f"run directory: {out}\nreport: {report}")
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    """A real Flower deployment on 127.0.0.1: SuperLink + one SuperNode per silo, then clean up."""
    from fedsilo.config import load_config, to_toml
    from fedsilo.datafetch import default_data_root, ensure
    from fedsilo.engines.flower.deploy import LocalDeployment, split_silo_data
    from fedsilo.runs.report import print_results, read_results, write_report

    cfg = load_config(args.config, args.set or [])
    out = Path(args.out) if args.out else Path(cfg.out_dir) / cfg.name
    work = Path(args.workdir) if args.workdir else out.with_name(out.name + "-flower")
    data = Path(cfg.task.data_dir) if cfg.task.data_dir else ensure("text2sql", default_data_root() / "text2sql")
    silos = split_silo_data(data, cfg.task.silos, work / "silo-data")
    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.toml"
    config.write_text(to_toml(cfg))
    print(f"starting a SuperLink and {len(silos)} SuperNodes on 127.0.0.1 (logs in {work})")
    with LocalDeployment(work / "processes", silos) as dep:
        dep.run(config, out, resume=args.resume)
    print_results(read_results(out))
    print(f"run directory: {out}\nreport: {write_report(out)}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fedsilo.runs.report import print_results, read_results, write_report

    report = write_report(Path(args.run_dir))
    results = read_results(Path(args.run_dir))
    if results:
        print_results(results)
    print(f"report: {report}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from fedsilo.datafetch import default_data_root, ensure

    dest = Path(args.dest) if args.dest else default_data_root() / args.task
    path = ensure(args.task, dest, Path(args.mirror) if args.mirror else None)
    print(f"{args.task} data verified in {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsilo", description="Cross-silo federated learning for NLP.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an experiment from a TOML config")
    r.add_argument("config", help="experiment TOML, e.g. experiments/lorar/small.toml")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set federation.rounds=5 (repeatable)")
    r.add_argument("--out", help="run directory (default: OUT_DIR/NAME from the config)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    r.add_argument("--engine", choices=["local", "flower-sim"], default="local",
                   help="local: in-process (default); flower-sim: Flower's simulation engine, one virtual "
                        "SuperNode per silo (deployment: see docs/flower.md)")
    r.set_defaults(func=_cmd_run)
    dep = sub.add_parser("deploy", help="run a config on a real Flower deployment on this machine "
                                        "(SuperLink + one SuperNode per silo); everything is stopped after")
    dep.add_argument("config")
    dep.add_argument("--set", action="append", metavar="KEY=VALUE")
    dep.add_argument("--out", help="run directory (default: OUT_DIR/NAME from the config)")
    dep.add_argument("--resume", action="store_true")
    dep.add_argument("--workdir", help="per-silo data copies, Flower state and logs (default: OUT-flower)")
    dep.set_defaults(func=_cmd_deploy)
    rep = sub.add_parser("report", help="(re)write report.md and plots of a run directory")
    rep.add_argument("run_dir")
    rep.set_defaults(func=_cmd_report)
    d = sub.add_parser("data", help="obtain and verify a benchmark's files (pinned commit + sha256)")
    d.add_argument("task", choices=["text2sql"])
    d.add_argument("--mirror", help="local folder laid out like shared/data (default: $FEDSILO_DATA_MIRROR, "
                                    "then ../shared/data); else download from the public source")
    d.add_argument("--dest", help="where to put the files (default: $FEDSILO_DATA or ~/.cache/fedsilo/data)")
    d.set_defaults(func=_cmd_data)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from fedsilo.config import ConfigError
    from fedsilo.datafetch import DataError
    from fedsilo.runs.rundir import RunDirError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (ConfigError, DataError, RunDirError, FileNotFoundError) as err:
        print(f"fedsilo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedsilo: interrupted; the last complete round's checkpoint is kept (use --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
