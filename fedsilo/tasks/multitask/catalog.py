"""The catalogue of few-shot tasks: one converter per CrossFit task, from a raw public source to
text-to-text records.

A converter reads files under the multitask data folder (paths relative to it, as the sources
manifest lists them) and returns `Pools`: the records few-shot train and dev are drawn from, and
the disjoint records the few-shot test is drawn from. Records carry the task's input without the
task-name prefix (the task adds `<task name>: ` when it encodes) and one or more reference outputs.
Inputs and outputs never hold tabs or newlines (`clean`), and outputs never hold "[SEP]": BERT-family
tokenizers read it as their end-of-sequence token.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedsilo.registry import Registry

Group = Literal["classification", "qa", "generation", "other"]
"""The FewFedWeight paper's four groups (its Table 6); "generation" is its conditional generation."""

Metric = Literal["acc", "em", "qa_f1", "macro_f1", "rouge_l", "mcc"]
"""CrossFit's METRICS (dataloader/metrics.py): ACC, EM, QA-F1, Classification-F1, Rouge-L,
Matthew-Correlation."""


@dataclass(frozen=True)
class Record:
    input: str
    outputs: tuple[str, ...]  # references; outputs[0] is the training target (and the class label)


@dataclass(frozen=True)
class Pools:
    train: list[Record]  # few-shot train and dev are drawn from here
    test: list[Record]   # the few-shot test is drawn from here
    note: str = ""       # how the pools were made where the source's own splits are not used as is


@dataclass(frozen=True)
class TaskInfo:
    name: str                      # CrossFit's task name
    group: Group
    metric: Metric
    per_class: bool                # True: k examples per class (CrossFit's classification builders)
    files: tuple[str, ...]         # what the converter reads, relative to the multitask data folder
    license: str
    convert: Callable[[Path], Pools] = field(repr=False)
    in_paper: bool = True          # among the FewFedWeight paper's 117 tasks (its Table 5)

    @property
    def module(self) -> str:
        """The module that defines the converter (through a functools.partial too)."""
        return getattr(self.convert, "func", self.convert).__module__


# The FewFedWeight paper's Table 5 (CrossFit names; aeslc is listed for clients 1 and 4, and kept
# for client 1 here, where it is listed first).
PAPER_CLIENTS: tuple[tuple[str, ...], ...] = (
    ("blimp-determiner_noun_agreement_with_adj_irregular_1", "aeslc", "glue-mrpc", "math_qa", "quarel",
     "kilt_ay2", "tweet_eval-stance_atheism", "lama-squad", "tab_fact", "aqua_rat", "tweet_eval-emoji",
     "glue-wnli", "codah", "spider", "tweet_eval-offensive", "wiki_qa", "blimp-ellipsis_n_bar_1", "openbookqa",
     "sms_spam", "acronym_identification", "ethos-national_origin", "definite_pronoun_resolution", "hellaswag",
     "superglue-wsc", "numer_sense", "ade_corpus_v2-dosage", "blimp-ellipsis_n_bar_2", "squad-no_context",
     "e2e_nlg_cleaned"),
    ("google_wellformed_query", "xsum", "wiqa", "qa_srl", "tweet_eval-stance_abortion", "ade_corpus_v2-effect",
     "sick", "ethos-religion", "commonsense_qa", "jeopardy", "biomrc", "superglue-multirc", "ethos-race",
     "eli5-askh", "glue-qqp", "paws", "ethos-directed_vs_generalized", "glue-sst2", "mocha", "tweet_eval-hate",
     "glue-rte", "hate_speech_offensive", "blimp-anaphor_number_agreement", "lama-conceptnet", "superglue-wic",
     "boolq", "kilt_hotpotqa", "aslg_pc12", "quartz-no_knowledge"),
    ("tweet_eval-stance_climate", "tweet_eval-sentiment", "qasc", "medical_questions_pairs",
     "break-QDMR-high-level", "imdb", "glue-mnli", "ethos-gender", "trec-finegrained", "crows_pairs",
     "adversarialqa", "onestop_english", "duorc", "web_questions", "yelp_review_full", "swag", "proto_qa",
     "scitail", "tweet_eval-stance_feminist", "limit", "common_gen", "scicite",
     "blimp-irregular_past_participle_adjectives", "social_i_qa", "anli", "kilt_zsre", "cosmos_qa",
     "superglue-record", "squad-with_context"),
    ("emotion", "blimp-existential_there_quantifiers_1", "sciq", "race-middle", "kilt_wow", "wino_grande",
     "rotten_tomatoes", "superglue-cb", "poem_sentiment", "ropes", "piqa", "quail", "climate_fever",
     "lama-google_re", "search_qa", "wiki_auto", "mc_taco", "blimp-wh_questions_object_gap", "hotpot_qa", "emo",
     "kilt_nq", "kilt_trex", "quartz-with_knowledge", "dbpedia_14", "yahoo_answers_topics", "app_reviews",
     "superglue-copa", "blimp-anaphor_gender_agreement", "hate_speech18", "gigaword"),
)
PAPER_TASKS = frozenset(t for tasks in PAPER_CLIENTS for t in tasks)

CATALOG: Registry[TaskInfo] = Registry("multitask task")


def register(name: str, *, group: Group, metric: Metric, per_class: bool, files: tuple[str, ...] | list[str],
             license: str, in_paper: bool | None = None) -> Callable[[Callable[[Path], Pools]], Callable[[Path], Pools]]:
    """Decorator: `convert(root) -> Pools` becomes the catalogue's task `name` (`in_paper`: None =
    listed in the paper's Table 5)."""
    def wrap(convert: Callable[[Path], Pools]) -> Callable[[Path], Pools]:
        paper = name in PAPER_TASKS if in_paper is None else in_paper
        CATALOG.add(name, TaskInfo(name, group, metric, per_class, tuple(files), license, convert, paper))
        return convert
    return wrap


_SPACE = re.compile(r"\s+")


def clean(text: str) -> str:
    """CrossFit's `clean` (tasks/utils.py): literal "\\n" and every whitespace run become one space."""
    return _SPACE.sub(" ", text.replace("\\n", " ")).strip()


def split_80_20(records: list[Record], seed: int = 42) -> tuple[list[Record], list[Record]]:
    """CrossFit's split of a source with one split only: shuffle with numpy's legacy seed, first 80%
    train, the rest test (`np.random.seed(42); np.random.shuffle(lines)`)."""
    import numpy as np

    order = list(range(len(records)))
    np.random.seed(seed)
    np.random.shuffle(order)
    cut = int(len(order) * 0.8)
    return [records[i] for i in order[:cut]], [records[i] for i in order[cut:]]
