"""What each `fedsilo COMMAND` does, given its parsed arguments: the runs layer called, its results
printed. The parser, the one-line errors and the stop signals are the command line's (cli.py); these
bodies are kept apart from them so that `fedsilo --help` loads none of what a command needs.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from fedsilo.errors import UserError
from fedsilo.fileio import regular_file

NAME_MAX = 255  # bytes in a file name (ext4, XFS, APFS, NTFS): a silo's key files are named after it


def _report(out: Path, show: bool = True) -> Path:
    """Print the results table (if any) and (re)write report.md; a malformed run file is a user error."""
    from fedsilo.rundir.records import read_results
    from fedsilo.runs.report import write_report
    from fedsilo.runs.tables import print_results

    try:
        results = read_results(out)
        if results and show:
            print_results(results)
        return write_report(out)
    except ValueError as err:  # malformed rounds.jsonl / results.json (the message names file and line)
        raise UserError(f"cannot report {out}: {err}") from None


def _display(args: argparse.Namespace):
    """Live bars, or with --no-progress a plain line per finished round (logs and CI still see it move)."""
    return "lines" if args.no_progress else True


def _assignments(args: argparse.Namespace) -> list[str]:
    """--set KEY=VALUE, then --tracking as the setting it stands for (the flag wins)."""
    tracking = getattr(args, "tracking", None)
    return list(args.set or []) + ([f"tracking.backend={tracking}"] if tracking else [])


def cmd_run(args: argparse.Namespace) -> int:
    from fedsilo.config import load_config
    from fedsilo.runs.runner import run_experiment
    from fedsilo.runs.tables import print_results
    from fedsilo.tracking.settings import require_packages

    cfg = load_config(args.config, _assignments(args))
    require_packages(cfg.tracking)
    out = Path(args.out) if args.out else Path(cfg.out_dir) / cfg.name
    if args.engine == "flower-sim" and args.policy:
        raise UserError("--policy: Flower's simulation gives its virtual SuperNodes no node config; use the "
                        "in-process engine, or fedsilo deploy (each SuperNode reads its own --policy file)")
    if args.engine == "flower-sim":
        from fedsilo.runs.flower import run_simulation
        cfg = absolute_config(cfg)  # Flower's workers may run in another folder
        results = run_simulation(cfg, out, resume=args.resume, show_progress=_display(args))
    else:
        results = run_experiment(cfg, out, resume=args.resume, show_progress=_display(args),
                                 policies=_policies(args))
    print_results(results)
    print(f"run directory: {out}\nreport: {out / 'report.md'}")  # written by the run (either engine)
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from fedsilo.runs.study import run_study
    from fedsilo.runs.studyfile import parse_seeds

    out = Path(args.out) if args.out else Path("runs") / Path(args.study).stem
    only = [v.strip() for v in args.only.split(",") if v.strip()] if args.only else None
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None  # before anything runs
    run_study(args.study, out, _assignments(args), only, show_progress=_display(args), seeds=seeds)
    print(f"study directory: {out}\nreport: {out / 'report.md'}")
    return 0


def deploy_paths(cfg, out: str | None, workdir: str | None) -> tuple[Path, Path]:
    """Absolute run directory and work folder: Flower's processes run in the work folder, so a
    relative path (the README's `--out runs/x`) would be read from there."""
    out_path = Path(out) if out else Path(cfg.out_dir) / cfg.name
    out_path = out_path.expanduser().resolve()
    work = Path(workdir).expanduser().resolve() if workdir else out_path.with_name(out_path.name + "-flower")
    return out_path, work


def absolute_config(cfg):
    """The config with its local paths made absolute (task.data_dir, a local model folder,
    model.init_from): Flower's processes run in other folders."""
    from fedsilo.config import validate
    try:
        from fedsilo.models.seq2seq import BUILTIN
    except ImportError:
        BUILTIN = ("tiny-t5", "minilm2bert", "transformer")

    raw = cfg.model_dump(exclude_none=True)
    task, model = raw.get("task", {}), raw.get("model", {})
    if task.get("data_dir"):
        task["data_dir"] = str(Path(task["data_dir"]).expanduser().resolve())
    name = model.get("name")
    if isinstance(name, str) and name not in BUILTIN and Path(name).expanduser().is_dir():
        model["name"] = str(Path(name).expanduser().resolve())  # a local checkpoint folder
    if model.get("init_from"):
        model["init_from"] = str(Path(model["init_from"]).expanduser().resolve())
    return validate(raw, "config")


def _policies(args: argparse.Namespace) -> dict[str, str]:
    """--policy SILO=FILE (repeatable): each silo's own policy file (fedsilo.client.policy)."""
    out = {}
    for item in args.policy or []:
        silo, sep, path = item.partition("=")
        if not sep or not silo or not path:
            raise UserError(f"--policy {item!r}: write SILO=FILE, e.g. --policy bank=bank-policy.toml")
        if silo in out:
            raise UserError(f"--policy: silo {silo!r} is given twice")
        out[silo] = str(regular_file(path, f"--policy {silo}"))  # a FIFO would block the run for ever
    return out


def cmd_deploy(args: argparse.Namespace) -> int:
    """A real Flower deployment on 127.0.0.1: SuperLink + one SuperNode per silo, then clean up."""
    from fedsilo.config import load_config, to_toml
    from fedsilo.client.policy import read_policy
    from fedsilo.engines.flower.deploy import DeploymentError, LocalDeployment, silo_nodes
    from fedsilo.rundir.datacheck import blocking_error
    from fedsilo.rundir.lock import RunLock
    from fedsilo.rundir.records import read_results
    from fedsilo.rundir.refusal import left_as_found
    from fedsilo.runs.datareport import inspect_silos
    from fedsilo.runs.tables import print_results
    from fedsilo.tasks import TASKS

    from fedsilo.tracking.settings import require_packages

    cfg = absolute_config(load_config(args.config, _assignments(args)))
    require_packages(cfg.tracking)  # the ServerApp tracks, with this Python's packages
    out, work = deploy_paths(cfg, args.out, args.workdir)
    # One writer per run directory: held here for the whole deployment; the ServerApp gets the token. A
    # deployment refused or ended before it recorded anything leaves `out` as it found it.
    with RunLock(out) as lock, left_as_found(out):
        with warnings.catch_warnings(record=True) as caught:  # the data is checked before any process starts
            warnings.simplefilter("always", UserWarning)
            data = TASKS.get(cfg.task.name).data_dir(cfg.task)
            error = blocking_error(inspect_silos(cfg, build=False))  # each silo checks again where it runs
        for w in caught:
            print(f"fedsilo: warning: {w.message}", file=sys.stderr)
        if error is not None:
            raise error
        try:
            silos = silo_nodes(cfg.task, data)  # each SuperNode reads its silo's files where they are
            for silo, path in _policies(args).items():  # each SuperNode checks every round against its own file
                if silo not in silos:
                    raise UserError(f"--policy {silo}=…: {silo!r} is not a silo of this run ({', '.join(silos)})")
                read_policy(path)  # a bad file fails here, before any process starts
                silos[silo]["policy"] = str(Path(path).resolve())
            work.mkdir(parents=True, exist_ok=True)
            config = work / "config.toml"
            config.write_text(to_toml(cfg))
            processes = work / "processes"
            print(f"starting a SuperLink and {len(silos)} SuperNodes on 127.0.0.1 (logs in {processes})",
                  file=sys.stderr, flush=True)
            with LocalDeployment(processes, silos, warm=not args.cold_clientapps) as dep:
                dep.lock = lock.token
                dep.run(config, out, resume=args.resume, progress=not args.no_progress)
        except DeploymentError as err:
            raise UserError(str(err)) from None
    report = _report(out, show=False)
    results = read_results(out)
    if results:
        print_results(results)
    print(f"run directory: {out}\nreport: {report}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    report = _report(Path(args.run_dir))
    print(f"report: {report}")
    return 0


def cmd_track(args: argparse.Namespace) -> int:
    from fedsilo.runs.tracked import track_run

    def warn(message: str) -> None:
        print(f"fedsilo: warning: {message}", file=sys.stderr)

    results = track_run(Path(args.run_dir), _assignments(args), warn)
    state = "finished" if results is not None else "not finished: its rounds so far"
    print(f"tracked: {args.run_dir} ({state}); see docs/tracking.md for where to look")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fedsilo.runs.export import export_run

    done = export_run(Path(args.run_dir), Path(args.out), args.silo, args.with_base, args.merged, args.force)
    if args.silo is not None:
        print(f"{args.silo}: its own model (the run trained each silo alone)" if done.alone else
              f"{args.silo}: {len(done.personal)} of its own tensors over the global ones" if done.personal else
              f"{args.silo} keeps no tensors of its own (exchange.private is empty): this is the global model")
    what = {"adapters": "LoRA adapters in peft's format", "merged": "the adapters merged into the base",
            "full": "the whole model (full fine-tuning)"}[done.form]
    print(f"{'adapters' if done.form == 'adapters' else 'model'}: {done.folder}, {what} (model card: README.md)")
    print(f"load with: {done.loader}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from fedsilo.runs.generate import generate

    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file == "-":
        prompt = sys.stdin.read()
    else:
        try:  # a FIFO or a folder is refused before it is opened (a FIFO's reader waits forever for a writer)
            prompt = regular_file(args.prompt_file, "--prompt-file").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"--prompt-file: cannot read {args.prompt_file}: {err}") from None
    print(generate(Path(args.run_dir), prompt, args.silo, args.max_new_tokens, args.system, args.input))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fedsilo.runs.compare import CompareError, compare_runs

    for run in (Path(args.run), Path(args.baseline)):
        if os.path.lexists(run / "results.json"):  # a FIFO would block the reader for ever
            regular_file(run / "results.json", "compare")
    try:
        summary, md = compare_runs(Path(args.run), Path(args.baseline), args.tie)
    except CompareError as err:
        raise UserError(str(err)) from None
    print(md.read_text(), end="")
    print(f"written: {md} and {md.with_suffix('.json')}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.task == "check":
        return _data_check(args)
    if args.config:
        raise UserError(f"fedsilo data {args.task} takes no config (did you mean: fedsilo data check {args.config}?)")
    from fedsilo.datafetch import default_data_root, ensure, find_mirror

    dest = (Path(args.dest).expanduser() if args.dest else default_data_root() / args.task).resolve()
    mirror = Path(args.mirror).expanduser() if args.mirror else find_mirror()
    source = f"mirror {mirror.resolve()}" if mirror else "the public source (pinned commit)"
    print(f"{args.task} data goes to {dest} (missing or changed files come from {source})", flush=True)
    path = ensure(args.task, dest, Path(args.mirror).expanduser() if args.mirror else None)
    print(f"{args.task} data verified in {path}")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    """Every silo of a config, or of each data setup of a study file, checked as a run would check it,
    with what a run uses of it and its token lengths; exit 1 when a silo cannot be run (malformed rows
    it does not skip, an empty split, a file it cannot read, splits it cannot cut: that silo's row)."""
    from fedsilo.config import load_config
    from fedsilo.runs.datareport import check_config, write_json
    from fedsilo.runs.datastudy import check_study, is_study, study_setups

    if not args.config:
        raise UserError("fedsilo data check needs a config: fedsilo data check CONFIG (or a study file)")
    study = is_study(args.config)
    loaded = study_setups(args.config, args.set or []) if study else load_config(args.config, args.set or [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        checked = (check_study if study else check_config)(loaded, not args.no_lengths)
    for message in dict.fromkeys(str(w.message) for w in caught):  # a study's setups may repeat one
        print(f"fedsilo: warning: {message}", file=sys.stderr)
    print(checked.text())
    if args.json:
        write_json(checked.to_json(), Path(args.json))
        print(f"written: {args.json}")
    return 1 if checked.blocking else 0


def cmd_init(args: argparse.Namespace) -> int:
    """A commented config for a folder of silos; what it cannot tell is left as DECIDE lines."""
    from fedsilo.runs.init import init_config
    from fedsilo.runs.init_text import write_config

    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"{out} exists; choose another --out, or --force to overwrite it")
    draft = init_config(Path(args.data_dir), args.task, out)
    note = write_config(draft, out)  # loaded as a run would, before it is written
    if note:
        print(f"note: {out} is not valid until the DECIDE lines are settled ({note})")
    print(f"written: {out} ({len(draft.guesses)} silo(s): {', '.join(g.name for g in draft.guesses)})")
    for silo, what in [(g.name, d) for g in draft.guesses for d in g.decide]:
        print(f"  DECIDE for {silo}: {what}")
    unused = draft.unused + [(f"{g.name}/{name}", why) for g in draft.guesses for name, why in g.unused]
    for name, why in unused:
        print(f"  not used: {name} ({why})")
    print(f"next: fedsilo data check {out}\n      fedsilo run {out}")
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """A silo's privacy ledger (fedsilo.privacy.ledger), read or reset where it lives: on the silo, by its
    operator. No message from a coordinator can do either."""
    from fedsilo.privacy.ledger import PrivacyLedger, describe

    ledger = PrivacyLedger(args.path)
    if not os.path.lexists(ledger.path):
        raise UserError(f"{ledger.path}: no privacy ledger there (a SuperNode keeps it at <state-dir>/privacy-ledger.jsonl "
                        "or its node config's `ledger`; an in-process run at <out>/privacy-ledger/<silo>.jsonl)")
    try:
        entries = ledger.entries()  # what is not a ledger is refused before any output, and before a reset writes
        if args.ledger_command == "show":
            shown = describe(entries)
            print(f"{ledger.path}: {shown[0]}" if not entries else "\n".join([f"{ledger.path}:", *shown]))
            return 0
        archive, count = ledger.reset(args.scope)
    except ValueError as err:  # a malformed line (file:line), or a scope the ledger does not hold
        raise UserError(str(err)) from None
    print(f"archived {count} release(s) of scope {args.scope} to {archive}; the silo's budget for that scope starts "
          "again from nothing")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """A silo's signing key, or the federation's roster of public keys (fedsilo.privacy.roster): the PKI that
    lets secure aggregation hold against a server that lies. Both are made and passed on out of band."""
    from fedsilo.privacy import roster as rosters

    if args.keys_command == "new":
        silo = args.silo
        if not silo or silo.strip() != silo or "/" in silo or silo in (".", ".."):
            raise UserError(f"--silo {silo!r} is not a silo name usable as a file name")
        longest = len(f"{silo}.key".encode())
        if longest > NAME_MAX:  # the file system's limit, said before anything is made
            raise UserError(f"--silo {silo[:20]!r}… is {len(silo.encode())} bytes: its key file {silo[:20]}….key "
                            f"would be {longest} bytes, over the {NAME_MAX} bytes a file name may have (with "
                            f".key/.pub); use a silo name of at most {NAME_MAX - 4} bytes")
        out = Path(args.out)
        key_path, pub_path = out / f"{silo}.key", out / f"{silo}.pub"
        for path in (key_path, pub_path):
            if path.exists():
                raise UserError(f"{path} exists; a silo's key is made once (to replace it, delete both files, "
                                "and give the federation the new public key for a new roster)")
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = rosters.generate_key()
        rosters.save_private_key(key, key_path)
        rosters.save_public_key(key, pub_path)
        print(f"signing key: {key_path} (mode 0600; it stays on silo {silo}'s machine: node config "
              f"signing-key=\"{key_path}\")\npublic key:  {pub_path} (give it to whoever makes the roster)\n"
              f"{silo} {rosters.public_key_text(key)}")
        return 0
    keys = {}
    for entry in args.entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise UserError(f"{entry!r} is not NAME=PUBFILE (e.g. alpha=keys/alpha.pub)")
        if name in keys:
            raise UserError(f"silo {name!r} is named twice")
        keys[name] = rosters.load_public_key(path)
    out = Path(args.out)
    if os.path.lexists(out):
        if not args.force:
            raise UserError(f"{out} exists; choose another --out, or --force to overwrite it")
        regular_file(out, "--out", UserError)  # --force overwrites a file, never a FIFO or a folder
    roster = rosters.Roster({name: rosters.raw_public_key(k) for name, k in keys.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    rosters.write_roster(roster, out)
    print(f"written: {out} ({len(keys)} silos: {', '.join(sorted(keys))})\nfingerprint: {roster.fingerprint()}\n"
          "give every silo this file out of band and compare the fingerprint with each; name it in the run's config "
          "as federation.secure_aggregation.roster_fingerprint")
    return 0
