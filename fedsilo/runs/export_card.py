"""What `fedsilo export` tells about what it wrote: the one line of Python that loads it (printed by the
command, written in the model card, shown in docs/instruct.md) and the model card (README.md), in place of
peft's empty template.

The base of exported adapters is named so that the folder can move (`base_reference`): `--with-base`
names its own copy relatively ("base", which peft resolves from the current folder, so the loader passes
DIR/base explicitly); a local checkpoint is named by the run's `model.name` as its config writes it (a
built-in pretrained one by its converted folder's absolute path: its name is fedsilo's alone; a
relative path stays relative; a hub-style "owner/name" also finds the Hub's model); the absolute folder
at export time goes to fedsilo_export.json. A base built only in the run has no name at all.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from fedsilo.config import RunConfig
from fedsilo.models.pretrained import PRETRAINED, pretrained_folder
from fedsilo.recipe import model_config

__all__ = ["BaseReference", "base_reference", "auto_class", "loader", "model_card"]

_FORMS = {"adapters": "LoRA adapters in peft's format, over the base model",
          "merged": "The LoRA adapters merged into the base model (peft's merge_and_unload)",
          "full": "The whole model (full fine-tuning)"}


BUNDLED_BASE = "base"  # --with-base: the base's folder inside the export, as the adapter config names it


class BaseReference(NamedTuple):
    name: str | None  # the adapter config's base_model_name_or_path
    path: str | None  # the base's folder on this machine at export time, absolute
    bundled: bool = False  # the base is saved inside the export, under DIR/base (--with-base)


def base_reference(cfg: RunConfig, with_base: bool) -> BaseReference:
    """How exported adapters name their base (module docstring)."""
    mcfg = model_config(cfg)
    folder = None
    if mcfg.name is not None and not mcfg.init_from:  # init_from's tensors replaced the checkpoint's
        found = pretrained_folder(mcfg.name) if mcfg.name in PRETRAINED else Path(mcfg.name).expanduser()
        folder = str(found.resolve()) if found.is_dir() else None
    if with_base:
        return BaseReference(BUNDLED_BASE, folder, bundled=True)
    return BaseReference((folder if mcfg.name in PRETRAINED else mcfg.name) if folder else None, folder)


def auto_class(model) -> str:
    """The transformers Auto class that loads `model`'s architecture as this class (AutoModel otherwise)."""
    from transformers.models.auto import modeling_auto as auto

    kind = getattr(getattr(model, "config", None), "model_type", None)
    for name, mapping in (("AutoModelForCausalLM", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("AutoModelForSeq2SeqLM", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                          ("AutoModelForSequenceClassification", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)):
        if mapping.get(kind) == type(model).__name__:
            return name
    return "AutoModel"


def loader(form: str, auto: str, folder: str, base: BaseReference) -> str:
    """The Python expression (modules `peft`, `transformers`) that loads the export in `folder`."""
    if form != "adapters":
        return f"transformers.{auto}.from_pretrained({folder!r})"
    if auto == "AutoModelForCausalLM" and base.name is not None and not base.bundled:
        return f"peft.AutoPeftModelForCausalLM.from_pretrained({folder!r})"
    one_score = ", num_labels=1" if auto == "AutoModelForSequenceClassification" else ""  # fedsilo's cross-encoder
    where = f"{folder}/{BUNDLED_BASE}" if base.bundled else base.name
    built = "base_model" if where is None else f"transformers.{auto}.from_pretrained({where!r}{one_score})"
    return f"peft.PeftModel.from_pretrained({built}, {folder!r})"


def model_card(facts: dict, tokenizer: bool) -> str:
    """README.md: what the export is (`facts`: fedsilo_export.json's record) and the code that loads it."""
    form = facts["form"]
    library = "peft" if form == "adapters" else "transformers"
    rows = [("base model", _base_row(facts)), ("run", f"`{facts['run']}`"),
            ("round", f"round {facts['round']} (the run's best round on the dev split)"),
            ("model", _whose(facts)), ("task", facts["task"]), ("form", _form_row(facts))]
    code = ["import peft, transformers", "", f"model = {facts['loader']}"]
    if tokenizer:
        code.append(f"tokenizer = transformers.AutoTokenizer.from_pretrained({facts['folder']!r})")
    return "\n".join([
        # no `base_model:` metadata: the base is named by a folder, which the Hub would not accept as an id
        "---", f"library_name: {library}", "tags: [fedsilo, federated-learning]", "---", "",
        f"# {facts['name']}", "", f"{_FORMS[form]}, exported by `fedsilo export` from the run below.", "",
        "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
        "## Loading", "", "```python", *code, "```", "", _base_note(facts), "",
        "Paths are as `fedsilo export` was given them, relative to the folder it ran in. "
        "`fedsilo_export.json` holds the same facts for programs.", ""])


def _base_row(facts: dict) -> str:
    if facts["form"] != "adapters":
        return "inside this model" + (f" (it started from `{facts['base_path']}`)" if facts["base_path"] else "")
    if facts["base_bundled"]:
        return "`base/` in this folder" + (f" (a copy of `{facts['base_path']}`)" if facts["base_path"] else "")
    if facts["base"] is None:
        return "built in the run only (trained from scratch or from model.init_from's tensors)"
    return f"`{facts['base']}` (at export: `{facts['base_path']}`)"


def _whose(facts: dict) -> str:
    silos = ", ".join(facts["silos"])
    if facts["silo"] is None:
        return f"the global model of silos {silos}"
    if facts["alone"]:
        return f"the own model of silo {facts['silo']} (the run trained each of {silos} alone)"
    return f"the personal model of silo {facts['silo']} (its own tensors over the global model of silos {silos})"


def _form_row(facts: dict) -> str:
    if facts["form"] == "adapters":
        return f"adapters (LoRA, aggregation {facts['aggregation']})"
    return facts["form"] + (f" (LoRA aggregation {facts['aggregation']})" if facts["aggregation"] else "")


def _base_note(facts: dict) -> str:
    if facts["form"] != "adapters":
        return "The base model is inside this one: transformers loads it without peft."
    if facts["base_bundled"]:
        return ("The adapter config names its base relatively (`base_model_name_or_path = \"base\"`), so the "
                "folder can move: peft resolves that name from the current folder, so load as above (the base "
                "passed explicitly), or run `peft.AutoPeftModelForCausalLM.from_pretrained('.')` (causal) inside it.")
    if facts["base"] is None:
        return ("The base exists only in the run: export again with `--with-base`, or pass the model fedsilo "
                "builds from the run's config without the lora surgery as `base_model`.")
    return (f"The adapter config names its base as the run's config does (`{facts['base']}`): transformers finds "
            "it relative to the current folder, or on the Hugging Face Hub when that is a hub id and no such folder "
            f"exists. Elsewhere, pass the base explicitly: `peft.PeftModel.from_pretrained(base_model, "
            f"{facts['folder']!r})`.")
