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

from fedsilo.sources.check import Lengths
from fedsilo.tasks.base import item_row, pool, without_items
from fedsilo.tasks.tokens import RowMemo, attention_mask, pad_rows, sequence_nll, sorted_batches

from .catalog import CATALOG
from .data import SPLITS, load_fewshot, own_shots
from .metrics import SPEC, example_stats, item_stats
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


class MultitaskTask:
    name = "multitask"
    spec = SPEC

    def __init__(self, settings: MultitaskSettings, tokenizer, data_dir: str | Path | None) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        assignment = settings.assignment_map()
        self.tasks = {c: assignment[c] for c in settings.client_names()}
        self.splits: dict[str, dict[str, dict[str, list[Example]]]] = {}  # client → split → task → examples
        self.rows = RowMemo(self)
        self.metrics = {}  # task → its metric: the catalogue's, or an own silo's `metric`
        for client, names in self.tasks.items():
            parts: dict[str, dict[str, list[Example]]] = {s: {} for s in SPLITS}
            own = settings.own_source(client)
            for name in names:
                if own is not None:
                    shots, self.metrics[name] = own_shots(settings, client), own.metric
                else:
                    shots = load_fewshot(self.data_dir, name, settings.sample_seeds, settings.k_per_class,
                                         settings.k_total)
                    self.metrics[name] = CATALOG.get(name).metric
                for split in SPLITS:
                    parts[split][name] = [Example(name, f"{name}: {r.input}", r.outputs)
                                          for r in getattr(shots, split)]
            self.splits[client] = parts
        self._written = self._writable_references()
        named = settings.display_names()
        self.display = {c: named.get(c) or (c if settings.own_source(c) else
                                            f"{c.replace('_', ' ').capitalize()} ({len(ts)} tasks)")
                        for c, ts in self.tasks.items()}

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
        return self.pad(self.tokenize(batch))

    # ---- tokenise once (fedsilo.tasks.tokens) ---------------------------------------------

    def tokenize(self, examples: Sequence[Example]) -> list[dict[str, torch.Tensor]]:
        """Source ids, labels (target + EOS) and, for a pseudo-labelled example, its pseudo label
        and token weights."""
        s = self.settings
        sources = self.tokenizer([e.source for e in examples], max_length=s.max_source_length, truncation=True,
                                 return_token_type_ids=False, return_attention_mask=False)["input_ids"]
        targets = self.tokenizer([e.target for e in examples], add_special_tokens=False, truncation=True,
                                 max_length=s.max_target_length - 1)["input_ids"]
        rows = []
        for e, src, tgt in zip(examples, sources, targets):
            row = {"input_ids": torch.tensor(src), "labels": torch.tensor(tgt + [self.eos])}
            if e.pseudo:
                row["pseudo"] = torch.tensor(e.pseudo, dtype=torch.long)
                row["pseudo_weights"] = torch.tensor(e.pseudo_weights, dtype=torch.float32)
            rows.append(row)
        return rows

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        paired = [r for r in rows if "pseudo" in r]
        sources = [r["input_ids"] for r in rows] + [r["input_ids"] for r in paired]
        labels = [r["labels"] for r in rows] + [r["pseudo"] for r in paired]
        enc = {"input_ids": pad_rows(sources, self.tokenizer.pad_token_id), "attention_mask": attention_mask(sources),
               "labels": pad_rows(labels, -100)}
        weights = torch.zeros(enc["labels"].shape, dtype=torch.float32)
        for i, r in enumerate(rows):
            weights[i, :len(r["labels"])] = 1.0 / len(r["labels"])
        for i, r in enumerate(paired, start=len(rows)):
            weights[i, :len(r["pseudo"])] = r["pseudo_weights"]
        enc["token_weights"] = weights
        enc["annotated_rows"] = torch.tensor(len(rows))
        return enc

    def length_checks(self, client: str) -> list:
        """Tokens of the client's inputs ("task: input") and targets (+ EOS), uncut."""
        examples = [e for split in SPLITS for e in self.examples(client, split)]
        src = self.tokenizer([e.source for e in examples], return_token_type_ids=False,
                             return_attention_mask=False)["input_ids"] if examples else []
        tgt = self.tokenizer([e.target for e in examples], add_special_tokens=False)["input_ids"] if examples else []
        s = self.settings
        return [Lengths("input tokens", "task.max_source_length", s.max_source_length, tuple(map(len, src))),
                Lengths("target tokens (+ EOS)", "task.max_target_length", s.max_target_length,
                        tuple(len(t) + 1 for t in tgt))]

    def token_settings(self) -> dict:
        return {"max_source_length": self.settings.max_source_length,
                "max_target_length": self.settings.max_target_length, "eos": self.eos}

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

    rows_per_example = 1

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each annotated row's token-mean loss (DP-SGD; a client under DP takes no pseudo rows)."""
        annotated, pseudo = self.sequence_losses(model, batch)
        if pseudo.numel():
            raise ValueError("DP-SGD takes the silo's own examples only; this batch holds pseudo-labelled rows")
        return annotated

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
        return without_items(self.evaluate_items(model, client, split, progress, final))

    @torch.no_grad()
    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """`evaluate`'s rows with each example's stats (its metric's statistics and token loss)."""
        from fedsilo.models.seq2seq import token_losses_and_greedy

        rows = []
        was_training = model.training
        model.eval()
        try:
            for name, examples in self.splits[client][split].items():
                preds: list[str] = [""] * len(examples)
                losses: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
                loss_sum, loss_n = 0.0, 0
                encoded = self.rows((client, split, name), examples)
                for idx in sorted_batches([len(r["input_ids"]) for r in encoded], self.settings.eval_batch_size):
                    enc = {k: v.to(model.device) for k, v in self.pad([encoded[i] for i in idx]).items()}
                    labels = enc.pop("labels")
                    del enc["token_weights"], enc["annotated_rows"]
                    token_loss, ids = token_losses_and_greedy(model, enc, labels, self.settings.max_target_length - 1)
                    loss_sum, loss_n = loss_sum + float(token_loss.sum()), loss_n + int((labels != -100).sum())
                    per_row = zip(token_loss.sum(1).tolist(), (labels != -100).sum(1).tolist())
                    for i, p, loss in zip(idx, self.tokenizer.batch_decode(ids, skip_special_tokens=True), per_row):
                        preds[i], losses[i] = p.strip(), loss
                    if progress is not None:
                        progress.advance(len(idx))
                items = [{**item_stats(self.metrics[name], p, tuple(self._written.get(r, r) for r in e.references),
                                       rouge=self.settings.rouge), "loss_sum": loss, "loss_n": float(tokens)}
                         for p, e, (loss, tokens) in zip(preds, examples, losses)]
                stats = {**example_stats(self.metrics[name], [], []), **pool(items),  # the metric's zeros, then the sums
                         "loss_sum": loss_sum, "loss_n": float(loss_n)}  # the loss as summed per batch
                rows.append(item_row(client, name, [[e.source, list(e.references)] for e in examples], items, stats))
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
