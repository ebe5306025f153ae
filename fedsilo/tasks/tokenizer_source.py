"""Which tokenizer a run's model reads: the task's own, or the one saved beside `model.init_from`'s
checkpoint (a model keeps the vocabulary it was trained with). The task keys that only shape the task's
tokenizer are then that tokenizer's; the config's validation fills or refuses them here."""
from __future__ import annotations

import tomllib
from pathlib import Path

from fedsilo.models.settings import default_name, reads_task_tokenizer
from fedsilo.settings import SectionError, toml_value

from . import TASKS, TaskSettings


TOKENIZER_DIR = "tokenizer"  # in a run directory: the task tokenizer its model was trained with

# The [task] keys that only shape a task's own tokenizer (TaskPlugin.tokenizer): a settings class may say
# so itself (`tokenizer_keys`, a ClassVar); these are the built-in tasks'.
_TOKENIZER_KEYS = {"translation": ("vocab_size", "tokenizer_model", "tokenizer_domain")}


def tokenizer_keys(task: TaskSettings) -> tuple[str, ...]:
    """The task's keys that only say how its own tokenizer is fitted (none when it has no tokenizer)."""
    if TASKS.get(task.name).tokenizer is None:
        return ()
    keys = getattr(type(task), "tokenizer_keys", None)
    keys = _TOKENIZER_KEYS.get(task.name, ()) if keys is None else keys
    return tuple(k for k in keys if k in type(task).model_fields)


def saved_tokenizer(init_from: str | None) -> Path | None:
    """The tokenizer folder beside `model.init_from`'s checkpoint (a run directory's `tokenizer/`), if any:
    a run that starts from that checkpoint uses it, not the task's own."""
    if not init_from:
        return None
    source = Path(init_from).expanduser()
    saved = (source if source.is_dir() else source.parent) / TOKENIZER_DIR
    return saved if saved.is_dir() else None


def model_kind_name(cfg) -> tuple[str | None, str | None]:
    """The model kind and name a run builds: the config's, else the task's defaults, else the kind's."""
    defaults = TASKS.get(cfg.task.name).default_model
    kind = cfg.model.kind if cfg.model.kind is not None else defaults.get("kind")
    name = cfg.model.name if cfg.model.name is not None else defaults.get("name")
    return kind, name if name is not None else default_name(kind)


def _recorded_task(folder: Path, task: str) -> dict | None:
    """The [task] section of `folder`/config.toml when it is a `task` run's, else None."""
    try:
        recorded = tomllib.loads((folder / "config.toml").read_text()).get("task")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return recorded if isinstance(recorded, dict) and recorded.get("name", "text2sql") == task else None


def tokenizer_fill(cfg) -> dict:
    """The tokenizer keys `cfg` takes from `model.init_from`'s source run (what its saved tokenizer was
    fitted with); a key the config sets to another value raises SectionError naming both keys."""
    keys = tokenizer_keys(cfg.task)
    saved = saved_tokenizer(cfg.model.init_from) if keys else None
    if saved is None or not reads_task_tokenizer(*model_kind_name(cfg)):
        return {}
    fields = type(cfg.task).model_fields
    recorded = _recorded_task(saved.parent, cfg.task.name)
    if recorded is None:  # nothing says what it was fitted with: a value set here cannot be honoured
        for key in keys:
            value = getattr(cfg.task, key)
            if value != fields[key].default:
                raise SectionError(f"task.{key} = {toml_value(value)}: not read, model.init_from = "
                                   f"{toml_value(cfg.model.init_from)} starts from the tokenizer saved in {saved}, and "
                                   f"{saved.parent} holds no config.toml saying what it was fitted with; "
                                   f"remove task.{key}")
        return {}
    used = {key: recorded.get(key, fields[key].default) for key in keys}
    for key in keys:
        value = getattr(cfg.task, key)
        if key in cfg.task.model_fields_set and value != used[key]:
            raise SectionError(f"task.{key} = {toml_value(value)}: not read, model.init_from = {toml_value(cfg.model.init_from)} "
                               f"starts from the tokenizer saved in {saved}, fitted with {key} = {toml_value(used[key])} "
                               f"({saved.parent / 'config.toml'}); remove task.{key} or set it to {toml_value(used[key])}")
    return {key: v for key, v in used.items() if getattr(cfg.task, key) != v}
