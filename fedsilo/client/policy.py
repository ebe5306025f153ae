"""A silo's own policy: a small TOML file on the silo's machine that the coordinator does not write.

Each round, before anything is trained or sent, the silo checks what the round asks of it against its
policy and refuses the round — naming the rule — when the round breaks one. The coordinator's config
arrives with every round (on Flower, in every message), so a server that changes it mid-run is checked
again. The rules, all optional:

    allow_tensors = ["bert.encoder.*", "*patch*"]  # globs: every tensor the round may send must match one
    require_dp = true                               # record-level DP-SGD ([client.dp]) on this silo
    max_epsilon = 8.0                               # its ε by the run's last round (target or planned) at most
    require_secure_aggregation = true               # [federation.secure_aggregation]
    max_rounds = 20                                 # federation.rounds, and so every round index, at most

With `require_dp`, seeded noise is refused too: whoever knows the run seed could remove it.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from pydantic import Field, ValidationError

from fedsilo.errors import ConfigError
from fedsilo.settings import FiniteFloat, Strict, where_what


class SiloPolicy(Strict):
    allow_tensors: list[str] | None = Field(None, description="globs over tensor names; None: any tensor")
    require_dp: bool = False
    max_epsilon: FiniteFloat | None = Field(None, gt=0)
    require_secure_aggregation: bool = False
    max_rounds: int | None = Field(None, gt=0)


@dataclass(frozen=True)
class Asked:
    """What a round asks of the silo, as the silo itself reads it from the run's config."""
    round: int
    rounds: int                  # federation.rounds
    tensors: tuple[str, ...]     # every tensor the round may send (the shared ones)
    dp_epsilon: float | None     # its DP-SGD ε by the last round; None: no DP
    dp_seeded: bool
    secure: bool


def read_policy(path: str | Path) -> tuple[SiloPolicy, str]:
    """(the policy, its path for messages); a bad file is a ConfigError naming it."""
    where = str(Path(path).resolve())
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"silo policy {where}: {err}") from None
    try:
        return SiloPolicy.model_validate(raw), where
    except ValidationError as err:
        raise ConfigError(f"silo policy {where}: {where_what(err)}") from None


def breach(policy: SiloPolicy, asked: Asked) -> str | None:
    """The first rule the round breaks (named), or None."""
    if policy.allow_tensors is not None:
        outside = [t for t in asked.tensors if not any(fnmatchcase(t, g) for g in policy.allow_tensors)]
        if outside:
            return (f"allow_tensors: the round may send {outside[0]!r}" + (f" and {len(outside) - 1} more" if
                    len(outside) > 1 else "") + f", which matches none of {policy.allow_tensors}")
    if policy.require_dp and asked.dp_epsilon is None:
        return "require_dp: the round trains without record-level DP (client.dp is not set for this silo)"
    if policy.require_dp and asked.dp_seeded:
        return "require_dp: client.dp.noise = \"seeded\": whoever knows the run seed can remove the noise"
    if policy.max_epsilon is not None and asked.dp_epsilon is not None and \
            asked.dp_epsilon > policy.max_epsilon * (1 + 1e-9):
        return f"max_epsilon: the run would take this silo to ε = {asked.dp_epsilon:.3f} > {policy.max_epsilon:g}"
    if policy.require_secure_aggregation and not asked.secure:
        return "require_secure_aggregation: the round sends the update in the clear " \
               "(federation.secure_aggregation is not set)"
    if policy.max_rounds is not None and max(asked.rounds, asked.round) > policy.max_rounds:
        return f"max_rounds: the run asks for {max(asked.rounds, asked.round)} rounds, more than {policy.max_rounds}"
    return None
