"""Errors a user can act on. The CLI prints any `FedsiloError` as one line (`fedsilo: error: …`,
exit 2), never a traceback; this module imports nothing from fedsilo, so every layer may raise them."""
from __future__ import annotations


class FedsiloError(Exception):
    """Bad input or state the user can fix; the message names the culprit."""


class StoreError(FedsiloError, ValueError):
    """A client store file (clients/SILO/round-N.safetensors) that a run cannot trust."""


class CacheError(FedsiloError, ValueError):
    """A cache entry that cannot be used and cannot be rebuilt."""


class SurgeryError(FedsiloError, ValueError):
    """A model surgery (`model.surgery`) that cannot be applied to the model the config builds."""


class WorkerLost(FedsiloError, RuntimeError):
    """A worker process training clients died (killed, out of memory); the run's last complete
    checkpoint is kept, so `--resume` continues (not the run's own failure: nothing is recorded)."""
