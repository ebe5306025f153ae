"""multitask's registration: its config section and a lazy builder (no model code imported here)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from fedsilo.settings import SectionError
from fedsilo.sources.settings import Roles, SourceSettings
from fedsilo.tasks import TASKS, TaskPlugin, TaskSettings, check_names, check_sources


class TextTaskSource(SourceSettings):
    """An own multitask silo: one client holding one text-to-text task of its own, (input, output)
    rows used as given (no few-shot resampling); a JSONL output may list several references. The
    task is named after the silo (its inputs read "NAME: input") and scored with `metric`."""
    ROLES: ClassVar[Roles] = Roles(("input", "output"), key="input", lists=("output",), aliases=(
        ("input", ("source", "text", "question", "prompt", "src")),
        ("output", ("target", "label", "answer", "outputs", "labels", "tgt"))))
    metric: Literal["acc", "em", "qa_f1", "macro_f1", "rouge_l", "mcc"] = Field(
        "em", description="how predictions are scored (CrossFit's metrics): acc, em, qa_f1, macro_f1 "
                          "(classification), rouge_l (generation), mcc")


def _catalog() -> list[str]:
    from .catalog import CATALOG
    from .converters import load_all
    load_all()
    return list(CATALOG)


class MultitaskSettings(TaskSettings):
    SOURCE: ClassVar[type[SourceSettings]] = TextTaskSource
    name: Literal["multitask"] = "multitask"
    tasks: list[str] | None = Field(None, description="CrossFit task names; None: every converted task "
                                                      "that is among the paper's")
    clients: int = Field(4, gt=0, le=1000, description="institutions the tasks are dealt to")
    tasks_per_client: int | None = Field(None, gt=0, description="keep this many tasks per client "
                                                                 "(the paper's Table 3: 5); None: all, dealt evenly")
    assignment: Literal["random", "paper"] = Field(
        "random", description="random: shuffled with assignment_seed and dealt round-robin; paper: Table 5's "
                              "clients (4), restricted to `tasks`")
    assignment_seed: int = 0
    sample_seeds: list[int] = Field(default_factory=lambda: [100], min_length=1,
                                    description="few-shot sampling seeds (CrossFit: 100, 13, 21, 42, 87); "
                                                "several: their samples together form each split")
    k_per_class: int = Field(16, gt=0, description="few-shot examples per class (classification)")
    k_total: int = Field(32, gt=0, description="few-shot examples per task (other tasks)")
    silos: list[str] | None = Field(None, description="the clients this run (or machine) holds; None: all "
                                                      "(with [task.sources]: the own silos)")
    sources: dict[str, TextTaskSource] = Field(
        default_factory=dict, description="own silos by name, each a client holding one task of its own: files, "
                                          "format, fields, splits, metric (docs/your-data.md)")
    max_source_length: int = Field(256, gt=0, le=4096)
    max_target_length: int = Field(64, gt=0, le=4096)
    rouge: Literal["crossfit", "google"] = Field(
        "crossfit", description="ROUGE-L scorer: crossfit (the `rouge` package CrossFit's evaluation calls, "
                                "comparable with the paper) or google (`rouge-score`); docs/multitask.md")

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, v: list[str] | None) -> list[str] | None:
        return v if v is None else check_names(v, _catalog(), "multitask task", "tasks")

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: dict[str, TextTaskSource]) -> dict[str, TextTaskSource]:
        if any(s.is_benchmark for s in v.values()):
            raise SectionError("task.sources: multitask's benchmark clients are dealt CrossFit tasks (clients, tasks, "
                             "assignment), not named sources; format = \"benchmark\" does not apply")
        taken = [n for n in v if n in set(_catalog()) or n.startswith("client_")]
        if taken:
            raise SectionError(f"task.sources.{taken[0]}: the name of a CrossFit task or a dealt client (client_N); "
                             "give your silo another name")
        return check_sources(v, ())

    @model_validator(mode="after")
    def _known_silos(self) -> "MultitaskSettings":
        if self.silos is not None:
            check_names(self.silos, self.known_clients(), "client", "silos", section=True)
        if self.assignment == "paper" and self.clients != 4:
            raise ValueError("assignment 'paper' is the paper's 4 clients: set clients = 4")
        return self

    def task_names(self) -> list[str]:
        if self.tasks is not None:
            return list(self.tasks)
        from .data import paper_tasks
        return paper_tasks()

    def assignment_map(self) -> dict[str, list[str]]:
        """Every client's tasks (all clients: a sub-run or a silo's machine sees the same deal)."""
        from .data import assign
        dealt = assign(self.task_names(), self.clients, self.assignment_seed, self.tasks_per_client,
                       self.assignment)
        return {**dealt, **{name: [name] for name in self.sources}}

    def client_names(self) -> list[str]:
        return list(self.silos) if self.silos is not None else self.known_clients()

    def known_clients(self) -> list[str]:
        return [f"client_{i + 1}" for i in range(self.clients)] + list(self.sources)

    def for_silos(self, names: list[str]) -> "MultitaskSettings":
        return self.model_copy(update={"silos": list(names),
                                       "sources": {k: v for k, v in self.sources.items() if k in names}})


def _build(settings: MultitaskSettings, tokenizer, data_dir):
    from .task import MultitaskTask
    return MultitaskTask(settings, tokenizer, data_dir)


def _spec():
    from .metrics import SPEC
    return SPEC


def _needed(settings: MultitaskSettings) -> list[str]:
    """The CrossFit tasks whose files this config reads (own silos read their own)."""
    tasks = settings.assignment_map()
    return [t for c in settings.client_names() if not settings.own_source(c) for t in tasks[c]]


def _verify(settings: MultitaskSettings, data_dir) -> None:
    from .data import verify_data_dir
    verify_data_dir(_needed(settings), data_dir)


def _silo_files(settings: MultitaskSettings, silo: str) -> list[str]:
    from .data import task_files
    return [] if settings.own_source(silo) else task_files(settings.assignment_map()[silo])


def _inspect(settings: MultitaskSettings, silo: str, data_dir):
    from .data import inspect_silo
    return inspect_silo(settings, silo, data_dir)


TASKS.register("multitask", MultitaskSettings)(TaskPlugin(
    build=_build, spec=_spec, data="multitask", verify=_verify, silo_files=_silo_files, inspect=_inspect,
    default_model={"kind": "seq2seq", "name": "minilm2bert"}))
