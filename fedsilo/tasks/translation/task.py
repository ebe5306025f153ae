"""German→English translation as a fedsilo task (the `Task` contract of `fedsilo.tasks.base`): one
silo per domain. Knows nothing of federation.

A row is one domain. Its stats are additive (see `metrics.bleu_stats`): sacreBLEU's summed n-gram
statistics and chrF's summed character statistics of the greedy translations, detokenised by the
tokenizer's decoder, against the one reference; `loss_sum` / `loss_n` the summed teacher-forced
token cross-entropy (target + EOS) and its token count. So corpus BLEU pooled over domains, or over
machines, is exact.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fedsilo.datafetch import default_data_root
from fedsilo.sources.check import Lengths
from fedsilo.tasks.base import fixed_splits, item_row, without_items
from fedsilo.tasks.tokens import RowMemo, pad_seq2seq, sequence_losses, sorted_batches

from .data import Pair, load_silo
from .metrics import SPEC, sentence_stats, signatures, summed
from .plugin import TranslationSettings

__all__ = ["TranslationTask", "task_tokenizer"]

SPLITS = ("train", "dev", "test")


def task_tokenizer(settings: TranslationSettings, data_dir: Path):
    """The joint subword tokenizer, fitted on the tokenizer domain's training pairs (both sides)
    only — the generic engine's data, never pooled client text — and cached by content."""
    from .tokenizer import load_or_fit

    def texts() -> list[str]:
        return [t for p in load_silo(settings, settings.tokenizer_domain, data_dir)["train"]
                for t in (p.source, p.target)]

    return load_or_fit(texts, {"domain": settings.tokenizer_domain}, default_data_root() / "prepared" /
                       "translation" / "tokenizers", settings.vocab_size, settings.tokenizer_model)



class TranslationTask:
    """The chosen domains as silos; the matrix domains' dev/test sets are loaded too."""
    name = "translation"
    spec = SPEC

    def __init__(self, settings: TranslationSettings, tokenizer, data_dir: str | Path | None) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.display = settings.display_names()
        self.splits: dict[str, dict[str, list[Pair]]] = {}
        self.rows = RowMemo(self)
        for domain in dict.fromkeys([*settings.silos, *settings.matrix_domains()]):
            where = settings.own_source(domain).path if settings.own_source(domain) else self.data_dir
            self.splits[domain] = fixed_splits(load_silo(settings, domain, self.data_dir), domain, settings.max_train,
                                             settings.max_eval, where, "translation silo", "pairs")
        self.signatures = signatures()

    # ---- the Task contract ---------------------------------------------------------------

    @property
    def clients(self) -> list[str]:
        return list(self.settings.silos)

    @property
    def matrix(self) -> list[str]:
        """Domains of the cross-domain test matrix (every model on every one of them)."""
        return self.settings.matrix_domains()

    def examples(self, client: str, split: str) -> list[Pair]:
        return self.splits[client][split]

    def collate(self, batch: Sequence[Pair]) -> dict[str, torch.Tensor]:
        """Source ids and labels (target + EOS; padding = -100), each cut at its length limit."""
        return self.pad(self.tokenize(batch))

    # ---- tokenise once (fedsilo.tasks.tokens) ---------------------------------------------

    def tokenize(self, pairs: Sequence[Pair]) -> list[dict[str, torch.Tensor]]:
        s = self.settings
        sources = self.tokenizer([p.source for p in pairs], max_length=s.max_source_length, truncation=True,
                                 return_token_type_ids=False, return_attention_mask=False)["input_ids"]
        targets = self.tokenizer(text_target=[p.target for p in pairs], max_length=s.max_target_length,
                                 truncation=True, return_token_type_ids=False,
                                 return_attention_mask=False)["input_ids"]
        return [{"input_ids": torch.tensor(a), "labels": torch.tensor(b)} for a, b in zip(sources, targets)]

    def length_checks(self, client: str) -> list:
        """Token lengths of the silo's sources and targets (+ EOS), uncut, against their limits."""
        pairs = [p for split in SPLITS for p in self.examples(client, split)]
        s = self.settings
        src = self.tokenizer([p.source for p in pairs], return_token_type_ids=False,
                             return_attention_mask=False)["input_ids"]
        tgt = self.tokenizer(text_target=[p.target for p in pairs], return_token_type_ids=False,
                             return_attention_mask=False)["input_ids"]
        return [Lengths("source tokens", "task.max_source_length", s.max_source_length, tuple(map(len, src))),
                Lengths("target tokens (+ EOS)", "task.max_target_length", s.max_target_length, tuple(map(len, tgt)))]

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_seq2seq(rows, self.tokenizer.pad_token_id)

    def token_settings(self) -> dict:
        return {"max_source_length": self.settings.max_source_length,
                "max_target_length": self.settings.max_target_length}

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"task": model(**batch).loss}

    rows_per_example = 1

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sequence_losses(model, batch)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        """One row of additive stats for `client`'s (domain's) `split` (see the module docstring)."""
        return without_items(self.evaluate_items(model, client, split, progress, final))

    @torch.no_grad()
    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """`evaluate`'s row with each sentence pair's stats (sacreBLEU's per-sentence statistics and its
        token loss): the items a paired bootstrap resamples."""
        pairs = self.examples(client, split)
        hyps: list[str] = [""] * len(pairs)
        item_losses: list[tuple[float, int]] = [(0.0, 0)] * len(pairs)
        loss_sum, loss_n = 0.0, 0
        was_training = model.training
        model.eval()
        try:
            rows = self.rows((client, split), self.examples(client, split))
            for idx in sorted_batches([len(r["input_ids"]) for r in rows], self.settings.eval_batch_size):
                s, n, preds, losses = self.evaluate_batch(model, [rows[i] for i in idx])
                loss_sum, loss_n = loss_sum + s, loss_n + n
                for i, pred, loss in zip(idx, preds, losses):
                    hyps[i], item_losses[i] = pred, loss
                if progress is not None:
                    progress.advance(len(idx))
        finally:
            model.train(was_training)
        items = [{**sentence, "loss_sum": loss, "loss_n": float(tokens)} for sentence, (loss, tokens)
                 in zip(sentence_stats(hyps, [p.target for p in pairs]), item_losses)]
        stats = {**summed(items), "loss_sum": loss_sum, "loss_n": float(loss_n)}  # the loss as summed per batch
        return [item_row(client, self.name, [[p.source, p.target] for p in pairs], items, stats)]

    @torch.no_grad()
    def evaluate_batch(self, model, rows: Sequence[Mapping[str, torch.Tensor]]
                       ) -> tuple[float, int, list[str], list[tuple[float, int]]]:
        """(summed token cross-entropy, label tokens, greedy translations, each row's (summed token
        cross-entropy, label tokens)) of tokenised rows, from one encoder pass."""
        from fedsilo.models.seq2seq import token_losses_and_greedy

        enc = {k: v.to(model.device) for k, v in self.pad(rows).items()}
        labels = enc.pop("labels")
        token_loss, ids = token_losses_and_greedy(model, enc, labels, self.settings.max_target_length)
        preds = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        per_row = list(zip(token_loss.sum(1).tolist(), (labels != -100).sum(1).tolist()))
        return float(token_loss.sum()), int((labels != -100).sum()), [p.strip() for p in preds], per_row
