"""A federation's roster: which Ed25519 public key speaks for which silo, and each silo's own signing key.

Secure aggregation against a server that lies (fedsilo.privacy.secagg) needs what the server cannot
forge: every silo signs its key advertisement and its view of the survivors with a long-term key,
and every silo checks those signatures against a roster it received out of band (from the
federation's organiser, by e-mail, on a USB stick: never from the server during a run). Two silos
hold the same roster when their fingerprints, the sha256 of its canonical form, are equal: compare
them by phone, or let the run's config name the expected one (`roster_fingerprint`).

Files: a private key is PKCS#8 PEM, written 0600 and refused when others may read it; a public key
is SubjectPublicKeyInfo PEM; a roster is TOML, `[silos]` NAME = "<64 hex digits of the raw key>". Each
is refused by name, before it is opened, unless it is a regular file (a FIFO would block the reader).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedsilo.errors import ConfigError
from fedsilo.fileio import regular_file

KEY_BYTES = 32
SIGNATURE_BYTES = 64


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    """The 32 bytes a roster lists."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Roster:
    """silo name → its raw Ed25519 public key."""

    keys: Mapping[str, bytes]

    def __post_init__(self) -> None:
        for name, key in self.keys.items():
            if not (isinstance(name, str) and name) or not (isinstance(key, bytes) and len(key) == KEY_BYTES):
                raise ConfigError(f"roster entry {name!r} is not a silo name with a 32-byte Ed25519 public key")
        if len(set(self.keys.values())) != len(self.keys):
            raise ConfigError("the roster gives two silos the same public key")

    def canonical(self) -> bytes:
        """The roster's one byte form, the same whatever order or file layout it was read from."""
        return json.dumps({name: key.hex() for name, key in self.keys.items()}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=True).encode()

    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical()).hexdigest()

    def missing(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names) - set(self.keys))

    def verify(self, silo: str, signature: bytes, message: bytes) -> bool:
        """Whether `signature` is `silo`'s (per this roster) over `message`; False for a silo not in it."""
        key = self.keys.get(silo)
        if key is None or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(signature, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class Identity:
    """One silo's signing key and the roster it checks its peers by (set on the silo by its operator)."""

    name: str
    key: Ed25519PrivateKey
    roster: Roster

    def __post_init__(self) -> None:
        if self.name not in self.roster.keys:
            raise ConfigError(f"silo {self.name!r} is not in its own roster ({self.roster.fingerprint()})")
        if self.roster.keys[self.name] != raw_public_key(self.key.public_key()):
            raise ConfigError(f"silo {self.name!r}'s signing key is not the one its roster lists for it")

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


# ---- files ---------------------------------------------------------------------------------------

def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """`ed25519:<hex>`, the one line an operator reads out or pastes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return "ed25519:" + raw_public_key(public).hex()


def save_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write the key 0600, never over an existing file (a lost key cannot be taken back)."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def save_public_key(key: Ed25519PrivateKey, path: Path) -> None:
    data = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    path = regular_file(path, "signing key", ConfigError)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"signing key {path}: {err.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"signing key {path} may be read by others (mode {stat.S_IMODE(mode):04o}); "
                          f"chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an unencrypted Ed25519 private key in PEM "
                          "(make one with `fedsilo keys new`)")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    path = regular_file(path, "public key", ConfigError)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"public key {path}: {err.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key {path} is not an Ed25519 public key in PEM (`fedsilo keys new` writes one)")
    return key


def roster_toml(roster: Roster) -> str:
    lines = [f"# fedsilo federation roster, {roster.fingerprint()}",
             "# Give every silo this file out of band; each compares the fingerprint above.", "[silos]"]
    lines += [f"{json.dumps(name)} = \"{key.hex()}\"" for name, key in sorted(roster.keys.items())]
    return "\n".join(lines) + "\n"


def write_roster(roster: Roster, path: Path) -> None:
    path.write_text(roster_toml(roster))


def read_roster(path: str | Path) -> Roster:
    path = regular_file(path, "roster", ConfigError)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"roster {path}: {err.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"roster {path} is not TOML: {err}") from None
    silos = raw.get("silos")
    if not isinstance(silos, dict) or not silos or set(raw) != {"silos"}:
        raise ConfigError(f"roster {path} must hold exactly one table [silos] of NAME = \"<hex public key>\"")
    keys = {}
    for name, value in silos.items():
        try:
            keys[name] = bytes.fromhex(value) if isinstance(value, str) else None
        except ValueError:
            keys[name] = None
        if keys[name] is None or len(keys[name]) != KEY_BYTES:
            raise ConfigError(f"roster {path}: silo {name!r}'s key is not 64 hex digits (a raw Ed25519 public key)")
    try:
        return Roster(keys)
    except ConfigError as err:
        raise ConfigError(f"roster {path}: {err}") from None


def load_identity(name: str, key_path: str | Path, roster_path: str | Path,
                  fingerprint: str | None = None) -> Identity:
    """A silo's identity from its operator's files; `fingerprint`: the one the roster must have."""
    roster = read_roster(roster_path)
    if fingerprint is not None and roster.fingerprint() != fingerprint:
        raise ConfigError(f"roster {roster_path} has fingerprint {roster.fingerprint()}, not the expected "
                          f"{fingerprint}: it is not the federation's roster")
    try:
        return Identity(name, load_private_key(key_path), roster)
    except ConfigError as err:
        raise ConfigError(f"{err} (signing key {key_path}, roster {roster_path})") from None


def ephemeral_identities(names: Iterable[str]) -> dict[str, Identity]:
    """Fresh keys and a roster for silos that one operator runs in one process (the in-process engine):
    the signed protocol runs as on a federation, though no one is there to lie to."""
    keys = {name: generate_key() for name in names}
    roster = Roster({name: raw_public_key(k.public_key()) for name, k in keys.items()})
    return {name: Identity(name, key, roster) for name, key in keys.items()}
