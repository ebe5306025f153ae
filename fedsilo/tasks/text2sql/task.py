"""Text-to-SQL as a fedsilo task: silos, encoding, decoding and metrics. Knows nothing of federation."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from fedsilo.config import TaskConfig
from fedsilo.progress import Progress

from .data import DISPLAY, Example, load_silo
from .metrics import EXEC_DB, exact_match, execution_match, summarize


def _cap(examples: list[Example], n: int, key: str) -> list[Example]:
    """A fixed subsample (independent of the run seed, so seeds compare the same data)."""
    if not n or len(examples) <= n:
        return examples
    picked = random.Random(key).sample(range(len(examples)), n)
    return [examples[i] for i in sorted(picked)]


def train_size(n: int, cfg: TaskConfig) -> int:
    """Subsampled train size: a share of the silo, kept within [min_train, max_train] (0 = no cap).

    A share keeps the silos' size ratios (what size-based weights see); the floor keeps the small
    silos trainable at small scale."""
    k = max(math.ceil(cfg.train_fraction * n), cfg.min_train)
    if cfg.max_train:
        k = min(k, cfg.max_train)
    return min(k, n)


class Text2SQLTask:
    display = DISPLAY

    def __init__(self, cfg: TaskConfig, tokenizer, data_dir: str | Path) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.data_dir = Path(data_dir)
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        self.splits: dict[str, dict[str, list[Example]]] = {}
        for silo in cfg.silos:
            raw = load_silo(self.data_dir, silo)
            self.splits[silo] = {
                "train": _cap(raw["train"], train_size(len(raw["train"]), cfg), f"{silo}/train"),
                "dev": _cap(raw["dev"], cfg.max_eval, f"{silo}/dev"),
                "test": _cap(raw["test"], cfg.max_eval, f"{silo}/test"),
            }

    @property
    def silos(self) -> list[str]:
        return list(self.cfg.silos)

    def examples(self, silo: str, split: str) -> list[Example]:
        return self.splits[silo][split]

    def _encode_sources(self, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
        return self.tokenizer([e.source for e in batch], max_length=self.cfg.max_source_length, truncation=True,
                              padding=True, return_tensors="pt", return_token_type_ids=False)

    def collate(self, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
        """Inputs and labels (target + EOS, padding = -100) for a seq2seq loss."""
        enc = self._encode_sources(batch)
        limit = self.cfg.max_target_length - 1
        targets = self.tokenizer([e.sql for e in batch], add_special_tokens=False, truncation=True,
                                 max_length=limit)["input_ids"]
        rows = [t + [self.eos] for t in targets]
        width = max(len(r) for r in rows)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            labels[i, :len(r)] = torch.tensor(r)
        enc["labels"] = labels
        return enc

    @torch.no_grad()
    def predict(self, model, examples: Sequence[Example], progress: Progress | None = None) -> list[str]:
        """Greedy decoding, as the paper evaluates."""
        model.eval()
        out: list[str] = []
        bs = self.cfg.eval_batch_size
        for i in range(0, len(examples), bs):
            enc = self._encode_sources(examples[i:i + bs]).to(model.device)
            ids = model.generate(**enc, max_new_tokens=self.cfg.max_target_length, num_beams=1, do_sample=False)
            out += self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            if progress:
                progress.advance(len(ids))
        return out

    def evaluate(self, model, split: str, silos: Sequence[str] | None = None,
                 progress: Progress | None = None, with_exec: bool = False) -> dict:
        """EM per silo, MacroAvg, MicroAvg; execution accuracy where a database exists."""
        silos = list(silos or self.silos)
        correct: dict[str, list[bool]] = {}
        executed: dict[str, float] = {}
        for silo in silos:
            examples = self.examples(silo, split)
            preds = self.predict(model, examples, progress)
            correct[silo] = [exact_match(p, e.sql) for p, e in zip(preds, examples)]
            db = EXEC_DB.get(silo)
            if with_exec and self.cfg.exec_accuracy and db and examples:
                hits = [execution_match(p, e.sql, self.data_dir / db) for p, e in zip(preds, examples)]
                executed[silo] = 100.0 * sum(hits) / len(hits)
        summary = summarize(correct)
        for silo, row in summary["per_silo"].items():
            row["exec"] = executed.get(silo)
            row["loss"] = self.mean_loss(model, self.examples(silo, split))
        return summary

    @torch.no_grad()
    def mean_loss(self, model, examples: Sequence[Example]) -> float:
        """Teacher-forced token loss: a graded quality signal while exact match is still flat."""
        model.eval()
        total, n = 0.0, 0
        bs = self.cfg.eval_batch_size
        for i in range(0, len(examples), bs):
            batch = examples[i:i + bs]
            total += float(model(**self.collate(batch).to(model.device)).loss) * len(batch)
            n += len(batch)
        return total / max(n, 1)
