"""A toy answer-selection task ("toyrank") for engine tests: a second task family beside text2sql.

Importing this module registers it in ``fedsilo.tasks.TASKS``. Its default model is the encoder
kind's ``tiny-bert`` cross-encoder, so a run on it trains in seconds.

Data (synthetic, deterministic from ``(seed_data, silo, split)``): a question is three words from a
small vocabulary of real English words (each one WordPiece token in MiniLM's vocabulary); it has four
candidate answers of three words, one positive and three negatives. Each silo has its own rule: the
positive contains the question's word at the silo's position (alpha: first, beta: last, gamma:
second). One negative (a distractor) contains another word of the question, so a model must learn
the silo's rule, not mere overlap; the other negatives share no word with the question.

``examples(silo, split)`` gives one item per QUESTION (a :class:`Question` holding its candidate
:class:`Pair` s), so the candidates of a question always land in one batch; ``collate`` flattens them.

Metrics (additive stats per silo): ``ap_sum``, ``rr_sum``, ``p1_sum`` summed over the questions with
at least one positive candidate, and ``questions`` counting those; MAP, MRR and P@1 are the sums over
``questions``, in %. Questions without a positive are left out (as WikiQA evaluation does).

Tie rule (pessimistic): candidates are ranked by score, and among equal scores negatives rank before
positives. A model giving every candidate the same score therefore gets the worst ranking, never a
flattering one (and the candidates' order in the data cannot matter).
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from pydantic import Field, field_validator

from fedsilo.tasks import TASKS, TaskPlugin, TaskSettings, check_names
from fedsilo.tasks.base import Column, Metrics, MetricSpec

SILOS = ("alpha", "beta", "gamma")
RULE_POSITION = {"alpha": 0, "beta": -1, "gamma": 1}  # the question word the positive must contain
SPLITS = ("train", "dev", "test")
VOCAB = ("red blue green black white cat dog bird fish horse apple bread milk rice cake river hill lake "
         "road town sun moon star rain snow king queen boy girl man book door chair table car ship train "
         "lamp bell ring tree").split()
Q_LEN = 3
A_LEN = 3
NEGATIVES = 3


class ToyRankSettings(TaskSettings):
    name: Literal["toyrank"] = "toyrank"
    silos: list[str] = Field(default_factory=lambda: list(SILOS))
    n_train: int = Field(24, gt=0, description="train questions per silo")
    n_train_of: dict[str, int] = Field(default_factory=dict, description="a silo's own n_train (uneven sizes)")
    n_eval: int = Field(8, gt=0, description="dev and test questions per silo")
    seed_data: int = Field(0, ge=0)

    @field_validator("silos")
    @classmethod
    def _known_silos(cls, v: list[str]) -> list[str]:
        return check_names(v, SILOS)

    def client_names(self) -> list[str]:
        return list(self.silos)

    def known_clients(self) -> list[str]:
        return list(SILOS)


class Pair(NamedTuple):
    """One (question, candidate answer) example; label 1 = a correct answer."""
    question: str
    answer: str
    label: int
    qid: str  # "<silo>/<split>/<index>"


@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    candidates: tuple[Pair, ...]


# ---- data ----------------------------------------------------------------------------------

def make_questions(silo: str, split: str, n: int, seed_data: int = 0) -> list[Question]:
    """`n` questions of `silo`'s `split`, deterministic from (seed_data, silo, split)."""
    rng = random.Random(f"toyrank/{seed_data}/{silo}/{split}")
    pos_at = RULE_POSITION[silo]
    out = []
    for i in range(n):
        words = rng.sample(VOCAB, Q_LEN)
        key = words[pos_at]
        others = [w for w in words if w != key]
        free = [w for w in VOCAB if w not in words]
        answers = [(_answer(rng, key, free), 1), (_answer(rng, rng.choice(others), free), 0)]
        answers += [(" ".join(rng.sample(free, A_LEN)), 0) for _ in range(NEGATIVES - 1)]
        rng.shuffle(answers)
        qid = f"{silo}/{split}/{i}"
        text = " ".join(words)
        out.append(Question(qid, text, tuple(Pair(text, a, label, qid) for a, label in answers)))
    return out


def _answer(rng: random.Random, word: str, free: Sequence[str]) -> str:
    """Three words: `word` at a random position among words that are not in the question."""
    words = rng.sample(list(free), A_LEN - 1)
    words.insert(rng.randrange(A_LEN), word)
    return " ".join(words)


# ---- metrics -------------------------------------------------------------------------------

def rank_stats(scores: Sequence[float], labels: Sequence[int]) -> tuple[float, float, float] | None:
    """(average precision, reciprocal rank, precision at 1) of one question; None without a positive.

    Ranked by score, higher first; ties put negatives before positives (pessimistic)."""
    if not any(labels):
        return None
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), 1 if labels[i] else 0))
    hits, precisions, rr = 0, [], 0.0
    for rank, i in enumerate(order, start=1):
        if labels[i]:
            hits += 1
            precisions.append(hits / rank)
            if hits == 1:
                rr = 1.0 / rank
    p1 = 1.0 if labels[order[0]] else 0.0
    return sum(precisions) / len(precisions), rr, p1


def _pct(num: Any, den: Any) -> float | None:
    return 100.0 * float(num) / float(den) if den else None


def compute_metrics(stats: Mapping[str, Any]) -> Metrics:
    n = stats.get("questions")
    return {"map": _pct(stats.get("ap_sum", 0), n), "mrr": _pct(stats.get("rr_sum", 0), n),
            "p1": _pct(stats.get("p1_sum", 0), n)}


SPEC = MetricSpec(
    columns=(Column("map", "MAP %"), Column("mrr", "MRR %"), Column("p1", "P@1 %")),
    compute=compute_metrics,
    primary="map",
    higher_is_better=True,
    tie_break=None,
    selection="macro",
    description=("One row per toy answer-selection silo: MAP, MRR and P@1 (%) over its questions with a "
                 "correct candidate; ties in score rank negatives first (pessimistic)."),
)


def pairwise_hinge(scores: torch.Tensor, labels: torch.Tensor, group: torch.Tensor,
                   margin: float = 1.0) -> torch.Tensor:
    """mean over (positive, negative) pairs of one group of max(0, margin − s⁺ + s⁻).

    A batch without such a pair gives a zero that still depends on the scores (backward works)."""
    pos = labels.bool()
    pairs = (group[:, None] == group[None, :]) & pos[:, None] & ~pos[None, :]
    if not bool(pairs.any()):
        return scores.sum() * 0.0
    hinge = torch.relu(margin - scores[:, None] + scores[None, :])
    return hinge[pairs].mean()


# ---- the task ------------------------------------------------------------------------------

class ToyRankTask:
    name = "toyrank"
    spec = SPEC
    display = {s: s for s in SILOS}

    def __init__(self, settings: ToyRankSettings, tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.splits: dict[str, dict[str, list[Question]]] = {
            silo: {split: make_questions(silo, split, settings.n_train_of.get(silo, settings.n_train) if split == "train"
                                               else settings.n_eval,
                                         settings.seed_data) for split in SPLITS}
            for silo in settings.silos}

    @property
    def clients(self) -> list[str]:
        return list(self.settings.silos)

    def examples(self, client: str, split: str) -> list[Question]:
        return self.splits[client][split]

    def collate(self, batch: Sequence[Question]) -> dict[str, torch.Tensor]:
        """All candidates of the batch's questions as "[CLS] q [SEP] a [SEP]" rows, with `labels` and
        `qid`: the question's index within this batch (so questions from several silos cannot clash)."""
        pairs = [(p, g) for g, q in enumerate(batch) for p in q.candidates]
        enc = self.tokenizer([p.question for p, _ in pairs], [p.answer for p, _ in pairs], padding=True,
                             truncation=True, max_length=64, return_tensors="pt", return_token_type_ids=True)
        out = dict(enc)
        out["labels"] = torch.tensor([p.label for p, _ in pairs], dtype=torch.long)
        out["qid"] = torch.tensor([g for _, g in pairs], dtype=torch.long)
        return out

    @staticmethod
    def scores(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        return model(**inputs).logits.reshape(-1)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"task": pairwise_hinge(self.scores(model, batch).float(), batch["labels"], batch["qid"])}

    rows_per_example = NEGATIVES + 1  # a question is all its candidates

    def example_losses(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each question's own pairwise hinge (DP-SGD)."""
        scores = self.scores(model, batch).float()
        return torch.stack([pairwise_hinge(scores[m], batch["labels"][m], batch["qid"][m])
                            for m in (batch["qid"] == g for g in range(int(batch["qid"].max()) + 1))])

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, client: str, split: str, progress=None,
                 final: bool = False) -> list[dict]:
        questions = self.examples(client, split)
        stats = {"ap_sum": 0.0, "rr_sum": 0.0, "p1_sum": 0.0, "questions": 0.0}
        param = next(iter(model.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        was_training = model.training
        model.eval()
        try:
            bs = self.settings.eval_batch_size
            for i in range(0, len(questions), bs):
                chunk = questions[i:i + bs]
                batch = {k: v.to(device) for k, v in self.collate(chunk).items()}
                scores = self.scores(model, batch).float().cpu().tolist()
                k = 0
                for q in chunk:
                    n = len(q.candidates)
                    got = rank_stats(scores[k:k + n], [p.label for p in q.candidates])
                    k += n
                    if got is not None:
                        ap, rr, p1 = got
                        stats["ap_sum"] += ap
                        stats["rr_sum"] += rr
                        stats["p1_sum"] += p1
                        stats["questions"] += 1
                if progress is not None:
                    progress.advance(len(chunk))
        finally:
            model.train(was_training)
        return [{"client": client, "task": self.name, "stats": stats}]


TASKS.register("toyrank", ToyRankSettings)(TaskPlugin(
    build=lambda settings, tokenizer, data_dir: ToyRankTask(settings, tokenizer),
    spec=lambda: SPEC,
    data=None,
    default_model={"kind": "encoder", "name": "tiny-bert"},
))
