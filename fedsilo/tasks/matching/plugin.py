"""matching's registration: its config section and a lazy builder (no model or data code here)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedsilo.tasks import TASKS, TaskPlugin, TaskSettings, check_names

SILOS = ("medquad", "fiqa", "insuranceqa", "wikiqa", "trecqa")  # = data.SILOS (no data code on import)


class MatchingSettings(TaskSettings):
    name: Literal["matching"] = "matching"
    silos: list[str] = Field(default_factory=lambda: list(SILOS), description="one client per domain")
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

    @field_validator("silos")
    @classmethod
    def _silos(cls, v: list[str]) -> list[str]:
        return check_names(v, SILOS)

    def client_names(self) -> list[str]:
        return list(self.silos)

    def known_clients(self) -> list[str]:
        return list(SILOS)


def _build(settings: MatchingSettings, tokenizer, data_dir):
    from .task import MatchingTask
    return MatchingTask(settings, tokenizer, data_dir)


def _spec():
    from .metrics import SPEC
    return SPEC


def _verify(settings: MatchingSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir(settings.silos, data_dir)


def _silo_files(settings: MatchingSettings, silo: str) -> list[str]:
    from .data import required_files
    return required_files([silo])


TASKS.register("matching", MatchingSettings)(TaskPlugin(
    build=_build, spec=_spec, data="matching", verify=_verify, silo_files=_silo_files,
    default_model={"kind": "encoder", "name": "minilm"}))
