"""translation's registration: its config section, a lazy builder and its tokenizer (no model code here)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from fedsilo.sources.settings import Roles, SourceSettings
from fedsilo.tasks import TASKS, SiloTaskSettings, TaskPlugin, check_names, silos_field, sources_field

DOMAINS = ("news", "ted", "tatoeba", "docs", "ui")  # the benchmark's silos (no data code on import)
DISPLAY = {"news": "News", "ted": "TED", "tatoeba": "Tatoeba", "docs": "Software docs", "ui": "Software UI"}


class PairSource(SourceSettings):
    """An own translation silo: one (source sentence, reference translation) per row."""
    ROLES: ClassVar[Roles] = Roles(("source", "target"), key="source", aliases=(
        ("source", ("src", "de", "german", "deu", "input", "text", "original")),
        ("target", ("tgt", "en", "english", "eng", "reference", "translation", "output"))))


class TranslationSettings(SiloTaskSettings):
    SOURCE: ClassVar[type[SourceSettings]] = PairSource
    BENCHMARK: ClassVar[tuple[str, ...]] = DOMAINS
    DISPLAY: ClassVar[dict[str, str]] = DISPLAY

    name: Literal["translation"] = "translation"
    sources: dict[str, PairSource] = sources_field()
    silos: list[str] = silos_field(DOMAINS, "domains")
    max_train: int = Field(0, ge=0, description="train pairs per domain, a fixed subsample (0 = all)")
    max_eval: int = Field(0, ge=0, description="dev/test pairs per domain, a fixed subsample (0 = all)")
    max_source_length: int = Field(128, gt=0, le=1024)
    max_target_length: int = Field(128, gt=0, le=1024)
    vocab_size: int = Field(8000, ge=16, le=2**18, description="joint German-English subword vocabulary")
    tokenizer_model: Literal["unigram", "bpe"] = "unigram"
    tokenizer_domain: str = Field("news", description="the generic engine's data, the only text the "
                                                      "tokenizer is fitted on")
    matrix: list[str] | None = Field(None, description="domains of the cross-domain test matrix (every model x "
                                                       "every domain); None: the five benchmark domains and the "
                                                       "run's own silos (only those if all are own), []: off")

    @model_validator(mode="after")
    def _known_names(self) -> "TranslationSettings":
        known = self.known_clients()
        if self.matrix is not None:
            check_names(self.matrix, known, "domain", "matrix", empty_ok=True, section=True)
        check_names([self.tokenizer_domain], known, "domain", "tokenizer_domain", section=True)
        return self

    def matrix_domains(self) -> list[str]:
        """The test matrix's domains: given, else the five benchmark domains and the run's own silos
        (only the own silos when the run has no benchmark silo: nothing of the benchmark is read)."""
        if self.matrix is not None:
            return list(self.matrix)
        own = [s for s in self.silos if self.own_source(s)]
        return own if len(own) == len(self.silos) else list(dict.fromkeys([*DOMAINS, *own]))

    def alone(self, silo: str) -> "TranslationSettings":
        """`silo` trained on its own, tested on the whole run's matrix: every silo's model on the same
        domains, the own silos too (its own default would be the benchmark's five, or `silo` alone)."""
        own = self.model_copy(update={"silos": [silo]})
        whole = self.matrix_domains()
        return own if own.matrix_domains() == whole else own.model_copy(update={"matrix": whole})

    def needed_silos(self) -> list[str]:
        return self.needed_domains()

    def for_silos(self, names: list[str]) -> "TranslationSettings":
        """A silo's machine holds its own domain only: no cross-domain matrix there."""
        return self.model_copy(update={"silos": list(names), "matrix": [],
                                       "sources": {k: v for k, v in self.sources.items() if k in names
                                                   or k == self.tokenizer_domain}})

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
    verify_data_dir([d for d in settings.needed_domains() if not settings.own_source(d)], data_dir)


def _tokenizer(settings: TranslationSettings, data_dir):
    from .task import task_tokenizer
    return task_tokenizer(settings, data_dir)


def _silo_files(settings: TranslationSettings, silo: str) -> list[str]:
    """A silo's own domain, and the generic engine's data its tokenizer is fitted on (public)."""
    from .data import required_files
    own = settings.for_silos([silo])
    return required_files([d for d in own.needed_domains() if not own.own_source(d)])


def _inspect(settings: TranslationSettings, silo: str, data_dir):
    from .data import inspect_silo
    return inspect_silo(settings, silo, data_dir)


TASKS.register("translation", TranslationSettings)(TaskPlugin(
    build=_build, spec=_spec, data="translation", verify=_verify, tokenizer=_tokenizer, silo_files=_silo_files,
    inspect=_inspect,
    default_model={"kind": "seq2seq", "name": "transformer"}))
