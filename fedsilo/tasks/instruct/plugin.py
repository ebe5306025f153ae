"""instruct's registration: its config section, a lazy builder and its tokenizer (no model code here).

Instruction tuning of a decoder language model (`model.kind = "causal"`): each silo holds
instruction/response records (Alpaca-style rows or chat `messages`); the loss covers the response
tokens only. The benchmark's silos are GSM8K (maths), PubMedQA PQA-L (biomedical yes/no/maybe) and
Code Alpaca (code), and `news`: public English text that no silo owns, on which the small built-in
decoder is pre-trained as a generic base (and its byte-level tokenizer fitted).
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from fedsilo.tasks import TASKS, SiloTaskSettings, TaskPlugin, check_names, silos_field, sources_field

from .source import InstructSource

BENCHMARK = ("gsm8k", "pubmedqa", "codealpaca", "news")
INSTRUCTION_SILOS = BENCHMARK[:3]  # the default run: the three institutions (news is the generic base's text)
DISPLAY = {"gsm8k": "GSM8K", "pubmedqa": "PubMedQA", "codealpaca": "Code Alpaca", "news": "News (generic)"}
MAX_NEW_TOKENS = 8192  # the most new tokens greedy generation is asked for (task.max_new_tokens, generate)


class InstructSettings(SiloTaskSettings):
    SOURCE: ClassVar[type] = InstructSource
    BENCHMARK: ClassVar[tuple[str, ...]] = BENCHMARK
    DISPLAY: ClassVar[dict[str, str]] = DISPLAY
    tokenizer_keys: ClassVar[tuple[str, ...]] = ("vocab_size", "tokenizer_silo")

    name: Literal["instruct"] = "instruct"
    sources: dict[str, InstructSource] = sources_field()
    silos: list[str] = silos_field(INSTRUCTION_SILOS, "silos (gsm8k, pubmedqa, codealpaca; news: public text)")
    max_train: int = Field(0, ge=0, description="training records per silo, a fixed subsample (0 = all)")
    max_eval: int = Field(0, ge=0, description="dev/test records per silo, a fixed subsample (0 = all)")
    max_length: int = Field(512, gt=0, le=2**17, description="prompt + response tokens; longer records are cut "
                                                            "(see truncation; counted and reported, never silent)")
    truncation: Literal["end", "prompt_start"] = Field(
        "end", description="a record longer than max_length: end = keep its first max_length tokens (trl's "
                           "default); prompt_start = cut the prompt's start so the response survives")
    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="auto: the tokenizer's chat template where it has one, else the plain template "
                            "(docs/instruct.md); chat / plain: that one")
    packing: bool = Field(False, description="pack each training batch's records into as few sequences of "
                                             "max_length as fit (each record attends to itself only)")
    max_new_tokens: int = Field(256, gt=0, le=MAX_NEW_TOKENS, description="greedy generation length for scores "
                                                                          "read from generated text (GSM8K's "
                                                                          "final number)")
    max_prompt_length: int = Field(512, gt=0, le=2**17, description="prompt tokens greedy generation reads (apart "
                                                                    "from max_length); a longer prompt loses its "
                                                                    "start, counted and reported")
    generate_on: Literal["test", "all"] = Field(
        "test", description="where answers are generated and scored (GSM8K exact match): the final test only "
                            "(dev evaluations, which select the model, use the loss), or every evaluation")
    vocab_size: int = Field(8000, ge=260, le=2**18, description="the built-in decoder's byte-level BPE "
                                                                "vocabulary, fitted on `tokenizer_silo` only")
    tokenizer_silo: str = Field("news", description="the public text the built-in tokenizer is fitted on")

    @model_validator(mode="after")
    def _tokenizer_silo_known(self) -> "InstructSettings":
        check_names([self.tokenizer_silo], self.known_clients(), "silo", "tokenizer_silo", section=True)
        return self

    def needed_silos(self) -> list[str]:
        """The run's silos and the tokenizer's public text (read only when the model fits its tokenizer)."""
        return list(dict.fromkeys([*self.silos, self.tokenizer_silo]))

    def for_silos(self, names: list[str]) -> "InstructSettings":
        return self.model_copy(update={"silos": list(names),
                                       "sources": {k: v for k, v in self.sources.items() if k in names
                                                   or k == self.tokenizer_silo}})


def _build(settings: InstructSettings, tokenizer, data_dir):
    from .task import build_task
    return build_task(settings, tokenizer, data_dir)


def _spec():
    from .metrics import SPEC
    return SPEC


def _verify(settings: InstructSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir([s for s in settings.needed_silos() if not settings.own_source(s)], data_dir)


def _tokenizer(settings: InstructSettings, data_dir):
    from .task import task_tokenizer
    return task_tokenizer(settings, data_dir)


def _silo_files(settings: InstructSettings, silo: str) -> list[str]:
    """A silo's own files, and the public text its tokenizer is fitted on."""
    from .data import required_files
    own = settings.for_silos([silo])
    return required_files([s for s in own.needed_silos() if not own.own_source(s)])


def _fetch_files(settings: InstructSettings) -> list[str]:
    from .data import fetch_files
    return fetch_files([s for s in settings.needed_silos() if not settings.own_source(s)])


def _inspect(settings: InstructSettings, silo: str, data_dir):
    from .data import inspect_silo
    return inspect_silo(settings, silo, data_dir)


TASKS.register("instruct", InstructSettings)(TaskPlugin(
    build=_build, spec=_spec, data="instruct", verify=_verify, tokenizer=_tokenizer, silo_files=_silo_files,
    inspect=_inspect, fetch_files=_fetch_files, default_model={"kind": "causal", "name": "tiny-llama"}))
