"""QA answer selection as a fedsilo task (the `Task` contract of `fedsilo.tasks.base`): one silo per
domain, a cross-encoder f(q, a) trained with FedMatch's pairwise hinge. Knows nothing of federation.

Training examples are (question, relevant answer, irrelevant answer) triples; evaluation scores every
candidate of each dev/test question and keeps additive ranking stats (see `metrics`). BM25 over the
silo's answer pool is scored beside the model as an untrained reference (`reference`).
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsilo.errors import DataError
from fedsilo.sources.check import Lengths
from fedsilo.tasks.base import fixed_subsample, item_row, pool, without_items
from fedsilo.tasks.tokens import attention_mask, pad_rows

from .bm25 import Bm25Index
from .data import silo_questions
from .metrics import SPEC, question_stats
from .plugin import MatchingSettings
from .questions import Question

__all__ = ["MatchingTask", "Triple", "triples"]

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Triple:
    question: str
    positive: str
    negative: str


def triples(questions: Sequence[Question], per_question: int, key: str) -> list[Triple]:
    """Every (relevant, irrelevant) pair of each question, or a fixed subsample of `per_question` of
    them (seeded by `key` and the question, independent of the run seed)."""
    out = []
    for q in questions:
        pos = [c for c, y in zip(q.candidates, q.labels) if y]
        neg = [c for c, y in zip(q.candidates, q.labels) if not y]
        pairs = [(p, n) for p in pos for n in neg]
        if per_question and len(pairs) > per_question:
            pairs = random.Random(f"{key}/{q.qid}").sample(pairs, per_question)
        out += [Triple(q.text, p, n) for p, n in pairs]
    return out


def _eval_set(questions: list[Question], n: int, key: str) -> list[Question]:
    """Every question (those that cannot be ranked are counted as dropped), or a fixed subsample of
    `n` among those that can be ranked: a subsample spends its size on questions that count."""
    if not n or len(questions) <= n:
        return questions
    return fixed_subsample([q for q in questions if _rankable(q)], n, key)


def _rankable(q: Question) -> bool:
    return 0 < sum(q.labels) < len(q.labels)


def _check_rankable(data_dir: Path, silo: str, split: str, questions: Sequence[Question]) -> None:
    """A split without one question that can be ranked is refused before training: a dev or test
    split would have no MAP/MRR, and the mean over silos would silently cover fewer silos."""
    if any(_rankable(q) for q in questions):
        return
    labels = [y for q in questions for y in q.labels]
    why = ("it is empty" if not labels else f"every {split} label is 0: no question has a correct answer"
           if not any(labels) else f"every {split} label is 1" if all(labels) else "no question has both")
    then = "nothing to train on" if split == "train" else "no MAP/MRR, and the mean over silos would leave it out"
    raise DataError(f"{data_dir}: silo {silo}, {split} split: no question has both a relevant and an irrelevant "
                    f"candidate ({why}); {then}. Fix its labels or leave {silo} out of task.silos")


class MatchingTask:
    """The chosen domains as silos: train triples, dev/test questions with their candidate lists."""
    name = "matching"
    spec = SPEC

    def __init__(self, settings: MatchingSettings, tokenizer, data_dir: str | Path | None) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.display = settings.display_names()
        self.reference_names = list(settings.reference)
        self.questions: dict[str, dict[str, list[Question]]] = {}
        self.train: dict[str, list[Triple]] = {}
        self._pools: dict[str, tuple[object, dict[str, int]]] = {}  # BM25 per silo, built on first use
        for silo in settings.silos:
            raw = silo_questions(settings, silo, self.data_dir)
            where = settings.own_source(silo).path if settings.own_source(silo) else self.data_dir
            for split in SPLITS:
                _check_rankable(where, silo, split, raw[split])
            trainable = [q for q in raw["train"] if _rankable(q)]
            self.questions[silo] = {
                "train": fixed_subsample(trainable, settings.max_train, f"{silo}/train"),
                "dev": _eval_set(raw["dev"], settings.max_eval, f"{silo}/dev"),
                "test": _eval_set(raw["test"], settings.max_eval, f"{silo}/test"),
            }
            self.train[silo] = triples(self.questions[silo]["train"], settings.pairs_per_question, f"{silo}/pairs")

    # ---- the Task contract ---------------------------------------------------------------

    @property
    def clients(self) -> list[str]:
        return list(self.settings.silos)

    def examples(self, client: str, split: str) -> Sequence[Triple] | Sequence[Question]:
        """Training triples for `train`; questions (with candidate lists) for dev and test."""
        return self.train[client] if split == "train" else self.questions[client][split]

    def encode(self, questions: Sequence[str], answers: Sequence[str]) -> dict[str, torch.Tensor]:
        """'[CLS] q [SEP] a [SEP]' pairs, the longer side cut first at `max_length`."""
        return dict(self.tokenizer(list(questions), list(answers), truncation="longest_first",
                                   max_length=self.settings.max_length, padding=True, return_tensors="pt"))

    def collate(self, batch: Sequence[Triple]) -> dict[str, torch.Tensor]:
        """The batch's relevant pairs, then its irrelevant pairs, in one encoding of 2·B rows."""
        return self.pad(self.tokenize(batch))

    # ---- tokenise once (fedsilo.tasks.tokens) ---------------------------------------------

    def tokenize(self, triples: Sequence[Triple]) -> list[dict[str, torch.Tensor]]:
        """Each triple's two pairs, '[CLS] q [SEP] a [SEP]', the longer side cut first at `max_length`."""
        out = []
        for side in ("positive", "negative"):
            enc = self.tokenizer([t.question for t in triples], [getattr(t, side) for t in triples],
                                 truncation="longest_first", max_length=self.settings.max_length,
                                 return_attention_mask=False)
            types = enc.get("token_type_ids") or [[0] * len(ids) for ids in enc["input_ids"]]
            out.append([(torch.tensor(ids), torch.tensor(tt)) for ids, tt in zip(enc["input_ids"], types)])
        return [{"pos_ids": p[0], "pos_types": p[1], "neg_ids": n[0], "neg_types": n[1]} for p, n in zip(*out)]

    def pad(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids = [r["pos_ids"] for r in rows] + [r["neg_ids"] for r in rows]
        types = [r["pos_types"] for r in rows] + [r["neg_types"] for r in rows]
        batch = {"input_ids": pad_rows(ids, self.tokenizer.pad_token_id), "attention_mask": attention_mask(ids)}
        if "token_type_ids" in self.tokenizer.model_input_names:
            batch["token_type_ids"] = pad_rows(types, self.tokenizer.pad_token_type_id)
        return batch

    def token_settings(self) -> dict:
        return {"max_length": self.settings.max_length}

    def length_checks(self, client: str) -> list:
        """Tokens of '[CLS] q [SEP] a [SEP]' for every candidate of the silo's questions, uncut."""
        pairs = [(q.text, c) for split in SPLITS for q in self.questions[client][split] for c in q.candidates]
        lengths = [len(ids) for ids in self.tokenizer([q for q, _ in pairs], [a for _, a in pairs],
                                                      return_attention_mask=False,
                                                      return_token_type_ids=False)["input_ids"]] if pairs else []
        return [Lengths("question + answer tokens", "task.max_length", self.settings.max_length, tuple(lengths))]

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """FedMatch's pairwise hinge, mean over the batch: max(0, margin − f(q,a⁺) + f(q,a⁻))."""
        scores = model(**batch).logits.squeeze(-1)
        pos, neg = scores.chunk(2)
        return {"hinge": torch.relu(self.settings.margin - pos + neg).mean()}

    rows_per_example = 2  # a triple is its relevant and its irrelevant pair: two rows of the encoder's batch

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each triple's hinge [B] (DP-SGD clips per triple)."""
        pos, neg = model(**batch).logits.squeeze(-1).chunk(2)
        return torch.relu(self.settings.margin - pos + neg)

    @torch.no_grad()
    def scores(self, model: torch.nn.Module, questions: Sequence[Question], progress=None) -> list[list[float]]:
        """f(q, a) for every candidate of every question. Pairs are scored in batches of similar
        length (less padding); a question counts on `progress` once all its candidates are scored."""
        pairs = [(i, j) for i, q in enumerate(questions) for j in range(len(q.candidates))]
        order = sorted(range(len(pairs)), key=lambda k: (len(questions[pairs[k][0]].text) +
                                                         len(questions[pairs[k][0]].candidates[pairs[k][1]])))
        out = [[0.0] * len(q.candidates) for q in questions]
        left = [len(q.candidates) for q in questions]
        was_training = model.training
        model.eval()
        try:
            bs = self.settings.eval_batch_size
            for s in range(0, len(order), bs):
                chunk = [pairs[k] for k in order[s:s + bs]]
                enc = self.encode([questions[i].text for i, _ in chunk],
                                  [questions[i].candidates[j] for i, j in chunk])
                logits = model(**{k: v.to(model.device) for k, v in enc.items()}).logits.squeeze(-1)
                done = 0
                for (i, j), value in zip(chunk, logits.float().cpu().tolist()):
                    out[i][j] = value
                    left[i] -= 1
                    done += left[i] == 0
                if progress is not None and done:
                    progress.advance(done)
        finally:
            model.train(was_training)
        return out

    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        """One row of summed ranking stats for `client`'s `split` (see `metrics`)."""
        return without_items(self.evaluate_items(model, client, split, progress, final))

    def evaluate_items(self, model: torch.nn.Module, client: str, split: str, progress=None,
                       final: bool = False) -> list[dict]:
        """`evaluate`'s row with each question's stats (a dropped one counts `dropped`): the items a
        paired randomisation test over questions permutes. A question's id is its content (text,
        candidates, labels), never its file's path: the same data elsewhere pairs."""
        questions = self.questions[client][split]
        rankable = [q for q in questions if _rankable(q)]
        if progress is not None and len(rankable) < len(questions):
            progress.advance(len(questions) - len(rankable))  # dropped without scoring
        scored = iter(self.scores(model, rankable, progress))
        items = [question_stats(next(scored), q.labels, self.settings.margin) if _rankable(q) else {"dropped": 1.0}
                 for q in questions]
        stats = pool(items)
        stats.setdefault("dropped", 0.0)
        return [item_row(client, self.name, [[q.text, q.candidates, q.labels] for q in questions], items, stats)]

    # ---- untrained references ------------------------------------------------------------

    def reference(self, name: str, client: str, split: str) -> list[dict]:
        """Rows of an untrained ranker (`bm25`: BM25 of the question against each candidate, the
        index holding every candidate text of the silo, all splits) on `client`'s `split`."""
        if name != "bm25":
            raise ValueError(f"unknown reference ranker {name!r}")
        index, position = self._pool(client)
        rows = []
        for q in self.questions[client][split]:
            if not _rankable(q):
                rows.append({"dropped": 1.0})
                continue
            all_scores = index.scores(q.text)
            stats = question_stats([float(all_scores[position[c]]) for c in q.candidates], q.labels)
            rows.append({k: v for k, v in stats.items() if k not in ("hinge_sum", "pairs")})
        return [{"client": client, "task": self.name, "stats": pool(rows)}]

    def _pool(self, silo: str):
        if silo not in self._pools:
            raw = silo_questions(self.settings, silo, self.data_dir)  # cached on disk (or small own files): cheap
            texts = list(dict.fromkeys(c for s in SPLITS for q in raw[s] for c in q.candidates))
            self._pools[silo] = (Bm25Index(texts), {t: i for i, t in enumerate(texts)})
        return self._pools[silo]
