"""What a task plug-in provides, and how its evaluation becomes results.

Evaluation returns per-row *sufficient statistics*: additive numbers (counts, sums, n-gram count
vectors) from which every metric is computed. Pooling rows is then exact (pooled EM from counts,
corpus BLEU from summed n-gram counts, MAP from summed average precisions), and a silo evaluated on
another machine (Flower) sends numbers, never text. A row is one (client, task) pair, because a
multi-task client holds several tasks. A task that is `ItemStats` also gives the final test
evaluation each item's stats unsummed (under hashed ids), for significance tests over test items.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: reading results (the report) needs no torch
    import torch

Stats = dict[str, float | list[float]]  # additive: pooling = element-wise sum
Metrics = dict[str, float | None]

# A stats key any task may add: how many items the model scored NaN or Inf. Such scores cannot be
# ranked or averaged honestly (sorting with NaN keys is arbitrary), so one is enough to make the
# whole evaluation invalid: its macro/pooled metrics are None and it is never selected as best.
NONFINITE = "nonfinite"


def add_stats(a: Mapping[str, Any], b: Mapping[str, Any]) -> Stats:
    """Element-wise sum of two stats dicts (lists are summed position by position)."""
    out: Stats = {}
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            out[key] = x if y is None else y
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y):
                raise ValueError(f"stats {key!r}: cannot add vectors of length {len(x)} and {len(y)}")
            out[key] = [float(u) + float(v) for u, v in zip(x, y)]
        else:
            out[key] = float(x) + float(y)
    return out


def pool(stats: Sequence[Mapping[str, Any]]) -> Stats:
    total: Stats = {}
    for s in stats:
        total = add_stats(total, s)
    return total


@dataclass(frozen=True)
class Column:
    """One metric as tables show it."""
    key: str                 # key in a row's metrics
    label: str               # e.g. "EM %"
    fmt: str = ".2f"
    in_macro: bool = True    # averaged over rows in the macro column
    higher_is_better: bool = True  # which way a study's claim about this metric points (a loss: lower)


@dataclass(frozen=True)
class MetricSpec:
    """A task's metrics: how to compute them from stats, which one selects the model, how to show them."""
    columns: tuple[Column, ...]
    compute: Callable[[Mapping[str, Any]], Metrics] = field(repr=False)
    primary: str = "score"
    higher_is_better: bool = True
    tie_break: str | None = "loss"       # the metric that breaks ties of the primary one
    tie_break_higher_is_better: bool = False
    selection: str = "pooled"            # model selection on "pooled" or "macro" (mean over rows)
    description: str = ""                # what the rows and units are, for the report
    signature: str = ""                  # the scorer's reproducibility signature (e.g. sacreBLEU's)

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict:
        """{rows: [{client, task, metrics, stats}], macro: mean over rows, pooled: from summed stats}.

        A row without a value (nothing to score) is left out of the macro mean; a row with
        non-finite model scores (`NONFINITE` in its stats) invalidates the whole evaluation instead:
        the summary then holds `nonfinite` (their total), its averaged metrics are None and its
        selection key is None, so a broken model never looks like the best one."""
        if not rows:
            raise ValueError("no evaluation rows to summarize")
        out_rows = [{"client": r["client"], "task": r["task"], "stats": dict(r["stats"]),
                     "metrics": self.compute(r["stats"])} for r in rows]
        nonfinite = sum(float(r["stats"].get(NONFINITE) or 0.0) for r in rows)
        macro: Metrics = {}
        for col in self.columns:
            values = [r["metrics"].get(col.key) for r in out_rows]
            values = [v for v in values if v is not None and not math.isnan(v)]
            macro[col.key] = sum(values) / len(values) if values and col.in_macro else None
        pooled = self.compute(pool([r["stats"] for r in rows]))
        if nonfinite:
            for col in self.columns:
                if col.in_macro:
                    macro[col.key] = pooled[col.key] = None
        summary = {"rows": out_rows, "macro": macro, "pooled": pooled}
        if nonfinite:
            summary[NONFINITE] = nonfinite
        summary["score"] = summary[self.selection].get(self.primary)
        summary["key"] = self.selection_key(summary)
        return summary

    def selection_key(self, summary: Mapping[str, Any]) -> list[float] | None:
        """Larger is better; a missing value (nothing to score) ranks last. None for an invalid
        evaluation (non-finite model scores, or a NaN primary metric): it is never selected."""
        if summary.get(NONFINITE):
            return None
        metrics = summary[self.selection]
        primary = metrics.get(self.primary)
        if primary is not None and math.isnan(primary):
            return None
        key = [_signed(primary, self.higher_is_better)]
        if self.tie_break:
            key.append(_signed(metrics.get(self.tie_break), self.tie_break_higher_is_better))
        return key

    def describe(self) -> dict:
        """The spec as results.json records it (for the report, which has no task code)."""
        columns = [{**asdict(c), "higher_is_better": self.higher_is_better} if c.key == self.primary else asdict(c)
                   for c in self.columns]  # the primary metric points the spec's way, whatever its column says
        return {"columns": columns, "primary": self.primary,
                "higher_is_better": self.higher_is_better, "tie_break": self.tie_break,
                "selection": self.selection, "description": self.description, "signature": self.signature}


def fixed_subsample(items: list, n: int, key: str) -> list:
    """`n` of `items` (all when `n` is 0 or not smaller), in their order, drawn with the seed `key`:
    independent of the run seed, so runs with different seeds compare the same data."""
    if not n or len(items) <= n:
        return items
    picked = random.Random(key).sample(range(len(items)), n)
    return [items[i] for i in sorted(picked)]


def fixed_splits(raw: Mapping[str, list], name: str, max_train: int, max_eval: int, where: Any,
                 what: str, unit: str) -> dict[str, list]:
    """A silo's train/dev/test as fixed subsamples (`fixed_subsample`); a split left empty is a
    DataError naming `where` (its file or folder): a silo without one cannot train or be scored."""
    from fedsilo.errors import DataError

    splits = ("train", "dev", "test")
    empty = [s for s in splits if not raw[s]]
    if empty:
        raise DataError(f"{where}: {what} {name} has no {' / '.join(empty)} {unit}")
    return {s: fixed_subsample(raw[s], max_train if s == "train" else max_eval, f"{name}/{s}") for s in splits}


WORST = -1e308


def _signed(value: float | None, higher_is_better: bool) -> float:
    if value is None or math.isnan(value):
        return WORST
    return float(value) if higher_is_better else -float(value)


def select_best(candidates: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The candidate (a dict with a `key` list) with the largest key; the earliest wins exact ties.
    A candidate whose key is None (an invalid evaluation) is never picked, even as the only one.

    One function for the runner (which round becomes best.pt) and the report (which round it marks)."""
    best = None
    for c in candidates:
        if c.get("key") is None:
            continue
        if best is None or list(c["key"]) > list(best["key"]):
            best = c
    return best


@runtime_checkable
class Task(Protocol):
    """A task family (text2sql, translation, matching, multitask). Knows nothing of federation."""
    name: str
    spec: MetricSpec
    display: Mapping[str, str]  # client name → display name

    @property
    def clients(self) -> list[str]: ...

    def examples(self, client: str, split: str) -> Sequence[Any]: ...

    def collate(self, batch: Sequence[Any]) -> dict[str, torch.Tensor]: ...

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named scalar loss terms for one batch; training minimises their sum."""

    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        """[{client, task, stats}] for one client's `split`; `final` adds costly extras (test only)."""


@runtime_checkable
class ItemStats(Protocol):
    """A task whose evaluation can keep each test item's stats unsummed. Significance tests resample
    test items (paired bootstrap for BLEU/chrF as sacreBLEU does it, paired randomisation for MAP or
    accuracy), so the final test evaluation records them in `items/test.jsonl`; a task without this
    ability simply has no such file."""
    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """`Task.evaluate`'s rows, each with `items`: {"ids", "stats"} (see `item_row`), in the split's
        deterministic order, so that `pool(items["stats"])` equals the row's `stats`."""


@runtime_checkable
class KeepsAnswers(Protocol):
    """A task whose final evaluation produces text worth reading beside the scores (a generated answer,
    the option chosen): kept per item, in the split's order, for the run directory's
    `answers/<split>.jsonl` and `fedsilo report`. Never part of the evaluation rows, which may leave a
    silo (on Flower they hold hashed ids and numbers only)."""
    def answers(self, client: str, split: str) -> list[dict]:
        """The last final evaluation's answers on `client`'s `split`: one dict per item that has any,
        each with the item's `id` (as in `items`)."""


def item_ids(keys: Sequence[Any]) -> list[str]:
    """Each item's id for an items record: 16 hex digits of a sha256, never its text. `keys` are the
    items' contents (JSON-serialisable), in the split's order. An item's id is the digest of the whole
    split, its position and its own digest: a short text ("Ja.") cannot be confirmed by hashing
    guesses, a repeated item still has an id of its own, and the same split gives the same ids in
    every run, whatever the seed or the data folder's path (what pairing two runs checks)."""
    digests = [hashlib.sha256(json.dumps(k, ensure_ascii=False).encode()).hexdigest() for k in keys]
    split = hashlib.sha256("".join(digests).encode()).hexdigest()
    return [hashlib.sha256(f"{split}/{i}/{d}".encode()).hexdigest()[:16] for i, d in enumerate(digests)]


def item_row(client: str, task: str | None, keys: Sequence[Any], stats: Sequence[Stats],
             row_stats: Stats | None = None) -> dict:
    """An evaluation row with its items: {client, task, stats, items: {ids, stats}}. The row's stats
    are the items' pooled stats unless a task gives its own (e.g. a loss summed per batch), which
    must equal them up to float summation order."""
    if len(keys) != len(stats):
        raise ValueError(f"{len(keys)} item keys for {len(stats)} item stats")
    return {"client": client, "task": task, "stats": pool(stats) if row_stats is None else row_stats,
            "items": {"ids": item_ids(keys), "stats": list(stats)}}


def without_items(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Rows as `Task.evaluate` returns them (an `ItemStats` task's evaluate is its items rows less the items)."""
    return [{k: v for k, v in row.items() if k != "items"} for row in rows]


EVALUATION_SPLITS = ("dev", "test")  # a task may add its own (`evaluation_splits`), never the training split


def evaluate_rows(task: Task, model: torch.nn.Module, client: str, split: str, progress=None,
                  final: bool = False) -> list[dict]:
    """One client's evaluation rows; the final test evaluation (`final`) also keeps each item's stats
    where the task can (`ItemStats`). The one place the engines (in-process and a Flower silo) ask, so a
    split the silo does not evaluate (its training records' statistics would leave it, outside any DP
    accountant) is refused by name whoever asks."""
    from fedsilo.core.transforms import SiloRefused  # here: reading results (the report) imports no torch

    allowed = tuple(dict.fromkeys((*EVALUATION_SPLITS, *getattr(task, "evaluation_splits", ()))))
    if split not in allowed or split == "train":
        raise SiloRefused(f"silo {client}: evaluation of split {split!r} refused: a silo evaluates only "
                          f"{', '.join(allowed)}")
    if final and isinstance(task, ItemStats):
        return task.evaluate_items(model, client, split, progress=progress, final=final)
    return task.evaluate(model, client, split, progress=progress, final=final)


@runtime_checkable
class PerExampleLoss(Protocol):
    """A task that DP-SGD can train: the loss of each training example, depending on that example alone
    (their sum is what is differentiated), and how many rows of the model's batch one example fills."""
    rows_per_example: int

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


@runtime_checkable
class CrossDomain(Protocol):
    """A task whose models are also tested on every domain of a matrix (the translation paper's
    Tables 4-7: each silo's model on every domain)."""
    @property
    def matrix(self) -> list[str]:
        """The matrix's domains (their dev/test examples are loaded: `examples(domain, split)`)."""


@runtime_checkable
class LengthChecks(Protocol):
    """A task that reports its silos' token lengths against the model's limits (`fedsilo data check`)."""
    def length_checks(self, client: str) -> list:
        """One `sources.check.Lengths` per text field of the client's examples, as the model reads them."""


@runtime_checkable
class WithReferences(Protocol):
    """A task that scores untrained reference systems (BM25) beside the trained models."""
    reference_names: list[str]

    def reference(self, name: str, client: str, split: str) -> list[dict]:
        """Reference `name`'s rows on one client's `split`, shaped as `Task.evaluate`'s."""
