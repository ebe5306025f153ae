"""Errors a user can act on, all in one leaf module. The CLI prints any `FedsiloError` as one line
(`fedsilo: error: …`, exit 2), never a traceback; this module imports nothing from fedsilo, so every
layer may raise them. Each keeps the builtin base it had (ValueError, RuntimeError) for callers
that catch those."""
from __future__ import annotations


class FedsiloError(Exception):
    """Bad input or state the user can fix; the message names the culprit."""


class ConfigError(FedsiloError, ValueError):
    """A config the user wrote cannot be run; the message names the culprit."""


class ConfigWarning(UserWarning):
    """A config setting that another setting makes meaningless (fedsilo.config.config_warnings): said,
    by name, as a config file is loaded; the CLI prints it as one `fedsilo: warning:` line."""


class UnknownChoice(FedsiloError, ValueError):
    """A name that no entry of a registry has; the message lists the choices."""


class DataError(FedsiloError, ValueError):
    """A user-fixable data problem (missing/corrupt file, bad record); the message names the file."""


class StoreError(FedsiloError, ValueError):
    """A client store file (clients/SILO/round-N.safetensors) that a run cannot trust."""


class CacheError(FedsiloError, ValueError):
    """A cache entry that cannot be used and cannot be rebuilt."""


class SurgeryError(FedsiloError, ValueError):
    """A model surgery (`model.surgery`) that cannot be applied to the model the config builds."""


class RunDirError(FedsiloError, RuntimeError):
    """The run directory cannot be used as asked (exists, config differs, corrupt checkpoint)."""


class RunLocked(RunDirError):
    """Another process is writing this run directory."""


class RunFailed(FedsiloError, RuntimeError):
    """The run cannot go on: rounds in a row applied no update (every client rejected or missing,
    or a server step that would break the global model). Its checkpoint stays the last good state.
    `lasting`: the run itself diverged, so a resume would meet it again (recorded by the runner);
    not when no silo answered at all (they may answer later)."""

    def __init__(self, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


class WorkerLost(FedsiloError, RuntimeError):
    """A worker process training clients died (killed, out of memory); the run's last complete
    checkpoint is kept, so `--resume` continues (not the run's own failure: nothing is recorded)."""


class CompareError(FedsiloError, ValueError):
    """The two runs cannot be compared (different tasks, no test results); the message says why."""


class StudyFailed(FedsiloError):
    """Some of a study's runs failed: the others are compared, the failed ones shown as failed."""


class DeploymentError(FedsiloError, RuntimeError):
    """A deployment that could not start or ended without results; the message quotes its log."""


class UserError(FedsiloError):
    """A command-line request that cannot be served (a missing run, a bad argument)."""
