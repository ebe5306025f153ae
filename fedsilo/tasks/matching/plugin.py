"""matching's registration: its config section and a lazy builder (no model or data code here)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedsilo.sources.settings import Roles, SourceSettings
from fedsilo.tasks import TASKS, SiloTaskSettings, TaskPlugin, silos_field, sources_field

SILOS = ("medquad", "fiqa", "insuranceqa", "wikiqa", "trecqa")  # the benchmark's silos (no data code on import)
DISPLAY = {"medquad": "MedQuAD", "fiqa": "FiQA", "insuranceqa": "InsuranceQA", "wikiqa": "WikiQA",
           "trecqa": "TrecQA"}


class RankingSource(SourceSettings):
    """An own answer-selection silo: (question, candidate, label) rows, a question's rows gathered
    wherever they are; or JSONL rows holding a question with lists of candidates and labels. Without
    any label every candidate is a correct answer and `task.negatives` BM25-mined answers of the
    silo are its wrong ones (the paper's way for sources without negatives)."""
    ROLES: ClassVar[Roles] = Roles(("question", "candidate"), optional=("label",), key="question",
                                   lists=("candidate", "label"), aliases=(
        ("question", ("query", "q", "questions", "question_text")),
        ("candidate", ("answer", "answers", "candidates", "passage", "response", "document", "a")),
        ("label", ("labels", "relevant", "is_relevant", "relevance", "correct", "y"))))


class MatchingSettings(SiloTaskSettings):
    SOURCE: ClassVar[type[SourceSettings]] = RankingSource
    BENCHMARK: ClassVar[tuple[str, ...]] = SILOS
    DISPLAY: ClassVar[dict[str, str]] = DISPLAY

    name: Literal["matching"] = "matching"
    sources: dict[str, RankingSource] = sources_field()
    silos: list[str] = silos_field(SILOS, "domains")
    max_train: int = Field(0, ge=0, description="training questions per silo, a fixed subsample (0 = all)")
    max_eval: int = Field(0, ge=0, description="dev/test questions per silo: a fixed subsample of those with "
                                               "a relevant and an irrelevant candidate (0 = all)")
    negatives: int = Field(5, gt=0, le=100, description="BM25-mined negatives per question where a source "
                                                        "has none (MedQuAD, FiQA); the paper: 5")
    pairs_per_question: int = Field(5, ge=0, description="training (positive, negative) pairs per question, "
                                                         "a seeded subsample (0 = every pair)")
    max_length: int = Field(256, gt=0, le=4096, description="tokens of '[CLS] q [SEP] a [SEP]', the answer cut first")
    margin: float = Field(1.0, gt=0, description="the hinge's margin: max(0, margin - f(q,a+) + f(q,a-))")
    reference: list[Literal["bm25"]] = Field(default_factory=lambda: ["bm25"],
                                             description="untrained reference rankers scored beside the model")


def _build(settings: MatchingSettings, tokenizer, data_dir):
    from .task import MatchingTask
    return MatchingTask(settings, tokenizer, data_dir)


def _spec():
    from .metrics import SPEC
    return SPEC


def _verify(settings: MatchingSettings, data_dir) -> None:
    from .benchmark import verify_data_dir
    verify_data_dir([s for s in settings.silos if not settings.own_source(s)], data_dir)


def _silo_files(settings: MatchingSettings, silo: str) -> list[str]:
    from .benchmark import required_files
    return [] if settings.own_source(silo) else required_files([silo])


def _inspect(settings: MatchingSettings, silo: str, data_dir):
    from .data import inspect_silo
    return inspect_silo(settings, silo, data_dir)


TASKS.register("matching", MatchingSettings)(TaskPlugin(
    build=_build, spec=_spec, data="matching", verify=_verify, silo_files=_silo_files, inspect=_inspect,
    default_model={"kind": "encoder", "name": "minilm"}))
