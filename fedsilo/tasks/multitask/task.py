"""Few-shot multi-task text-to-text learning as a fedsilo task: each client holds several CrossFit
tasks. Knows nothing of federation.

Every example is the unified form of the FewFedWeight paper, `<task name>: <input> [SEP] <output>`:
the encoder reads `<task name>: <input>`, the decoder writes `<output>`. A row is one (client, task)
pair with that task's own metric as additive statistics (`metrics`).

Predictions are scored against each reference as the model's tokenizer writes it back
(`decode(encode(reference))`: an uncased vocabulary lowercases "Supports", WordPiece spaces out
"Sci/Tech"), since that is the best a model can produce. A reference the tokenizer cannot write at
all (an emoji label outside MiniLM's vocabulary decodes to nothing) is scored as it is, so it is
never matched: such a task scores 0 rather than rewarding an empty prediction, and a
`RepresentationWarning` names it when the task is built.

The training loss is the mean over the batch's examples of each target's mean token cross-entropy,
so a three-token label and a thirty-token summary weigh the same (tasks differ widely in target
length); it is logged as the objective term `annotated`. An example that carries a pseudo label (a
round hook wrote one: FewFedWeight) adds its weighted token loss Σ_a w_a·NLL_a, averaged over the
batch's examples, as the term `pseudo`: each step trains on b annotated and b pseudo-labelled
sequences of the same b inputs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .catalog import CATALOG
from .data import SPLITS, load_fewshot
from .metrics import SPEC, example_stats
from .plugin import MultitaskSettings

__all__ = ["Example", "MultitaskTask", "RepresentationWarning"]


class RepresentationWarning(UserWarning):
    """Some references of a task cannot be written by the model's tokenizer: they are never matched."""


@dataclass(frozen=True)
class Example:
    task: str
    source: str                   # "<task name>: <input>"
    references: tuple[str, ...]   # references[0] is the training target
    pseudo: tuple[int, ...] = ()            # a pseudo label's token ids (EOS included), if this round has one
    pseudo_weights: tuple[float, ...] = ()  # its token weights (summing to 1)

    @property
    def target(self) -> str:
        return self.references[0]


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy [batch, length], 0 at padding (labels -100)."""
    return F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")


class MultitaskTask:
    name = "multitask"
    spec = SPEC

    def __init__(self, settings: MultitaskSettings, tokenizer, data_dir: str | Path) -> None:
        self.settings, self.tokenizer, self.data_dir = settings, tokenizer, Path(data_dir)
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        assignment = settings.assignment_map()
        self.tasks = {c: assignment[c] for c in settings.client_names()}
        self.splits: dict[str, dict[str, dict[str, list[Example]]]] = {}  # client → split → task → examples
        for client, names in self.tasks.items():
            parts: dict[str, dict[str, list[Example]]] = {s: {} for s in SPLITS}
            for name in names:
                shots = load_fewshot(self.data_dir, name, settings.sample_seeds, settings.k_per_class,
                                     settings.k_total)
                for split in SPLITS:
                    parts[split][name] = [Example(name, f"{name}: {r.input}", r.outputs)
                                          for r in getattr(shots, split)]
            self.splits[client] = parts
        self._written = self._writable_references()
        self.display = {c: f"{c.replace('_', ' ').capitalize()} ({len(ts)} tasks)" for c, ts in self.tasks.items()}

    # ---- the Task contract ---------------------------------------------------------------

    @property
    def clients(self) -> list[str]:
        return list(self.tasks)

    def examples(self, client: str, split: str) -> list[Example]:
        return [e for examples in self.splits[client][split].values() for e in examples]

    def collate(self, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
        """Source ids and labels (target + EOS, padding -100), each cut at its length limit; examples
        with a pseudo label add a second row (same source, the pseudo label) after the annotated
        rows, and `token_weights` holds every row's per-token weights (1/length for annotated rows)."""
        s = self.settings
        paired = [e for e in batch if e.pseudo]
        sources = [e.source for e in batch] + [e.source for e in paired]
        enc = self.tokenizer(sources, max_length=s.max_source_length, truncation=True,
                             padding=True, return_tensors="pt", return_token_type_ids=False)
        targets = self.tokenizer([e.target for e in batch], add_special_tokens=False, truncation=True,
                                 max_length=s.max_target_length - 1)["input_ids"]
        rows = [t + [self.eos] for t in targets] + [list(e.pseudo) for e in paired]
        enc["labels"] = self._pad(rows)
        weights = torch.zeros(enc["labels"].shape, dtype=torch.float32)
        for i, t in enumerate(targets):
            weights[i, :len(t) + 1] = 1.0 / (len(t) + 1)
        for i, e in enumerate(paired, start=len(batch)):
            weights[i, :len(e.pseudo)] = torch.tensor(e.pseudo_weights, dtype=torch.float32)
        enc["token_weights"] = weights
        enc["annotated_rows"] = torch.tensor(len(batch))
        return enc

    def sequence_losses(self, model, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each annotated row's token-mean loss [b], each pseudo row's weighted token loss [p]);
        `model` is the model or any callable taking its inputs (meta weighting's look-ahead)."""
        inputs = {k: v for k, v in batch.items() if k not in ("token_weights", "annotated_rows")}
        nll = sequence_nll(model(**inputs).logits, batch["labels"])
        per_row = (nll * batch["token_weights"]).sum(1)
        b = int(batch["annotated_rows"])
        return per_row[:b], per_row[b:]

    @staticmethod
    def annotated_only(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch without its pseudo rows (meta weighting's look-ahead reads the annotated ones)."""
        b = int(batch["annotated_rows"])
        return {k: v if k == "annotated_rows" else v[:b] for k, v in batch.items()}

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        annotated, pseudo = self.sequence_losses(model, batch)
        terms = {"annotated": annotated.mean()}
        if pseudo.numel():
            terms["pseudo"] = pseudo.sum() / annotated.numel()
        return terms

    # ---- pseudo labels (the round hook `pseudo_labels`) ---------------------------------------

    @torch.no_grad()
    def pseudo_label(self, model: torch.nn.Module, examples: Sequence[Example], top_k: int
                     ) -> list[tuple[list[int], torch.Tensor]]:
        """Each example's greedy output ids (EOS included) and its tokens' top-k logits [l, k]."""
        from fedsilo.models.seq2seq import greedy_with_topk

        out = []
        bs = self.settings.eval_batch_size
        for i in range(0, len(examples), bs):
            enc = self.tokenizer([e.source for e in examples[i:i + bs]], max_length=self.settings.max_source_length,
                                 truncation=True, padding=True, return_tensors="pt",
                                 return_token_type_ids=False).to(model.device)
            out += greedy_with_topk(model, enc, self.settings.max_target_length, top_k)
        return out

    @staticmethod
    def with_pseudo(example: Example, ids: Sequence[int], weights: Sequence[float]) -> Example:
        return replace(example, pseudo=tuple(int(i) for i in ids), pseudo_weights=tuple(float(w) for w in weights))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        """One row per task of `client`: the task's metric statistics and its test loss."""
        from fedsilo.models.seq2seq import loss_and_greedy

        rows = []
        was_training = model.training
        model.eval()
        try:
            for name, examples in self.splits[client][split].items():
                preds: list[str] = []
                loss_sum, loss_n = 0.0, 0
                bs = self.settings.eval_batch_size
                for i in range(0, len(examples), bs):
                    batch = examples[i:i + bs]
                    enc = self.collate(batch).to(model.device)
                    labels = enc.pop("labels")
                    del enc["token_weights"], enc["annotated_rows"]
                    s, n, ids = loss_and_greedy(model, enc, labels, self.settings.max_target_length - 1)
                    loss_sum, loss_n = loss_sum + s, loss_n + n
                    preds += [p.strip() for p in self.tokenizer.batch_decode(ids, skip_special_tokens=True)]
                    if progress is not None:
                        progress.advance(len(batch))
                stats = example_stats(CATALOG.get(name).metric, preds,
                                      [tuple(self._written.get(r, r) for r in e.references) for e in examples])
                rows.append({"client": client, "task": name,
                             "stats": {**stats, "loss_sum": loss_sum, "loss_n": float(loss_n)}})
        finally:
            model.train(was_training)
        return rows

    # ---- helpers ---------------------------------------------------------------------------

    def _writable_references(self) -> dict[str, str]:
        """reference → its tokenizer round trip, for every dev/test reference the tokenizer can write;
        one RepresentationWarning per task with references it cannot."""
        refs = list(dict.fromkeys(r for parts in self.splits.values() for split in ("dev", "test")
                                  for examples in parts[split].values() for e in examples for r in e.references))
        ids = self.tokenizer(refs, add_special_tokens=False, verbose=False)["input_ids"] if refs else []
        written = {r: t.strip() for r, t in zip(refs, self.tokenizer.batch_decode(ids, skip_special_tokens=True))}
        lost: dict[str, list[str]] = {}
        for client, parts in self.splits.items():
            for split in ("dev", "test"):
                for name, examples in parts[split].items():
                    lost.setdefault(name, []).extend(r for e in examples for r in e.references
                                                     if r.strip() and not written[r])
        for name, missing in lost.items():
            if missing:
                shown = ", ".join(map(repr, list(dict.fromkeys(missing))[:5]))
                warnings.warn(RepresentationWarning(
                    f"multitask task {name}: {len(set(missing))} reference(s) cannot be written by this model's "
                    f"tokenizer (e.g. {shown}) and are never matched; a model with a byte-level vocabulary "
                    f"(BART, T5) can"), stacklevel=3)
        return {r: w for r, w in written.items() if w}

    @staticmethod
    def _pad(rows: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return out
