"""`fedsilo run | study | deploy | report | track | compare | init | keys | data`: the command line.

Every error a user can cause (a bad config, a missing or corrupt file, a deployment that ended
without results) is one line `fedsilo: error: ...` and exit code 2, never a traceback. What each
command does is commands.py.
"""
# The imports inside functions here and in commands.py keep start-up down. Measured 2026-11-27 on the
# 2-core dev box (load average ~5, median of 5 runs): `import fedsilo.cli` takes 0.03 s as it is and
# 13.4 s with every one of them at the top (torch, transformers, the runs layer); `python -m fedsilo
# --help` takes 5.2 s against 14.5 s (CPU 3.4 s against 10.6 s). --help still loads torch: the `data`
# command's choices come from the task registry, which fedsilo.builtins fills.
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import warnings

from fedsilo import __version__, commands
from fedsilo.errors import ConfigWarning, FedsiloError


TRACKING_HELP = ("mirror the run into experiment trackers: mlflow (a local store beside the run directory that "
                 "`mlflow ui` opens, or [tracking] uri / $MLFLOW_TRACKING_URI), tensorboard (RUN/tensorboard), both, "
                 "or off; sets tracking.backend (docs/tracking.md)")
TRACKING_CHOICES = ["off", "mlflow", "tensorboard", "both"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `fedsilo: error:` line (exit code 2), like every other user error
        self.exit(2, f"fedsilo: error: {message} (see: {self.prog} --help)\n")


THREADS_HELP = """\
CPU threads: engine.threads (default auto) is what torch may use in all; auto is torch's own choice,
the cores this process may use (OMP_NUM_THREADS when set). One process (engine.workers = 1) uses them
all; with N worker processes each gets threads // N. On Flower each silo's ClientApp is a process of
its own and uses engine.threads itself. Each round's line in rounds.jsonl records `compute`:
{workers, threads_per_client}. Example: --set engine.workers=1 --set engine.threads=1"""


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedsilo", description="Cross-silo federated learning for NLP.", epilog=THREADS_HELP,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print fedsilo's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="run, study, deploy, report, track, export, generate, compare, init, keys, ledger or "
                                "data "
                                "(COMMAND --help for its options)")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="experiment TOML, e.g. experiments/lorar/small.toml")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config value, e.g. --set federation.rounds=5 (repeatable)")
        sp.add_argument("--out", help="run directory (default: OUT_DIR/NAME from the config)")
        sp.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
        sp.add_argument("--no-progress", action="store_true",
                        help="no progress bars: one plain line per finished round (logs, CI)")
        sp.add_argument("--tracking", choices=TRACKING_CHOICES, help=TRACKING_HELP)

    r = sub.add_parser("run", help="run an experiment from a TOML config")
    common(r)
    r.add_argument("--engine", choices=["local", "flower-sim"], default="local",
                   help="local: in-process (default); flower-sim: Flower's simulation engine, one virtual "
                        "SuperNode per silo (deployment: see docs/flower.md)")
    r.add_argument("--policy", action="append", metavar="SILO=FILE",
                   help="a silo's own policy (TOML, docs/privacy.md): it refuses every round that breaks a rule, "
                        "before anything leaves it; repeat per silo")
    r.set_defaults(func=commands.cmd_run)
    dep = sub.add_parser("deploy", help="run a config on a real Flower deployment on this machine "
                                        "(SuperLink + one SuperNode per silo); everything is stopped after")
    common(dep)
    dep.add_argument("--workdir", help="Flower's state, each silo's state and the logs (default: OUT-flower)")
    dep.add_argument("--policy", action="append", metavar="SILO=FILE",
                     help="a silo's own policy (TOML, docs/privacy.md), given to its SuperNode as node config; "
                          "repeat per silo")
    dep.add_argument("--cold-clientapps", action="store_true",
                     help="each message's ClientApp a fresh `flwr-clientapp` process, as Flower starts it (slower: "
                          "by default they are forked from a process that imported torch and fedsilo once)")
    dep.set_defaults(func=commands.cmd_deploy)
    st = sub.add_parser("study", help="run the variants of a study file (resumable) and compare them in one table")
    st.add_argument("study", help="a study TOML: [study], [base] (a run config), [variants.NAME] (changes)")
    st.add_argument("--out", help="study directory, one run directory per variant (default: runs/STEM, STEM the "
                                  "study file's name without .toml, not [study] name)")
    st.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key of the base config")
    st.add_argument("--only", help="comma-separated variants to run and compare")
    st.add_argument("--seeds", metavar="S,S,...",
                    help="run each variant once per seed, e.g. 0,1,2 (into OUT/NAME/seed-S); cells show "
                         "mean ± sample sd; wins over [study] seeds (default: the config's seed, once)")
    st.add_argument("--no-progress", action="store_true",
                    help="no progress bars: one plain line per finished round or variant (logs, CI)")
    st.add_argument("--tracking", choices=TRACKING_CHOICES, help=TRACKING_HELP + "; the study is one run with "
                    "each variant and seed nested under it")
    st.set_defaults(func=commands.cmd_study)
    rep = sub.add_parser("report", help="(re)write report.md and plots of a run directory")
    rep.add_argument("run_dir", help="a run directory (holding rounds.jsonl), e.g. runs/lorar-small")
    rep.set_defaults(func=commands.cmd_report)
    trk = sub.add_parser("track", help="log a finished (or stopped) run directory to its trackers after the fact: "
                                       "what a tracking server missed while it was down, or an older run")
    trk.add_argument("run_dir", help="a run directory (holding config.toml)")
    trk.add_argument("--tracking", choices=TRACKING_CHOICES[1:], help="the trackers (default: the run's [tracking] "
                                                                     "backend)")
    trk.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="a [tracking] setting, e.g. --set tracking.uri=http://mlflow.internal:5000")
    trk.set_defaults(func=commands.cmd_track)
    exp = sub.add_parser("export", help="write a run's best model in Hugging Face's formats: a LoRA run's adapters "
                                        "for peft (adapter_config.json + adapter_model.safetensors + the tokenizer), "
                                        "or with --merged one full model; global or one silo's own")
    exp.add_argument("run_dir", help="a run directory")
    exp.add_argument("--out", required=True, help="the folder to write (new or empty; written whole or not at all)")
    exp.add_argument("--force", action="store_true", help="replace an --out that holds files (another model) as a "
                                                          "whole; never the run itself or a folder that holds it")
    exp.add_argument("--silo", help="export this silo's personal model (its private tensors over the global ones)")
    exp.add_argument("--with-base", action="store_true", help="also save the base model (DIR/base) the adapters "
                                                              "load onto")
    exp.add_argument("--merged", action="store_true",
                     help="the adapters merged into the base (peft's merge_and_unload): one model + tokenizer that "
                          "transformers loads without peft; implied for a run without the lora surgery (full "
                          "fine-tuning), whose whole model is exported")
    exp.set_defaults(func=commands.cmd_export)
    gen = sub.add_parser("generate", help="greedy-decode an answer with a causal run's best model (instruct task): "
                                          "the prompt rendered as the run's task renders a record")
    gen.add_argument("run_dir", help="a run directory of a config with model.kind = \"causal\"")
    said = gen.add_mutually_exclusive_group(required=True)
    said.add_argument("--prompt", help="the instruction (one user turn)")
    said.add_argument("--prompt-file", metavar="FILE", help="read the instruction from FILE ('-': standard input)")
    gen.add_argument("--input", default="", metavar="TEXT",
                     help="an Alpaca input (context) for the instruction, rendered as a record's input is: after "
                          "the instruction and a blank line, in the same user turn")
    gen.add_argument("--system", default="", help="a system turn before the instruction")
    gen.add_argument("--silo", help="use this silo's personal model (its private tensors over the global ones)")
    gen.add_argument("--max-new-tokens", type=int, metavar="N",
                     help="at most N new tokens (default: the run's task.max_new_tokens)")
    gen.set_defaults(func=commands.cmd_generate, stopped="generation stopped, nothing was written")
    cmp = sub.add_parser("compare", help="task-by-task improvement of a run over a baseline run: PIR, APIR, "
                                         "Win/Lose/Tie (the FewFedWeight paper's metrics)")
    cmp.add_argument("run", help="a finished run directory")
    cmp.add_argument("--baseline", required=True, help="a finished run directory of the same tasks (the paper: "
                                                       "Data Silo, each client alone)")
    cmp.add_argument("--tie", type=float, default=0.0, help="metric differences up to this count as ties (default 0)")
    cmp.set_defaults(func=commands.cmd_compare)
    ini = sub.add_parser("init", help="write a commented config for a folder with one sub-folder (or file) per "
                                      "silo: formats, splits and fields detected, the rest marked DECIDE, every "
                                      "file left unused named with why")
    ini.add_argument("data_dir", help="a folder holding one sub-folder or file per silo (CSV, TSV, JSONL, .json "
                                      "(one JSON array of rows, as Alpaca's alpaca_data.json), or line-aligned "
                                      "files such as train.de / train.en: format lines; any of them may be .gz), "
                                      "or one silo's own folder of split files")
    ini.add_argument("--task", required=True,
                     help="the task family: translation, matching, text2sql, multitask, instruct")
    ini.add_argument("--out", default="fedsilo.toml", help="the config to write (default: fedsilo.toml)")
    ini.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    ini.set_defaults(func=commands.cmd_init)
    keys = sub.add_parser("keys", help="a silo's signing key, or the federation's roster of public keys: with them "
                                       "secure aggregation holds against a server that lies (docs/privacy.md)")
    ks = keys.add_subparsers(dest="keys_command", required=True, metavar="new|roster",
                           help="new: a silo's key pair; roster: the federation's public keys")
    kn = ks.add_parser("new", help="make a silo's Ed25519 signing key (DIR/SILO.key, mode 0600) and its public key "
                                   "(DIR/SILO.pub)")
    kn.add_argument("--out", required=True, help="the folder to write the two files into")
    kn.add_argument("--silo", required=True, help="the silo's name, as in the run's config")
    kr = ks.add_parser("roster", help="write the roster (TOML) of the silos' public keys and print its fingerprint")
    kr.add_argument("entries", nargs="+", metavar="NAME=PUBFILE", help="a silo and its public key file, e.g. "
                                                                        "alpha=keys/alpha.pub (one per silo)")
    kr.add_argument("--out", required=True, help="the roster file to write, e.g. roster.toml")
    kr.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    keys.set_defaults(func=commands.cmd_keys)
    led = sub.add_parser("ledger", help="a silo's privacy ledger: show the DP releases that left it and their ε, or "
                                        "reset one scope (archived, never deleted); only here, on the silo")
    ls = led.add_subparsers(dest="ledger_command", required=True, metavar="show|reset",
                          help="show: its releases and ε; reset: archive one scope")
    ls.add_parser("show", help="each scope's releases by run and round, and ε over all of them").add_argument(
        "path", help="the ledger file (a SuperNode's <state-dir>/privacy-ledger.jsonl, or "
                     "<out>/privacy-ledger/<silo>.jsonl of an in-process run)")
    lr = ls.add_parser("reset", help="move one scope's entries to an archive beside the ledger: its budget starts "
                                     "again (the silo's operator's decision, never a coordinator's)")
    lr.add_argument("path", help="the ledger file")
    lr.add_argument("--scope", required=True, help="the scope to reset, as `fedsilo ledger show` names it")
    led.set_defaults(func=commands.cmd_ledger)
    d = sub.add_parser("data", help="obtain and verify a benchmark's files (pinned commit + sha256), or check "
                                    "every silo of a config (data check CONFIG)")
    from fedsilo import builtins  # noqa: F401  (registers the task plug-ins: without it TASKS is empty)
    from fedsilo.tasks import TASKS  # light: settings and lazy builders only

    fetchable = [name for name in TASKS if TASKS.get(name).data]
    d.add_argument("task", choices=[*fetchable, "check"], metavar="TASK|check",
                   help=f"which benchmark's files to fetch ({', '.join(fetchable)}), or check: check every silo "
                        "of CONFIG (malformed rows by file:line, counts, duplicates, overlap between splits, "
                        "token lengths against the model's limits, file fingerprints)")
    d.add_argument("config", nargs="?", help="with check: the run config whose silos to check, or a study file "
                                             "(each data setup among its variants and seeds)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="with check: override a config value")
    d.add_argument("--json", metavar="FILE", help="with check: also write the findings as JSON")
    d.add_argument("--no-lengths", action="store_true",
                   help="with check: skip token lengths and the counts a run uses (both build the task "
                        "with the model's tokenizer)")
    d.add_argument("--mirror", help="local folder laid out like shared/data (default: $FEDSILO_DATA_MIRROR, "
                                    "then ../shared/data); else download from the public source")
    d.add_argument("--dest", help="where to put the files (default: $FEDSILO_DATA/TASK or "
                                  "~/.cache/fedsilo/data/TASK)")
    d.set_defaults(func=commands.cmd_data)
    return p


def _disk_full(err: OSError, args: argparse.Namespace) -> str:
    """Say so, and where: a write error often carries no file name, so fall back to the folder asked for."""
    where = err.filename or next((getattr(args, k) for k in ("out", "run_dir", "dest") if getattr(args, k, None)),
                                 "the run directory")
    return (f"the disk is full ({err.strerror}) writing {where}; free some space, then "
            "run the command again (a run continues from its last complete round with --resume)")


class Terminated(BaseException):
    """SIGTERM (from `timeout` or a scheduler), raised so that it unwinds like Ctrl-C: every `with`
    on the way out runs, so a deployment stops its processes and a run lock is released."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated


def _sigterm_unwinds():
    """Turn SIGTERM into `Terminated` (main thread only); returns what puts the old handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _config_warnings_as_lines(show):
    """`warnings.showwarning` printing a ConfigWarning as one `fedsilo: warning:` line, others as `show` does."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            print(f"fedsilo: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


def _stopped_by(err: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM in `err`'s chain of causes, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (KeyboardInterrupt, Terminated)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


RUN_INTERRUPTED = "the last complete round's checkpoint is kept (use --resume)"
RUN_TERMINATED = "every process it started is stopped, the last complete round's checkpoint is kept (use --resume)"


def _stopped(stop: BaseException, args: argparse.Namespace) -> int:
    """What a stop leaves, in the command's own words where it has them (`stopped` in its defaults)."""
    own = getattr(args, "stopped", None)
    if isinstance(stop, KeyboardInterrupt):
        print(f"fedsilo: interrupted; {own or RUN_INTERRUPTED}", file=sys.stderr)
        return 130
    print(f"fedsilo: terminated (SIGTERM); {own or RUN_TERMINATED}", file=sys.stderr)
    return 143


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, a usage error (already printed)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    restore_sigterm = _sigterm_unwinds()
    show = warnings.showwarning
    warnings.showwarning = _config_warnings_as_lines(show)
    try:
        return args.func(args)
    except (FedsiloError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            FileExistsError) as err:
        print(f"fedsilo: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"fedsilo: error: {_disk_full(err, args)}", file=sys.stderr)
        return 2
    except Exception as err:  # a library that wraps the stop signal it was interrupted by (torch: RuntimeError)
        stop = _stopped_by(err)
        if stop is None:
            raise
        return _stopped(stop, args)
    except (KeyboardInterrupt, Terminated) as stop:
        return _stopped(stop, args)
    finally:
        warnings.showwarning = show
        restore_sigterm()


if __name__ == "__main__":
    sys.exit(main())
