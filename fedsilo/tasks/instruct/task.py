"""Instruction tuning as a fedsilo task (the `Task` contract of fedsilo.tasks.base): one silo per
institution, each record rendered by the model tokenizer's chat template (or the plain template) and
trained with the completion-only loss. Knows nothing of federation.

A row is one silo. Its stats are additive (see `metrics`): the response tokens' summed cross-entropy
and count for every silo; GSM8K's exact matches after greedy generation; multiple-choice hits by
log-likelihood. Records longer than `task.max_length` are cut (`task.truncation`), counted and said
once per silo and split, in the words of what that split does with them (a training record cut
before its response trains nothing; an evaluated one adds nothing to the loss), and a token-cache hit
says it as the miss did. The prompts generation and multiple-choice scoring read are cut by one rule
(`budget`); every cut is counted per record (`prompt_cut`, `prompt_lost`) and said once per silo and
split.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fedsilo.datafetch import default_data_root
from fedsilo.errors import ConfigError, ConfigWarning
from fedsilo.sources.check import Lengths
from fedsilo.tasks.base import EVALUATION_SPLITS, NONFINITE, fixed_splits, item_row, without_items
from fedsilo.tasks.tokens import RowMemo, sorted_batches

from .budget import fit_prompt, position_limit
from .data import load_silo
from .metrics import SPEC
from .packing import pack, require_packable, unpacked
from .plugin import InstructSettings
from .records import Record
from .choices import from_loss_pass, plan_choices, score_rest
from .scoring import extract_final_number, greedy_generate, same_number, token_nll
from .template import prompt_ids, render, trains, use_chat

__all__ = ["InstructTask", "PackedInstructTask", "build_task", "task_tokenizer"]

SPLITS = ("train", "dev", "test")


def task_tokenizer(settings: InstructSettings, data_dir: Path | None):
    """The built-in decoder's byte-level BPE, fitted on `tokenizer_silo`'s training text only (public
    text no silo owns, never pooled client text) and cached by content."""
    from .tokenizer import load_or_fit

    def texts() -> list[str]:
        records = load_silo(settings, settings.tokenizer_silo, data_dir)["train"]
        return [t for r in records for t in (*(c for _, c in r.turns), r.response)]

    return load_or_fit(texts, {"silo": settings.tokenizer_silo}, default_data_root() / "prepared" / "instruct" /
                       "tokenizers", settings.vocab_size)


def build_task(settings: InstructSettings, tokenizer, data_dir):
    """The task; packed training batches give no per-example losses (DP-SGD clips examples), so a
    packed task is a class without them, and DP-SGD refuses it by that ability."""
    return (PackedInstructTask if settings.packing else InstructTask)(settings, tokenizer, data_dir)


class _Instruct:
    name = "instruct"
    spec = SPEC

    def __init__(self, settings: InstructSettings, tokenizer, data_dir: str | Path | None) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.display = settings.display_names()
        self.chat = use_chat(tokenizer, settings.template)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.splits: dict[str, dict[str, list[Record]]] = {}
        for silo in settings.silos:
            where = settings.own_source(silo).path if settings.own_source(silo) else self.data_dir
            self.splits[silo] = fixed_splits(load_silo(settings, silo, self.data_dir), silo, settings.max_train,
                                             settings.max_eval, where, "instruct silo", "records")
        self.rows = RowMemo(self)
        self._said: set[tuple] = set()
        self._answers: dict[tuple[str, str], list[dict]] = {}

    # ---- the Task contract ---------------------------------------------------------------

    @property
    def clients(self) -> list[str]:
        return list(self.settings.silos)

    def examples(self, client: str, split: str) -> list[Record]:
        return self.splits[client][split]

    def collate(self, batch: Sequence[Record]) -> dict[str, torch.Tensor]:
        return self.pad(self.tokenize(batch))

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The completion-only loss: mean cross-entropy over the batch's response tokens."""
        nll = self._nll(model, batch)
        return {"task": nll.sum() / (batch["labels"][:, 1:] != -100).sum().clamp(min=1)}

    # ---- tokenise once (fedsilo.tasks.tokens) ---------------------------------------------

    def tokenize(self, records: Sequence[Record]) -> list[dict[str, torch.Tensor]]:
        rendered = [self._render(r) for r in records]
        rows = [{"input_ids": torch.tensor(r.input_ids), "labels": torch.tensor(r.labels)} for r in rendered]
        self._say_cut(records, [r.truncated for r in rendered], rows)
        return rows

    def tell_cuts(self, records: Sequence[Record], rows: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Rows read from the token cache: said as `tokenize` said them (fedsilo.tasks.tokens.TellsCuts)."""
        self._say_cut(records, self._cut(records, rows), rows)

    def _cut(self, records: Sequence[Record], rows: Sequence[Mapping[str, torch.Tensor]]) -> list[bool]:
        """Which of `rows` were cut: only a row of max_length tokens can have been, so only those records
        are rendered again."""
        return [len(row["input_ids"]) >= self.settings.max_length and self._render(record).truncated
                for record, row in zip(records, rows)]

    def _render(self, record: Record):
        return render(record, self.tokenizer, self.chat, self.settings.max_length, self.settings.truncation)

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return unpacked(rows, self.pad_id)

    def token_settings(self) -> dict:
        return {"max_length": self.settings.max_length, "chat": self.chat, "truncation": self.settings.truncation}

    def length_checks(self, client: str) -> list:
        """Each record's prompt + response tokens, uncut, against task.max_length."""
        records = [r for split in SPLITS for r in self.examples(client, split)]
        lengths = tuple(self._render(r).full_length for r in records)
        return [Lengths("prompt + response tokens", "task.max_length", self.settings.max_length, lengths)]

    def _say_cut(self, records: Sequence[Record], cut: Sequence[bool],
                 rows: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Truncation is reported, never silent: once per silo and split, how many records were cut and
        what that split does with them (training learns from what is left, evaluation's loss reads it)."""
        if not any(cut):
            return
        silo, split = self._where(records)
        if ("length", silo, split) in self._said:
            return
        self._said.add(("length", silo, split))
        lost = sum(1 for c, row in zip(cut, rows) if c and not trains(row["labels"].tolist()))
        how = "at the end" if self.settings.truncation == "end" else "at the prompt's start"
        message = (f"instruct: {silo} {split}: {sum(cut)} of {len(records)} records are longer than "
                   f"task.max_length = {self.settings.max_length} tokens and were cut {how} (task.truncation)")
        evaluated = split in EVALUATION_SPLITS
        if evaluated:
            message += f": the {split} loss reads what is left"
        if lost:
            message += f"; {lost} lost their whole response and " + \
                (f"add nothing to the {split} loss" if evaluated else "train nothing")
        warnings.warn(ConfigWarning(message), stacklevel=3)

    def _say_prompt_cut(self, silo: str, split: str, reader: str, lost: Sequence[int]) -> None:
        """Every prompt cut before generation or multiple-choice scoring, said once per silo and split."""
        cut = [n for n in lost if n]
        if not cut or (reader, silo, split) in self._said:
            return
        self._said.add((reader, silo, split))
        limit = (f"task.max_prompt_length = {self.settings.max_prompt_length} tokens" if reader == "generation"
                 else f"task.max_length = {self.settings.max_length} less the longest option")
        first = f"{min(cut)}" if min(cut) == max(cut) else f"{min(cut)}–{max(cut)}"
        warnings.warn(ConfigWarning(f"instruct: {silo} {split}: {len(cut)} of {len(lost)} prompts are longer than "
                                    f"{limit}: {reader} read them without their first {first} tokens "
                                    f"({sum(cut)} in all)"), stacklevel=3)

    def _where(self, records: Sequence[Record]) -> tuple[str, str]:
        for silo, splits in self.splits.items():
            for split, held in splits.items():
                if records and held and held[0] is records[0]:
                    return silo, split
        return "a silo", "batch"

    # ---- losses ---------------------------------------------------------------------------

    def _nll(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return token_nll(model(**inputs).logits, batch["labels"])

    # ---- evaluation -----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        return without_items(self.evaluate_items(model, client, split, progress, final))

    @torch.no_grad()
    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """One row of the silo's `split` with each record's stats (see `metrics`)."""
        records = self.examples(client, split)
        self._check_positions(model, records)
        rows = self.rows((client, split), records)
        cut = self._cut(records, rows)
        items: list[dict] = [{} for _ in records]
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        plans, scores = plan_choices(records, self.tokenizer, self.chat, self.settings), {}
        try:
            for idx in sorted_batches([len(r["input_ids"]) for r in rows], self.settings.eval_batch_size):
                batch = {k: v.to(device) for k, v in unpacked([rows[i] for i in idx], self.pad_id).items()}
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                nll = token_nll(logits, batch["labels"])
                scores.update(from_loss_pass(logits, idx, rows, plans))
                del logits
                counts = (batch["labels"][:, 1:] != -100).sum(1)
                for i, s, n in zip(idx, nll.sum(1).tolist(), counts.tolist()):
                    items[i] = {"loss_sum": s, "loss_n": float(n), "cut": float(cut[i])} if math.isfinite(s) \
                        else {NONFINITE: 1.0}
                if progress is not None:
                    progress.advance(len(idx))
            answers: list[dict] = [{} for _ in records]
            self._say_prompt_cut(client, split, "multiple-choice scoring",
                                 self._score_choices(model, records, items, answers, plans, scores))
            if final or self.settings.generate_on == "all":
                self._say_prompt_cut(client, split, "generation", self._score_answers(model, records, items, answers))
        finally:
            model.train(was_training)
        row = item_row(client, self.name, [[list(r.turns), r.response] for r in records], items)
        if final:
            self._answers[(client, split)] = [{"id": key, "prompt": r.turns[-1][1] if r.turns else "", **a}
                                              for key, r, a in zip(row["items"]["ids"], records, answers) if a]
        return [row]

    def _check_positions(self, model, records: Sequence[Record]) -> None:
        """A generation budget the model's positions cannot hold is refused at the first evaluation of a
        split that generates answers (dev included), not after the last round."""
        limit = position_limit(model)
        need = self.settings.max_prompt_length + self.settings.max_new_tokens
        if limit is not None and need > limit and any(r.answer is not None for r in records):
            raise ConfigError(f"task.max_prompt_length = {self.settings.max_prompt_length} + task.max_new_tokens = "
                              f"{self.settings.max_new_tokens} = {need} positions, more than the model's {limit} "
                              "(max_position_embeddings): lower either")

    def _score_choices(self, model, records: Sequence[Record], items: list[dict], answers: list[dict],
                       plans: dict, scores: dict) -> list[int]:
        """Multiple choice as lm-evaluation-harness's acc: the option of largest log-likelihood (`choices`:
        read off the loss pass where it holds them, the rest batched). Returns the prompt tokens each
        scored record lost (`budget`)."""
        asked = [i for i in plans if NONFINITE not in items[i]]
        scores.update(score_rest(model, plans, [i for i in asked if i not in scores], self.settings.eval_batch_size))
        for i in asked:
            got, record = scores[i], records[i]
            best = max(range(len(got)), key=lambda k: got[k])
            items[i].update({"mc_hit": float(best == record.label), "mc_n": 1.0})
            answers[i].update({"chosen": record.options[best], "gold": record.options[record.label],
                               "right": best == record.label,
                               "option_scores": [round(x, 4) for x in got]})
        return [_count_cut(items[i], plans[i].prompt.lost) for i in asked]

    def _score_answers(self, model, records: Sequence[Record], items: list[dict], answers: list[dict]) -> list[int]:
        """GSM8K: greedy generation, batched by prompt length (less padding), then the final number after
        "####" against the gold one. Returns the prompt tokens each generating record lost (`budget`)."""
        asked = [i for i, r in enumerate(records) if r.answer is not None and NONFINITE not in items[i]]
        prompts = {i: fit_prompt(prompt_ids(records[i], self.tokenizer, self.chat), self.settings) for i in asked}
        for batch in sorted_batches([len(prompts[i].ids) for i in asked], self.settings.eval_batch_size):
            chunk = [asked[k] for k in batch]
            outputs = greedy_generate(model, [prompts[i].ids for i in chunk], self.settings.max_new_tokens,
                                      self.eos_id, self.pad_id)
            for i, ids in zip(chunk, outputs):
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                predicted = extract_final_number(text)
                hit = same_number(predicted, records[i].answer)
                items[i].update({"em_hit": float(hit), "em_n": 1.0})
                answers[i].update({"generated": text, "predicted": predicted, "gold": records[i].answer, "right": hit,
                                   "ended": len(ids) < self.settings.max_new_tokens})
        return [_count_cut(items[i], prompts[i].lost) for i in asked]

    def answers(self, client: str, split: str) -> list[dict]:
        """The last final evaluation's text per record of `client`'s `split` (fedsilo.tasks.base.KeepsAnswers):
        the generated answer and its number, or the option chosen and every option's score."""
        return list(self._answers.get((client, split), ()))


def _count_cut(stats: dict, lost: int) -> int:
    """A record's prompt cut in its stats: `prompt_cut` 1 when any token was lost, `prompt_lost` how many."""
    stats["prompt_cut"] = max(stats.get("prompt_cut", 0.0), float(lost > 0))
    stats["prompt_lost"] = stats.get("prompt_lost", 0.0) + lost
    return lost


class PackedInstructTask(_Instruct):
    """Training batches packed into sequences of `task.max_length` (evaluation stays unpacked)."""
    no_example_losses = ": task.packing = true puts several records in one row; set it false for DP-SGD"

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pack(rows, self.settings.max_length, self.pad_id)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        require_packable(model)  # a packed batch needs an attention that reads its block-diagonal mask
        return super().loss(model, batch)


class InstructTask(_Instruct):
    """Unpacked batches: each row is one record, so each record's loss depends on it alone (DP-SGD)."""
    rows_per_example = 1

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each record's mean response-token cross-entropy [batch]."""
        nll = self._nll(model, batch)
        return nll.sum(1) / (batch["labels"][:, 1:] != -100).sum(1).clamp(min=1)
