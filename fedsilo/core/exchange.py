"""What crosses the wire, per client and per direction.

Patterns are fnmatch globs over tensor names. A tensor is *shared* when it matches `shared` and no
`private` pattern; every other tensor is private: it never leaves its client and the client keeps
it across rounds. Three registered policies decide the rest:
- upload selector (client side): which shared tensors this client sends this round; it sees the
  client's tensors now (after training) and at the end of its previous round (Dynamic Pulling; in its
  first round, the model it started from);
- download policy (server side): which shared tensors the server sends this client;
- overwrite policy (client side): which received tensors replace the client's own; the others stay
  the client's (which then keeps them across rounds).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from fedsilo.registry import Policy, Registry

from .compression import SEP, Codec, decode_values, encode_values
from .tensors import Tensors
from .transforms import UploadTransform


@dataclass(frozen=True)
class SelectionContext:
    round: int
    client: str
    names: Sequence[str]          # the shared tensors, in model order
    now: Tensors                  # this client's shared tensors after local training
    previous: Tensors | None      # the same at the end of its previous round; in its first, what it started
                                  # from (None: the selector has no reference)
    seed: int = 0
    options: Any = None           # the selector's validated settings (exchange.upload_options)

    def rng(self) -> random.Random:
        return random.Random(f"{self.seed}/{self.round}/{self.client}/select")


@dataclass(frozen=True)
class Selector:
    choose: Callable[[SelectionContext], Iterable[str]]
    needs_previous: bool = False  # the client must keep its end-of-round tensors for this selector
    sends_all: bool = False       # it always sends every shared tensor (what masks and silo-level DP need)


SELECTORS: Registry[Selector] = Registry("upload selector")
SEND_ALL = SELECTORS.add("all", Selector(lambda ctx: ctx.names, sends_all=True))


def register_selector(name: str, needs_previous: bool = False, settings: type | None = None, sends_all: bool = False):
    """Decorator: `fn(ctx) -> names` becomes `exchange.upload = name`."""
    def wrap(fn):
        SELECTORS.add(name, Selector(fn, needs_previous, sends_all), settings)
        return fn
    return wrap


@dataclass(frozen=True)
class DownloadPolicy:
    """choose(round, shared names, names this client uploaded in its last round or None) -> names sent."""
    choose: Callable[[int, Sequence[str], Sequence[str] | None], Iterable[str]]
    sends_all: bool = False  # every shared tensor, every round: a client need not keep the others


DOWNLOADS: Registry[DownloadPolicy] = Registry("download policy")
DOWNLOAD_ALL = DOWNLOADS.add("all", DownloadPolicy(lambda r, names, uploaded: names, sends_all=True))
DOWNLOADS.add("uploaded", DownloadPolicy(lambda r, names, uploaded: names if uploaded is None else uploaded))


@dataclass(frozen=True)
class OverwritePolicy:
    """choose(received names, names this client uploaded in its last round or None) -> names taken."""
    choose: Callable[[Sequence[str], Sequence[str] | None], Iterable[str]]
    takes_all: bool = False  # everything received replaces the client's own


OVERWRITES: Registry[OverwritePolicy] = Registry("overwrite policy")
TAKE_RECEIVED = OVERWRITES.add("received", OverwritePolicy(lambda received, uploaded: received, takes_all=True))
OVERWRITES.add("uploaded", OverwritePolicy(lambda received, uploaded: received if uploaded is None
                                           else [n for n in received if n in set(uploaded)]))
OVERWRITES.add("none", OverwritePolicy(lambda received, uploaded: [] if uploaded is not None else received))


def matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True)
class ExchangePlan:
    """Which tensors are shared, and the three resolved policies (built once per run, held by the
    server and every client)."""
    shared: tuple[str, ...] = ("*",)
    private: tuple[str, ...] = ()
    upload: Policy[Selector] = Policy("all", SEND_ALL)
    download: Policy[DownloadPolicy] = Policy("all", DOWNLOAD_ALL)
    overwrite: Policy[OverwritePolicy] = Policy("received", TAKE_RECEIVED)
    upload_transforms: tuple[Policy[UploadTransform], ...] = ()  # what the upload goes through before it leaves
    download_transforms: tuple[Policy[Codec], ...] = ()  # how the server's values are coded on the way down

    def encode_download(self, values: Tensors) -> Tensors:
        """What the server sends for `values` (their wire form under the download codec)."""
        return encode_values(self.download_transforms[0], values) if self.download_transforms else values

    def decode_download(self, wire: Tensors, like: Tensors) -> Tensors:
        """The values a client received (shaped as `like`); a ValueError when the wire does not decode."""
        if not self.download_transforms:
            return wire
        names = {k.partition(SEP)[0] for k in wire}
        unknown = sorted(names - set(like))
        if unknown:
            raise ValueError(f"the download holds {unknown[0]!r}, not a tensor of this model")
        return decode_values(self.download_transforms[0], wire, {k: like[k] for k in names})

    @property
    def upload_options(self) -> Any:
        return self.upload.options

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(shared names, private names), in the given order."""
        shared, private = [], []
        for n in names:
            (shared if matches(n, self.shared) and not matches(n, self.private) else private).append(n)
        return shared, private

    @property
    def keeps_everything(self) -> bool:
        """Whether a client must keep all its tensors between rounds (not only the private ones)."""
        return not self.download.value.sends_all or not self.overwrite.value.takes_all or \
            self.upload.value.needs_previous

    def choose_upload(self, ctx: SelectionContext) -> list[str]:
        """Names of the shared tensors this client sends this round, in model order."""
        chosen = set(self.upload.value.choose(ctx))
        unknown = chosen - set(ctx.names)
        if unknown:
            raise ValueError(f"selector {self.upload.name!r} chose tensors that are not shared: {sorted(unknown)}")
        return [n for n in ctx.names if n in chosen]

    def choose_download(self, round_idx: int, names: Sequence[str], uploaded: Sequence[str] | None) -> list[str]:
        chosen = set(self.download.value.choose(round_idx, names, uploaded))
        return [n for n in names if n in chosen]

    def choose_overwrite(self, received: Sequence[str], uploaded: Sequence[str] | None) -> list[str]:
        chosen = set(self.overwrite.value.choose(received, uploaded))
        return [n for n in received if n in chosen]
