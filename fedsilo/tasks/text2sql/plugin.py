"""text2sql's registration: its config section and a lazy builder (no model code imported here)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from fedsilo.sources.settings import Roles, SourceSettings
from fedsilo.tasks import TASKS, SiloTaskSettings, TaskPlugin, silos_field, sources_field

SILOS = ("advising", "atis", "geography", "restaurants", "scholar", "academic", "imdb", "yelp")
DISPLAY = {
    "advising": "Advising", "atis": "ATIS", "geography": "GeoQuery", "restaurants": "Restaurants",
    "scholar": "Scholar", "academic": "Academic", "imdb": "IMDB", "yelp": "Yelp",
}


class SQLSource(SourceSettings):
    """An own text-to-SQL silo: (question, SQL) rows, with the database's schema (the model reads
    "question | table: column, ... | ...") from a schema file or from the SQLite database, which
    also gives execution match when present."""
    ROLES: ClassVar[Roles] = Roles(("question", "sql"), key="question", aliases=(
        ("question", ("utterance", "nl", "text", "query_text", "input")),
        ("sql", ("query", "gold", "sql_query", "target", "output"))))
    schema_file: str | None = Field(
        None, description="the schema: a CSV of 'Table Name, Field Name' rows (the benchmark's "
                                          "NAME-schema.csv) or SQL CREATE TABLE statements (.sql); default: read "
                                          "from the database")
    database: str | None = Field(None, description="a SQLite file the gold SQL runs on: execution match, and the "
                                                   "schema when no schema file is given")

    @model_validator(mode="after")
    def _has_schema(self) -> "SQLSource":
        if not self.is_benchmark and not (self.schema_file or self.database):
            raise ValueError("give schema_file (a schema CSV or .sql file) or database (a SQLite file): the model reads "
                             "each question with the schema")
        return self


class Text2SQLSettings(SiloTaskSettings):
    SOURCE: ClassVar[type[SourceSettings]] = SQLSource
    BENCHMARK: ClassVar[tuple[str, ...]] = SILOS
    DISPLAY: ClassVar[dict[str, str]] = DISPLAY

    name: Literal["text2sql"] = "text2sql"
    sources: dict[str, SQLSource] = sources_field("files, format, fields, splits and schema")
    silos: list[str] = silos_field(SILOS, "silos")
    train_fraction: float = Field(1.0, gt=0, le=1, description="keep this share of each silo's train set")
    min_train: int = Field(0, ge=0, description="but at least this many (a small-scale study keeps small silos)")
    max_train: int = Field(0, ge=0, description="cap on train examples per silo (0 = all)")
    max_eval: int = Field(0, ge=0, description="cap on dev/test examples per silo (0 = all)")
    max_source_length: int = Field(256, gt=0)
    max_target_length: int = Field(128, gt=0)
    exec_accuracy: bool = True


def _build(settings: Text2SQLSettings, tokenizer, data_dir):
    from .task import Text2SQLTask
    return Text2SQLTask(settings, tokenizer, data_dir)


def _spec():
    from .task import SPEC
    return SPEC


def _verify(settings: Text2SQLSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir(settings, data_dir)


def _silo_files(settings: Text2SQLSettings, silo: str) -> list[str]:
    from .data import EXEC_DB
    if settings.own_source(silo):
        return []
    return [f"{silo}.json", f"{silo}-schema.csv"] + ([EXEC_DB[silo]] if silo in EXEC_DB else [])


def _inspect(settings: Text2SQLSettings, silo: str, data_dir):
    from .data import inspect_silo
    return inspect_silo(settings, silo, data_dir)


TASKS.register("text2sql", Text2SQLSettings)(TaskPlugin(
    build=_build, spec=_spec, data="text2sql", default_model={"kind": "seq2seq", "name": "tiny-t5"},
    verify=_verify, silo_files=_silo_files, inspect=_inspect))
