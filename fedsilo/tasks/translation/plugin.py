"""translation's registration: its config section, a lazy builder and its tokenizer (no model code here)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedsilo.tasks import TASKS, TaskPlugin, TaskSettings, check_names

DOMAINS = ("news", "ted", "tatoeba", "docs", "ui")  # = data.DOMAINS (kept here: no data code on import)


def _domains(v: list[str], what: str, empty_ok: bool = False) -> list[str]:
    return check_names(v, DOMAINS, "domain", what, empty_ok)


class TranslationSettings(TaskSettings):
    name: Literal["translation"] = "translation"
    silos: list[str] = Field(default_factory=lambda: list(DOMAINS), description="one client per domain")
    max_train: int = Field(0, ge=0, description="train pairs per domain, a fixed subsample (0 = all)")
    max_eval: int = Field(0, ge=0, description="dev/test pairs per domain, a fixed subsample (0 = all)")
    max_source_length: int = Field(128, gt=0, le=1024)
    max_target_length: int = Field(128, gt=0, le=1024)
    vocab_size: int = Field(8000, ge=16, le=2**18, description="joint German-English subword vocabulary")
    tokenizer_model: Literal["unigram", "bpe"] = "unigram"
    tokenizer_domain: str = Field("news", description="the generic engine's data, the only text the "
                                                      "tokenizer is fitted on")
    matrix: list[str] | None = Field(None, description="domains of the cross-domain test matrix (every "
                                                       "model x every domain); None: all five, []: off")

    @field_validator("silos")
    @classmethod
    def _silos(cls, v: list[str]) -> list[str]:
        return _domains(v, "silos")

    @field_validator("matrix")
    @classmethod
    def _matrix(cls, v: list[str] | None) -> list[str] | None:
        return v if v is None else _domains(v, "matrix", empty_ok=True)

    @field_validator("tokenizer_domain")
    @classmethod
    def _tokenizer_domain(cls, v: str) -> str:
        return _domains([v], "tokenizer_domain")[0]

    def client_names(self) -> list[str]:
        return list(self.silos)

    def known_clients(self) -> list[str]:
        return list(DOMAINS)

    def matrix_domains(self) -> list[str]:
        return list(DOMAINS) if self.matrix is None else list(self.matrix)

    def for_silos(self, names: list[str]) -> "TranslationSettings":
        """A silo's machine holds its own domain only: no cross-domain matrix there."""
        return self.model_copy(update={"silos": list(names), "matrix": []})

    def needed_domains(self) -> list[str]:
        """Every domain whose files this config reads: silos, matrix, the tokenizer's."""
        return list(dict.fromkeys([*self.silos, *self.matrix_domains(), self.tokenizer_domain]))


def _build(settings: TranslationSettings, tokenizer, data_dir):
    from .task import TranslationTask
    return TranslationTask(settings, tokenizer, data_dir)


def _spec():
    from .metrics import SPEC
    return SPEC


def _verify(settings: TranslationSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir(settings.model_copy(update={"silos": settings.needed_domains()}), data_dir)


def _tokenizer(settings: TranslationSettings, data_dir):
    from .task import task_tokenizer
    return task_tokenizer(settings, data_dir)


def _silo_files(settings: TranslationSettings, silo: str) -> list[str]:
    """A silo's own domain, and the generic engine's data its tokenizer is fitted on (public)."""
    from .data import required_files
    return required_files(settings.for_silos([silo]).needed_domains())


TASKS.register("translation", TranslationSettings)(TaskPlugin(
    build=_build, spec=_spec, data="translation", verify=_verify, tokenizer=_tokenizer, silo_files=_silo_files,
    default_model={"kind": "seq2seq", "name": "transformer"}))
