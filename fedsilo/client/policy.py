"""A silo's own policy: a small TOML file on the silo's machine that the coordinator does not write.

Each round, before anything is trained or sent, the silo checks what the round asks of it against its
policy and refuses the round — naming the rule — when the round breaks one. Every rule is read from the
config of the message that asks for the round (on Flower, each message carries the run's config and the
ClientApp builds the silo from that very config), so a server that changes its config mid-run — drops
DP, lowers σ, shares a tensor that was private — is checked again, round by round. The rules, all
optional:

    allow_tensors = ["bert.encoder.*", "*patch*"]  # globs: every tensor the round may send must match one
    require_dp = true                               # record-level DP-SGD ([client.dp]) on this silo
    max_epsilon = 8.0                               # its ε by the run's last round (target or planned) at most
    min_noise_multiplier = 0.8                      # the record-level σ the round trains with at least
    max_delta = 1e-5                                # the record-level δ the silo spends its budget at, at most
    require_noise = true                            # DP noise added on this silo (DP-SGD or silo-level distributed)
    require_secure_aggregation = true               # [federation.secure_aggregation]
    require_roster = true                           # secure aggregation with a roster of signing keys
    max_rounds = 20                                 # federation.rounds, and so every round index, at most

`max_epsilon`, `min_noise_multiplier` and `max_delta` imply `require_dp`: a bound on ε or σ means nothing for a round
that trains without noise. Under any of the three, seeded noise is refused: the server chooses the run
seed, and whoever knows it can remove the noise. σ is the smaller of what the silo's accountant holds
and what this message's config plans (a given `noise_multiplier`, or the one derived from its
`target_epsilon`), so neither a lower σ nor a larger target passes. The rules read record-level DP
only: in silo-level DP's distributed mode this silo adds σ·C/√m, a share that protects it only when the
m − 1 others add theirs, which it cannot check; a silo that needs a bound of its own asks for DP-SGD.
`require_roster` implies `require_secure_aggregation`: without a roster the server could swap the silos'
keys (the protocol is then secure against an honest-but-curious server only). `require_noise` is what
secure aggregation alone cannot give: a sum hides one round's input among the others, but what the
server learns across rounds only noise bounds (docs/privacy.md); it takes secret noise of either level. Values are read strictly:
`max_rounds = true` is an error, not 1.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from pydantic import ConfigDict, Field, ValidationError

from fedsilo.errors import ConfigError
from fedsilo.settings import FiniteFloat, Strict, where_what


class SiloPolicy(Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # no bool read as 1, no "8" as 8

    allow_tensors: list[str] | None = Field(None, description="globs over tensor names; None: any tensor")
    require_dp: bool = False
    max_epsilon: FiniteFloat | None = Field(None, gt=0)
    min_noise_multiplier: FiniteFloat | None = Field(None, gt=0)
    max_delta: FiniteFloat | None = Field(None, gt=0, lt=1)
    require_noise: bool = False
    require_secure_aggregation: bool = False
    require_roster: bool = False
    max_rounds: int | None = Field(None, gt=0)

    def dp_rule(self) -> str | None:
        """The first rule that asks for record-level DP, or None."""
        return next((name for name, on in (("require_dp", self.require_dp),
                                           ("max_epsilon", self.max_epsilon is not None),
                                           ("min_noise_multiplier", self.min_noise_multiplier is not None),
                                           ("max_delta", self.max_delta is not None)) if on),
                    None)


@dataclass(frozen=True)
class Asked:
    """What a round asks of the silo, as the silo itself reads it from the config of the message that asks."""
    round: int
    rounds: int                  # federation.rounds
    tensors: tuple[str, ...]     # every tensor the round may send (the shared ones)
    dp_epsilon: float | None     # its DP-SGD ε by the last round; None: no DP
    dp_sigma: float | None       # the record-level σ the round would train with; None: no DP
    dp_seeded: bool
    secure: bool
    roster: bool                 # secure aggregation whose keys this silo checks against a roster
    dp_delta: float | None       # the record-level δ its budget is spent at; None: no DP
    noise: bool                  # DP noise added on the silo, secret


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
    if policy.require_noise and not asked.noise:
        return ("require_noise: the round adds no secret DP noise on this silo (client.dp, or federation.silo_dp "
                "in distributed mode); secure aggregation alone does not bound what a server learns across rounds")
    return _dp_breach(policy, asked) or _secure_breach(policy, asked) or _rounds_breach(policy, asked)


def _dp_breach(policy: SiloPolicy, asked: Asked) -> str | None:
    rule = policy.dp_rule()
    if rule is None:
        return None
    if asked.dp_epsilon is None or asked.dp_sigma is None:
        return f"{rule}: the round trains without record-level DP (client.dp is not set for this silo)"
    if asked.dp_seeded:
        return f"{rule}: client.dp.noise = \"seeded\": whoever knows the run seed can remove the noise"
    if policy.min_noise_multiplier is not None and asked.dp_sigma < policy.min_noise_multiplier * (1 - 1e-9):
        return (f"min_noise_multiplier: the round would train with σ = {asked.dp_sigma:.3g} < "
                f"{policy.min_noise_multiplier:g}")
    if policy.max_delta is not None and asked.dp_delta > policy.max_delta * (1 + 1e-9):
        return f"max_delta: the round would spend this silo's budget at δ = {asked.dp_delta:.3g} > {policy.max_delta:g}"
    if policy.max_epsilon is not None and asked.dp_epsilon > policy.max_epsilon * (1 + 1e-9):
        return f"max_epsilon: the run would take this silo to ε = {asked.dp_epsilon:.3f} > {policy.max_epsilon:g}"
    return None


def _secure_breach(policy: SiloPolicy, asked: Asked) -> str | None:
    for rule, on in (("require_secure_aggregation", policy.require_secure_aggregation),
                     ("require_roster", policy.require_roster)):
        if on and not asked.secure:
            return f"{rule}: the round sends the update in the clear (federation.secure_aggregation is not set)"
    if policy.require_roster and not asked.roster:
        return ("require_roster: secure aggregation without a roster: this silo holds no roster of the federation's "
                "signing keys, so the server could swap keys (secure against an honest-but-curious server only)")
    return None


def _rounds_breach(policy: SiloPolicy, asked: Asked) -> str | None:
    asks = max(asked.rounds, asked.round)
    if policy.max_rounds is not None and asks > policy.max_rounds:
        return f"max_rounds: the run asks for {asks} rounds, more than {policy.max_rounds}"
    return None
