"""What a privacy ledger line must hold (the line `SiloLedger.record` writes), checked field by field.

Why: ε is computed from every line, so a line that parses as JSON but holds `"steps": -40`, σ NaN or a
mechanism without a level would silently lower ε or break the run and `fedsilo ledger` far from its cause.
Plain checks rather than pydantic: JSON's ints, floats and bools need exact types (3.0 is no step count,
true no round), and the error names the field as written in the file (`mechanisms[0].steps`).
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable

VERSION = 1  # of the line format


def _int(low: int) -> tuple[Callable[[object], bool], str]:
    return (lambda v: type(v) is int and v >= low), f"must be an integer ≥ {low}"


def _number(ok: Callable[[float], bool], what: str) -> tuple[Callable[[object], bool], str]:
    """An int or float that float() reads finite (NaN, ±inf and 1e999-sized ints fail the bound)."""
    return ((lambda v: type(v) in (int, float) and abs(v) <= sys.float_info.max and ok(v)),
            f"must be a finite number {what}")


def _or_null(check: tuple[Callable[[object], bool], str]) -> tuple[Callable[[object], bool], str]:
    ok, what = check
    return (lambda v: v is None or ok(v)), f"{what}, or null"


_TEXT = (lambda v: isinstance(v, str)), "must be a string"
_NAME = (lambda v: isinstance(v, str) and v != ""), "must be a non-empty string"
_SHA256 = (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
           "must be a sha256 (64 lowercase hex digits)")

_MECHANISM = {
    "level": ((lambda v: v in ("record", "silo")), 'must be "record" or "silo"'),
    "noise_multiplier": _number(lambda v: v > 0, "> 0"),
    "sample_rate": _number(lambda v: 0 < v <= 1, "in (0, 1]"),
    "steps": _int(1),
    "delta": _or_null(_number(lambda v: 0 < v < 1, "in (0, 1)")),
}
_LINE = {
    "v": ((lambda v: type(v) is int and v == VERSION), f"must be {VERSION}"),
    "run": _NAME,
    "round": _int(1),
    "scope": _NAME,
    "silo": _TEXT,
    "mechanisms": ((lambda v: isinstance(v, list)), "must be a list of mechanisms"),
    "released": _SHA256,
    "received": _or_null(_SHA256),
    "masked": ((lambda v: isinstance(v, bool)), "must be true or false"),
    "time": _TEXT,
}
_OPTIONAL = {"delta"}


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_bad(obj: object, spec: dict, path: str) -> tuple[str, str] | None:
    """(field path, problem) of the first bad field of `obj` against `spec`, in `spec`'s order, then
    unknown keys; None if all are good."""
    if not isinstance(obj, dict):
        return path or "(top level)", f"must be an object, got {_shown(obj)}"
    prefix = f"{path}." if path else ""
    for key, (ok, what) in spec.items():
        if key not in obj:
            if key not in _OPTIONAL:
                return prefix + key, f"missing ({what})"
        elif not ok(obj[key]):
            return prefix + key, f"{what}, got {_shown(obj[key])}"
        elif key == "mechanisms":
            for i, mechanism in enumerate(obj[key]):
                if bad := _first_bad(mechanism, _MECHANISM, f"{prefix}mechanisms[{i}]"):
                    return bad
    unknown = next((k for k in obj if k not in spec), None)
    return None if unknown is None else (prefix + unknown, "unknown key (not a line fedsilo writes)")


def check_entry(entry: object, where: str) -> dict:
    """`entry` (one parsed line) if every field is what the ledger writes; else ValueError
    `privacy ledger PATH:LINE: FIELD: PROBLEM` naming the first bad field."""
    bad = _first_bad(entry, _LINE, "")
    if bad is not None:
        raise ValueError(f"privacy ledger {where}: {bad[0]}: {bad[1]}")
    return entry
