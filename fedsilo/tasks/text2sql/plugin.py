"""text2sql's registration: its config section and a lazy builder (no model code imported here)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedsilo.tasks import TASKS, TaskPlugin, TaskSettings, check_names

SILOS = ("advising", "atis", "geography", "restaurants", "scholar", "academic", "imdb", "yelp")


class Text2SQLSettings(TaskSettings):
    name: Literal["text2sql"] = "text2sql"
    silos: list[str] = Field(default_factory=lambda: list(SILOS))
    train_fraction: float = Field(1.0, gt=0, le=1, description="keep this share of each silo's train set")
    min_train: int = Field(0, ge=0, description="but at least this many (a small-scale study keeps small silos)")
    max_train: int = Field(0, ge=0, description="cap on train examples per silo (0 = all)")
    max_eval: int = Field(0, ge=0, description="cap on dev/test examples per silo (0 = all)")
    max_source_length: int = Field(256, gt=0)
    max_target_length: int = Field(128, gt=0)
    exec_accuracy: bool = True

    @field_validator("silos")
    @classmethod
    def _known_silos(cls, v: list[str]) -> list[str]:
        return check_names(v, SILOS)

    def client_names(self) -> list[str]:
        return list(self.silos)

    def known_clients(self) -> list[str]:
        return list(SILOS)


def _build(settings: Text2SQLSettings, tokenizer, data_dir):
    from .task import Text2SQLTask
    return Text2SQLTask(settings, tokenizer, data_dir)


def _spec():
    from .task import SPEC
    return SPEC


def _verify(settings: Text2SQLSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir(settings, data_dir)


TASKS.register("text2sql", Text2SQLSettings)(TaskPlugin(
    build=_build, spec=_spec, data="text2sql", default_model={"kind": "seq2seq", "name": "tiny-t5"},
    verify=_verify))
