"""The vocabulary every layer's settings are written in, and how a settings error names its key.

Each layer owns its settings (client/settings.py, models/settings.py, a task's settings class);
fedsilo.config composes them into the run's config. Errors name the key as the user wrote it
(`exchange.upload_options.share`), whichever layer's settings class found it.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def choice(registry) -> Any:
    """A str field whose value must name an entry of `registry` (checked at validation time)."""
    return Annotated[str, AfterValidator(registry.check)]


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Limit = FiniteFloat | Literal["off"]  # a safeguard's limit, or "off"


class SectionError(ValueError):
    """Raised inside validation with a message that already names its key in full (`task.<key>`,
    `clients.<silo>.<key>`), so the outer validation passes it on unchanged."""


def where_what(err: ValidationError, prefix: str = "") -> str:
    """'<key path>: <what is wrong>' for the first error of `err` (the count of the others appended)."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    msg = first["msg"]
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, SectionError):  # already names its key
        return str(ctx_err)
    where = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "literal_error":
        msg = f"{first['input']!r} is not a choice: {msg[len('Input should be '):]}"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {msg}{more}"


def toml_value(v: Any) -> str:
    """`v` as TOML writes it (a message quotes a config value the way the user wrote it)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else toml_value(k)
