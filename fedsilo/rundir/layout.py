"""The run directory: resolved config, rounds.jsonl, checkpoints (atomic), results.

A checkpoint is written to a temporary file and renamed into place only once complete, so an
interrupted round leaves the previous round's checkpoint as the one resume trusts.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from fedsilo.config import ConfigError, RunConfig, to_toml
from fedsilo.errors import RunDirError
from fedsilo.fileio import atomic_write, atomic_write_bytes, read_jsonl, regular_file
from fedsilo.models.settings import SIZE_KEYS, unread_sizes
from fedsilo.settings import toml_value
from fedsilo.rundir.tensor_check import tensor_problem

# Keys that may change between a run and its resume without changing its past (more rounds; how the
# CPU is used, which each round records in rounds.jsonl as `compute`). Results equal across worker
# counts only at equal threads per client (float reductions depend on the thread count).
RESUMABLE_CHANGES = {("federation", "rounds"), ("engine", "threads"), ("engine", "workers")}
LEDGER_FOLDER = "privacy-ledger"  # in a run directory: each silo's privacy ledger (in-process runs)
FAILED = "failed.json"  # why a run stopped (RunFailed); a resume repeats the failure instead of finishing


def _comparable(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for section, key in RESUMABLE_CHANGES:
        cfg.get(section, {}).pop(key, None)
    cfg.pop("out_dir", None)
    cfg.pop("plugin_dir", None)  # where the plugins were found, not what they are: a moved config still resumes
    cfg.pop("tracking", None)  # where the run is mirrored, not what it trains: tracking may be turned on for a resume
    return cfg


def config_hash(cfg: RunConfig) -> str:
    """What a checkpoint must have been trained under (the config, less what a resume may change)."""
    text = json.dumps(_comparable(cfg.model_dump(exclude_none=True)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _structure_problem(state: object, like: dict) -> str | None:
    """What is wrong with a loaded checkpoint's shape, or None."""
    if not isinstance(state, dict):
        return "it is not a dict"
    missing = [k for k in ("round", "run_id", "config", "server", "clients") if k not in state]
    if missing:
        return f"it lacks {', '.join(missing)} (written by another program or an older fedsilo)"
    if not isinstance(state["round"], int) or not isinstance(state["server"], dict) \
            or not isinstance(state["server"].get("params"), dict) or "optimizer" not in state["server"]:
        return "its round or server state has the wrong structure"
    problem = tensor_problem(state["server"]["params"], like)
    if problem is not None:
        return problem
    where = _nonfinite(state["server"]["optimizer"], "optimizer")
    if where is not None:  # e.g. FedOPT/Adam moments: every later step would be skipped
        return f"its server optimiser state holds NaN/Inf values (server {where})"
    return None


def _nonfinite(value: object, where: str) -> str | None:
    """The path of the first NaN/Inf float or floating tensor in nested dicts and lists, or None."""
    if isinstance(value, torch.Tensor):
        return where if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    if isinstance(value, float):
        return where if not math.isfinite(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _nonfinite(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.toml"
        self.rounds = self.path / "rounds.jsonl"
        self.checkpoint = self.path / "checkpoint.pt"
        self.best = self.path / "best.pt"
        self.results = self.path / "results.json"
        self.failed = self.path / FAILED

    def prepare(self, cfg: RunConfig, resume: bool) -> None:
        """Create (fresh run) or check (resume) the directory against the config. A resume writes
        nothing here: `write_config` once its checkpoint is accepted."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"{self.path} is a file, not a run directory")
        if resume and self.config.is_file():
            try:
                saved = tomllib.loads(self.config.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
                raise RunDirError(f"{self.config} is not readable: {err}") from None
            if _comparable(saved) != _comparable(cfg.model_dump(exclude_none=True)):
                raise RunDirError(f"--resume: the config differs from the one in {self.config}; "
                                  "only " + ", ".join(f"{a}.{b}" for a, b in sorted(RESUMABLE_CHANGES)) +
                                  " and the [tracking] section may change")
            return
        if any(p.exists() for p in (self.checkpoint, self.rounds, self.results, self.failed)):
            raise RunDirError(f"{self.path} already holds a run: pass --resume to continue it, or choose "
                              "another --out")
        self.write_config(cfg)

    def write_config(self, cfg: RunConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.config, to_toml(cfg).encode())

    def run_id(self) -> str:
        """A unique id for this run (kept across resumes): names the silos' state on their disks. A
        deleted `run_id` file is restored from the checkpoint, which carries it."""
        path = self.path / "run_id"
        if not path.exists():
            state = self.load(self.checkpoint) or self.load(self.best)
            found = state.get("run_id") if isinstance(state, dict) else None
            atomic_write_bytes(path, (found if isinstance(found, str) and found else uuid.uuid4().hex).encode())
        return path.read_text().strip()

    def record_failure(self, reason: str) -> None:
        """Why the run stopped (atomic), so that a resume fails again instead of reporting results."""
        rounds = self.read_rounds()
        record = {"reason": reason, "round": rounds[-1]["round"] if rounds else 0}
        atomic_write_bytes(self.failed, (json.dumps(record, indent=1) + "\n").encode())

    def failure(self) -> str | None:
        """The reason a run stopped with an error (`record_failure`), or None."""
        if not self.failed.exists():
            return None
        try:
            return str(json.loads(self.failed.read_text())["reason"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise RunDirError(f"{self.failed} is not readable ({err}); the run stopped with an error earlier: "
                              "start a new run with another --out") from None

    def append_round(self, record: dict) -> None:
        with open(self.rounds, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_rounds(self) -> list[dict]:
        """The complete lines of rounds.jsonl; a partly written last line (what a crash leaves) is
        ignored, any other bad line is an error naming file and line."""
        if not self.rounds.exists():
            return []
        try:
            parsed, _ = read_jsonl(self.rounds.read_text(), str(self.rounds))
        except ValueError as err:
            raise RunDirError(str(err)) from None
        for lineno, record in parsed:
            if not isinstance(record, dict) or not isinstance(record.get("round"), int):
                raise RunDirError(f"{self.rounds}:{lineno}: not a round record")
        return [record for _, record in parsed]

    def truncate_rounds(self, last_round: int) -> None:
        """Forget rounds logged after the checkpoint (they will be run again)."""
        if not self.rounds.exists():
            return
        keep = [r for r in self.read_rounds() if r["round"] <= last_round]
        atomic_write_bytes(self.rounds, "".join(json.dumps(r) + "\n" for r in keep).encode())

    def save(self, path: Path, state: dict) -> None:
        atomic_write(path, lambda fh: torch.save(state, fh))

    def load(self, path: Path, device: torch.device | str = "cpu") -> dict | None:
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location=device, weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user-facing problem
            raise RunDirError(f"{path} is not a readable fedsilo checkpoint: {err}") from None

    def load_checkpoint(self, path: Path, identity: dict, like: dict, device: torch.device | str = "cpu",
                        server_problem: Callable[[dict, list[dict]], str | None] | None = None) -> dict | None:
        """A checkpoint of *this* run: right structure, tensors shaped like `like` and finite, the
        same run id and config hash, and as many rounds in rounds.jsonl as it has done; its server state
        agreeing with those rounds' records (`server_problem(server state, records)`: e.g. the silo-level
        DP accountant, which the records rebuild)."""
        state = self.load(path, device)
        if state is None:
            return None
        problem = _structure_problem(state, like)
        if problem is None and state["run_id"] != identity["run_id"]:
            problem = f"it belongs to another run (run id {state['run_id']}, this run is {identity['run_id']})"
        if problem is None and state["config"] != identity["config"]:
            problem = "it was trained under another config"
        if problem is None and path == self.checkpoint and "best" not in state:
            problem = "it lacks the best round's record"
        if problem is None and path == self.checkpoint:
            logged = [r["round"] for r in self.read_rounds() if r["round"] <= state["round"]]
            if logged != list(range(1, state["round"] + 1)):
                problem = (f"it is at round {state['round']} but {self.rounds.name} holds rounds "
                           f"{logged[:1] + ['...'] + logged[-1:] if len(logged) > 2 else logged}")
        if problem is None and server_problem is not None:
            problem = server_problem(state["server"], [r for r in self.read_rounds() if r["round"] <= state["round"]])
        if problem:
            raise RunDirError(f"{path} cannot be resumed: {problem}; start afresh with another --out")
        return state

    def write_results(self, results: dict) -> None:
        atomic_write_bytes(self.results, (json.dumps(results, indent=2) + "\n").encode())

    def read_results(self) -> dict | None:
        if not self.results.exists():
            return None
        try:
            return json.loads(self.results.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RunDirError(f"{self.results} is not readable JSON: {err}") from None



def tokenizer_identity(tokenizer) -> str | None:
    """A short hash of a tokenizer's vocabulary (piece → id), recorded in every checkpoint: an
    embedding row means a piece only under the vocabulary it was trained with, and two vocabularies
    of one size load onto each other without any shape error. None for a tokenizer without one."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    pieces = sorted(vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pieces, ensure_ascii=False).encode()).hexdigest()[:16]


def init_tensors(source: str | Path, like: dict, tokenizer: str | None = None, model=None) -> dict[str, torch.Tensor]:
    """The tensors `model.init_from` names: a run directory's best.pt (its selected global model), a
    fedsilo checkpoint file, or a plain state dict. Each must be a tensor of the model, shaped and typed
    as there and finite (`tensor_problem`); model tensors the source lacks keep their fresh values (with
    a warning: a partial start is allowed).
    `tokenizer`: the identity of the tokenizer this run fitted itself (none saved beside the
    checkpoint): a checkpoint recording another is refused, one recording none is warned about.
    `model`: this run's [model] settings, which a refusal compares with a run directory's."""
    path = Path(source).expanduser()
    folder = path
    if path.is_dir():
        if not os.path.lexists(path / "best.pt"):
            raise ConfigError(f"model.init_from: {path} holds no best.pt (a run directory with at least "
                              "one evaluated round, or a checkpoint file)")
        path = path / "best.pt"
    elif not os.path.lexists(path):
        raise ConfigError(f"model.init_from: {path} is neither a run directory nor a checkpoint file")
    regular_file(path, "model.init_from", ConfigError)  # a FIFO would block torch.load for ever
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise ConfigError(f"model.init_from: {path} is not a readable checkpoint: {err}") from None
    recorded = state.get("tokenizer") if isinstance(state, dict) else None
    if isinstance(state, dict) and isinstance(state.get("server"), dict):
        state = state["server"].get("params")
    if not isinstance(state, dict) or not state or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ConfigError(f"model.init_from: {path} holds no named tensors (a fedsilo checkpoint or a state dict)")
    problem = tensor_problem(state, like, partial=True)  # missing tensors: warned about below
    if problem is not None:
        raise ConfigError(f"model.init_from: {path}: {problem}{_settings_differ(folder, model)}")
    if tokenizer is not None and recorded is not None and recorded != tokenizer:
        raise ConfigError(f"model.init_from: {path} was trained with another tokenizer (vocabulary {recorded}, this "
                          f"run's {tokenizer}): its embeddings would sit on other pieces; start from the run "
                          "directory that holds it (its tokenizer/ is then used), or refit the same tokenizer")
    if tokenizer is not None and recorded is None:
        warnings.warn(f"model.init_from: {path} does not record the tokenizer it was trained with (a bare state "
                      "dict or an older checkpoint), and this run fits its own: whether its embeddings fit this "
                      "tokenizer's pieces cannot be checked; start from its run directory (its tokenizer/ is then "
                      "used) to be sure", stacklevel=2)
    missing = [n for n in like if n not in state]
    if missing:
        warnings.warn(f"model.init_from: {path} has no values for {len(missing)} of the model's tensors "
                      f"(e.g. {missing[0]!r}); they keep their initial values", stacklevel=2)
    return state


def _settings_differ(folder: Path, model) -> str:
    """Where a run directory's tensors do not fit: the [model] settings its config.toml gives otherwise
    than this run's (`model`), each there and here; "" when none is known to differ."""
    config = folder / "config.toml"
    if model is None or not config.is_file():
        return ""
    try:
        there = tomllib.loads(config.read_text()).get("model", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return ""
    unread = unread_sizes(model.kind, model.name)[0]
    keys = ["kind", "name", *(k for k in SIZE_KEYS if k != "dropout" and k not in unread)]
    differ = [f"model.{k} = {toml_value(there[k])} there, {toml_value(getattr(model, k))} here" for k in keys
              if there.get(k) is not None and there[k] != getattr(model, k)]
    return f"; {config} differs from this config in {', '.join(differ)}: set them here as there" if differ else ""
