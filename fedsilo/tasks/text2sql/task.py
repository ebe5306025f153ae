"""Text-to-SQL as a fedsilo task (the `Task` contract of `fedsilo.tasks.base`). Knows nothing of federation.

A row is one silo. Its stats are additive, so pooling silos (or machines) is exact:

- ``n``: examples evaluated; ``correct``: exact matches of the greedy prediction (canonical SQL form).
- ``loss_sum``: summed teacher-forced token cross-entropy over the label tokens (target + EOS, as
  truncated by ``max_target_length``); ``loss_n``: the number of those tokens. The test loss is
  ``loss_sum / loss_n``: a token-level mean, so a pooled loss is the corpus-level token mean.
- ``fit``: gold targets whose tokenised length plus EOS is at most ``max_target_length``. Only these
  can be matched exactly: longer ones are truncated in training and generation is cut at the cap.
- ``exec_correct`` / ``exec_n`` (only when ``final``, ``exec_accuracy`` is on and the silo has a
  database, i.e. GeoQuery): predictions returning the gold query's rows, and the examples tried.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fedsilo.sources.check import Lengths
from fedsilo.tasks.base import Column, MetricSpec, Metrics, fixed_subsample, item_row, pool, without_items
from fedsilo.tasks.tokens import RowMemo, pad_seq2seq, sequence_losses, sorted_batches

from .data import DataError, Example, silo_database, silo_examples
from .metrics import exact_match, execution_match
from .plugin import Text2SQLSettings

__all__ = ["Text2SQLTask", "TargetLengthWarning", "SPEC", "compute_metrics", "train_size"]

SPLITS = ("train", "dev", "test")
UNFIT_WARN_SHARE = 0.10
"""Warn when more than this share of a split's targets cannot fit within ``max_target_length``."""


class TargetLengthWarning(UserWarning):
    """Some gold targets are longer than ``max_target_length``: exact match is capped below 100%."""


def _pct(num: Any, den: Any) -> float | None:
    return 100.0 * float(num) / float(den) if den else None


def compute_metrics(stats: Mapping[str, Any]) -> Metrics:
    """em, exec, fit (%) and loss (mean token cross-entropy) from one row's (or pooled) stats."""
    loss_n = stats.get("loss_n")
    return {
        "em": _pct(stats.get("correct", 0), stats.get("n")),
        "exec": _pct(stats.get("exec_correct", 0), stats.get("exec_n")),
        "loss": float(stats["loss_sum"]) / float(loss_n) if loss_n else None,
        "fit": _pct(stats.get("fit", 0), stats.get("n")),
    }


SPEC = MetricSpec(
    columns=(
        Column("em", "EM %"),
        Column("exec", "Exec %", in_macro=False),  # only silos with a database (GeoQuery, own ones given one)
        Column("loss", "test loss", fmt=".3f", higher_is_better=False),
        Column("fit", "targets that fit %"),
    ),
    compute=compute_metrics,
    primary="em",
    higher_is_better=True,
    tie_break="loss",
    tie_break_higher_is_better=False,
    selection="pooled",
    description=("One row per text-to-SQL silo (database domain): EM and Exec are % of its examples whose "
                 "greedy prediction matches the gold SQL exactly (canonical form) or returns the same rows "
                 "(silos with a database: GeoQuery, and own silos given one), test loss is the mean "
                 "teacher-forced cross-entropy per target token (EOS included), and targets that fit is the % of gold SQL queries short enough "
                 "(tokens + EOS <= max_target_length) to be matched at all."),
)



def _require_splits(raw: dict[str, list[Example]], path: Path) -> None:
    """A silo trains, selects its model and is tested on its own examples: an empty split is a data
    error, not a silent row of dashes."""
    empty = [split for split in SPLITS if not raw[split]]
    if empty:
        raise DataError(f"{path}: no {' / '.join(empty)} examples")


def train_size(n: int, cfg) -> int:
    """Subsampled train size: a share of the silo, kept within [min_train, max_train] (0 = no cap).

    A share keeps the silos' size ratios (what size-based weights see); the floor keeps the small
    silos trainable at small scale."""
    k = max(math.ceil(cfg.train_fraction * n), cfg.min_train)
    if cfg.max_train:
        k = min(k, cfg.max_train)
    return min(k, n)


class Text2SQLTask:
    """The eight (or a chosen subset of) text-to-SQL silos; one client per silo.

    Construction warns (``warnings.warn``, category :class:`TargetLengthWarning`) once per silo where
    more than 10% of some split's gold targets do not fit within ``max_target_length``, naming each
    such split with its count and the cap; the counts are kept in ``fit_counts[silo][split] = (fit, n)``.
    A silo with an empty train, dev or test split is a :class:`DataError` naming its file.
    """
    name = "text2sql"
    spec = SPEC

    def __init__(self, settings: Text2SQLSettings, tokenizer, data_dir: str | Path | None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.display = settings.display_names()
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        self.splits: dict[str, dict[str, list[Example]]] = {}
        self.rows = RowMemo(self)
        for silo in settings.silos:
            raw = silo_examples(settings, silo, self.data_dir)
            own = settings.own_source(silo)
            _require_splits(raw, Path(own.path) if own else self.data_dir / f"{silo}.json")
            self.splits[silo] = {
                "train": fixed_subsample(raw["train"], train_size(len(raw["train"]), settings), f"{silo}/train"),
                "dev": fixed_subsample(raw["dev"], settings.max_eval, f"{silo}/dev"),
                "test": fixed_subsample(raw["test"], settings.max_eval, f"{silo}/test"),
            }
        # Untruncated target lengths (tokens + EOS), keyed by the canonical SQL text.
        targets = list(dict.fromkeys(e.sql for parts in self.splits.values() for ex in parts.values() for e in ex))
        ids = tokenizer(targets, add_special_tokens=False, verbose=False)["input_ids"] if targets else []
        self._target_len = {sql: len(t) + 1 for sql, t in zip(targets, ids)}
        self.fit_counts: dict[str, dict[str, tuple[int, int]]] = {
            silo: {split: (self._fit(ex), len(ex)) for split, ex in parts.items()}
            for silo, parts in self.splits.items()}
        self._warn_unfit()
        self.databases = {silo: silo_database(settings, silo, self.data_dir) if settings.exec_accuracy else None
                          for silo in settings.silos}  # checked once: an own one may be unusable (warned)

    # ---- the Task contract ---------------------------------------------------------------

    @property
    def clients(self) -> list[str]:
        return list(self.settings.silos)

    def examples(self, client: str, split: str) -> list[Example]:
        return self.splits[client][split]

    def collate(self, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
        """Inputs and labels (target + EOS, padding = -100) for a seq2seq loss."""
        return self.pad(self.tokenize(batch))

    # ---- tokenise once (fedsilo.tasks.tokens) ---------------------------------------------

    def tokenize(self, examples: Sequence[Example]) -> list[dict[str, torch.Tensor]]:
        """Each example's source ids (cut at max_source_length) and labels (target cut at
        max_target_length − 1, then EOS)."""
        s = self.settings
        sources = self.tokenizer([e.source for e in examples], max_length=s.max_source_length, truncation=True,
                                 return_token_type_ids=False, return_attention_mask=False)["input_ids"]
        targets = self.tokenizer([e.sql for e in examples], add_special_tokens=False, truncation=True,
                                 max_length=s.max_target_length - 1)["input_ids"]
        return [{"input_ids": torch.tensor(src), "labels": torch.tensor(tgt + [self.eos])}
                for src, tgt in zip(sources, targets)]

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_seq2seq(rows, self.tokenizer.pad_token_id)

    def token_settings(self) -> dict:
        return {"max_source_length": self.settings.max_source_length,
                "max_target_length": self.settings.max_target_length, "eos": self.eos}

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"task": model(**batch).loss}

    rows_per_example = 1

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sequence_losses(model, batch)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        """One row of additive stats for `client`'s `split` (see the module docstring).

        A split is tokenised at its first evaluation; batches of similar source length run from the
        longest down, each through the encoder once: its outputs serve both the teacher-forced loss
        and greedy decoding (as the paper evaluates)."""
        return without_items(self.evaluate_items(model, client, split, progress, final))

    @torch.no_grad()
    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """`evaluate`'s row with each example's stats (its exact match, fit, token loss and, where
        scored, execution match): the items a paired randomisation test permutes."""
        examples = self.examples(client, split)
        db = self.databases[client]
        with_exec = bool(final and self.settings.exec_accuracy and db)
        items: list[dict] = [{}] * len(examples)
        loss_sum, loss_n = 0.0, 0
        was_training = model.training
        model.eval()
        try:
            rows = self.rows((client, split), self.examples(client, split))
            for idx in sorted_batches([len(r["input_ids"]) for r in rows], self.settings.eval_batch_size):
                s, n, preds, losses = self.evaluate_batch(model, [rows[i] for i in idx])
                loss_sum, loss_n = loss_sum + s, loss_n + n
                for i, pred, (loss, tokens) in zip(idx, preds, losses):
                    e = examples[i]
                    fits = self.target_length(e) <= self.settings.max_target_length
                    items[i] = {"correct": float(exact_match(pred, e.sql)), "n": 1.0, "loss_sum": loss,
                                "loss_n": float(tokens), "fit": float(fits)}
                    if with_exec:
                        items[i].update(exec_correct=float(execution_match(pred, e.sql, db)), exec_n=1.0)
                if progress is not None:
                    progress.advance(len(idx))
        finally:
            model.train(was_training)
        stats = {"correct": 0.0, "n": 0.0, **pool(items), "loss_sum": loss_sum, "loss_n": float(loss_n),
                 "fit": float(self._fit(examples))}  # the loss as summed per batch
        return [item_row(client, self.name, [[e.source, e.sql] for e in examples], items, stats)]

    # ---- helpers ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate_batch(self, model, rows: Sequence[Mapping[str, torch.Tensor]]
                       ) -> tuple[float, int, list[str], list[tuple[float, int]]]:
        """(summed token cross-entropy, label tokens, greedy predictions, each row's (summed token
        cross-entropy, label tokens)) of tokenised rows, from one encoder pass.

        Generation gets the labels' budget: at most ``max_target_length - 1`` SQL tokens (the label
        adds EOS), so a target that does not fit can never be matched and ``fit`` bounds ``correct``."""
        from fedsilo.models.seq2seq import token_losses_and_greedy

        enc = {k: v.to(model.device) for k, v in self.pad(rows).items()}
        labels = enc.pop("labels")
        token_loss, ids = token_losses_and_greedy(model, enc, labels, max(1, self.settings.max_target_length - 1))
        per_row = list(zip(token_loss.sum(1).tolist(), (labels != -100).sum(1).tolist()))
        return (float(token_loss.sum()), int((labels != -100).sum()),
                self.tokenizer.batch_decode(ids, skip_special_tokens=True), per_row)

    def target_length(self, example: Example) -> int:
        """The gold target's token count plus EOS (untruncated)."""
        n = self._target_len.get(example.sql)
        if n is None:
            n = self._target_len[example.sql] = len(
                self.tokenizer(example.sql, add_special_tokens=False, verbose=False)["input_ids"]) + 1
        return n

    def _fit(self, examples: Sequence[Example]) -> int:
        cap = self.settings.max_target_length
        return sum(self.target_length(e) <= cap for e in examples)

    def length_checks(self, client: str) -> list:
        """Tokens of the silo's inputs (question | schema) and SQL targets (+ EOS), uncut."""
        examples = [e for split in SPLITS for e in self.splits[client][split]]
        src = self.tokenizer([e.source for e in examples], verbose=False)["input_ids"] if examples else []
        s = self.settings
        return [Lengths("input tokens (question | schema)", "task.max_source_length", s.max_source_length,
                        tuple(map(len, src))),
                Lengths("SQL tokens (+ EOS)", "task.max_target_length", s.max_target_length,
                        tuple(self._target_len[e.sql] for e in examples))]

    def _warn_unfit(self) -> None:
        """One TargetLengthWarning per silo where some split has more than 10% unfit targets."""
        cap = self.settings.max_target_length
        for silo, parts in self.fit_counts.items():
            bad = [(split, *parts[split]) for split in SPLITS
                   if parts[split][1] and parts[split][1] - parts[split][0] > UNFIT_WARN_SHARE * parts[split][1]]
            if bad:
                detail = "; ".join(f"{split} {n - fit} of {n} ({100.0 * (n - fit) / n:.1f}%, EM at most "
                                   f"{100.0 * fit / n:.1f}%)" for split, fit, n in bad)
                warnings.warn(
                    f"text2sql silo {silo} ({self.display.get(silo, silo)}): gold SQL targets longer than max_target_length "
                    f"= {cap} tokens (EOS included), which are truncated in training and cannot be matched "
                    f"exactly: {detail}", TargetLengthWarning, stacklevel=3)
