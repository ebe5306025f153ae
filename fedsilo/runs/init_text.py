"""The config `fedsilo init` drafts, as text: one silo's guess, the TOML it renders to, each task's
starting settings, and the write that loads it as a run would first, so init never leaves a file a
run cannot parse. What goes into a guess is read from the files by fedsilo.runs.init."""
from __future__ import annotations

import datetime
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fedsilo.config import locate_files, validate
from fedsilo.errors import ConfigError
from fedsilo.fileio import atomic_write_bytes


@dataclass
class Guess:
    """One silo's entry as detected: config lines, what the user must decide, and the files of its
    folder it does not read (name, why)."""
    name: str
    entry: dict = field(default_factory=dict)
    comments: dict[str, str] = field(default_factory=dict)  # key → comment after it
    decide: list[str] = field(default_factory=list)
    unused: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Draft:
    """The config text, each silo's guess, and the entries of DATA_DIR that are no silo (name, why)."""
    text: str
    guesses: list[Guess]
    unused: list[tuple[str, str]]


def write_config(draft: Draft, out: Path) -> str | None:
    """Write `draft` to `out` after loading it as a run would (TOML, then the config's validation),
    atomically. A config that does not parse, or does not validate with nothing left to DECIDE, is
    refused and nothing is written; else the reason it is not valid yet (DECIDE lines), or None."""
    try:
        raw = tomllib.loads(draft.text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{out}: fedsilo init made a config that is not valid TOML ({err}); nothing written. "
                          "Please report it with the folder's file names") from None
    note = None
    try:
        validate(locate_files(raw, out.parent.resolve()), str(out))
    except ConfigError as err:
        if not any(g.decide for g in draft.guesses):  # nothing left to the user: it should have been valid
            raise
        note = str(err)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, draft.text.encode())
    return note



def _toml(value) -> str:
    if isinstance(value, str):
        plain = json.dumps(value, ensure_ascii=False)
        return plain if plain.isprintable() else json.dumps(value)  # a lone surrogate: escaped, then refused
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


_TASK_LINES = {
    "translation": ['tokenizer_domain = "news"  # DECIDE: the subword vocabulary is fitted on this silo\'s training text '
                    'only: "news" (public WMT text, fetched with `fedsilo data translation`), or one of your silos '
                    '(its vocabulary is then shared with every silo); with model.init_from (below), the one its '
                    'run was fitted with'],
    "matching": ["# negatives = 5          # BM25-mined wrong answers per question, for silos without labels"],
    "text2sql": ["# max_target_length = 128  # SQL tokens (+ EOS); `fedsilo data check` says how many fit"],
    "multitask": [],
    "instruct": ["max_length = 512  # prompt + response tokens; longer records are cut (said in the run): "
                 "`fedsilo data check` says how many",
                 '# truncation = "prompt_start"  # cut a long prompt\'s start, not the end, so the response survives',
                 'template = "auto"  # the tokenizer\'s chat template where it '
                 'has one (a local checkpoint\'s), else the plain template (docs/instruct.md)',
                 'tokenizer_silo = "news"  # the built-in tiny-llama\'s tokenizer is fitted on this public text '
                 '(fetched once, into the data cache; FEDSILO_DATA_MIRROR: a local copy), never on your silos'],
}

_MODEL = {  # a task whose default model a user most often replaces with their own, or starts from a base
    "translation": ["[model]  # DECIDE: trained from scratch on your silos, or (the recipe of docs/translation.md) "
                    "started from a generic engine trained first on public news: `fedsilo data translation`, "
                    "`fedsilo run ~/fedsilo/experiments/nmt/generic.toml --out runs/generic`, then uncomment init_from "
                    "(docs/your-data.md, section \"Translation silos\", walks it)",
                    'name = "transformer"  # the sizes are experiments/nmt/generic.toml\'s: its weights fit them',
                    "d_model = 64", "d_ff = 256", "num_heads = 4", "num_layers = 3", "num_decoder_layers = 3",
                    '# init_from = "runs/generic"  # the generic engine\'s run (relative to where fedsilo runs): every '
                    "silo starts from it, with its tokenizer", ""],
    "instruct": ["[model]  # DECIDE: the built-in tiny-llama trained from scratch on your silos, or (docs/instruct.md, "
                 "\"Models\") started from a generic base trained first on public news: `fedsilo run "
                 "~/fedsilo/experiments/instruct/generic.toml --out runs/generic`, then uncomment init_from; or a "
                 "local AutoModelForCausalLM folder with its tokenizer (name; remove the sizes)",
                 'kind = "causal"',
                 "d_model = 128  # the sizes are experiments/instruct/generic.toml's: its weights fit them",
                 "d_ff = 384", "num_layers = 2", "num_heads = 4",
                 '# init_from = "runs/generic"  # the generic base\'s run (relative to where fedsilo runs): every '
                 "silo starts from it, with its tokenizer",
                 '# name = "/models/SmolLM2-135M-Instruct"', "",
                 "# [model.surgery]  # LoRA: only the adapters train and travel", '# name = "lora"',
                 "# options = {rank = 8, alpha = 16}", ""],
}


def _comment(text: str) -> str:
    """`text` as one TOML comment's text: a file name may hold a line break or a control character."""
    return "".join(c if c.isprintable() or c == "\t" else "?" for c in text)


def render(task: str, data_dir: Path, guesses: list[Guess], unused: list[tuple[str, str]], name: str) -> str:
    """The config's text; `name`: the experiment's (the config file's stem), which titles every run's table."""
    when = datetime.date.today().isoformat()
    out = [_comment(f"# Written by `fedsilo init {data_dir} --task {task}` on {when}: one silo per entry of "
                    f"{data_dir}."),
           "# Paths are relative to this file's folder. Lines marked DECIDE need your choice.",
           "# Next: `fedsilo data check THIS.toml` (every row checked), then `fedsilo run THIS.toml`.",
           "# docs/your-data.md explains every key.",
           *[_comment(f"# not used: {name} ({why})") for name, why in unused],
           f"name = {_toml(name)}  # the experiment's name, this file's: it titles every run's table", "",
           "[task]", f"name = {_toml(task)}",
           f"silos = {_toml([g.name for g in guesses])}  # add benchmark silos by name to mix them in",
           *_TASK_LINES.get(task, []), ""]
    for g in guesses:
        out.append(f"[task.sources.{g.name}]")
        for d in g.decide:
            out.append(_comment(f"# DECIDE: {d}"))
        out += [_comment(f"# not used: {name} ({why})") for name, why in g.unused]
        for key, value in g.entry.items():
            comment = f"  # {g.comments[key]}" if key in g.comments else ""
            out.append(f"{key} = {_toml(value)}{comment}")
        out += [f"# {text}" for key, text in g.comments.items() if key not in g.entry]
        if task == "multitask":
            out.append('metric = "em"  # DECIDE: acc or macro_f1 (labels), em or qa_f1 (short answers), '
                       'rouge_l (generation), mcc')
        if "display" not in g.entry:
            out.append("# display = \"...\"  # the silo's name in tables")
        out.append("")
    out += [*_MODEL.get(task, []), "[federation]", "rounds = 3", "", *_CLIENT.get(task, ["[client]"]), "",
            *_EXCHANGE.get(task, [])]
    return "\n".join(out)


# Each task's client settings as its CPU-scale study ran them (a start, not a tuned choice for your data).
_CLIENT = {
    "matching": ["[client]  # as docs/qa-study.md's runs (MiniLM cross-encoder); tune lr on your dev split",
                 'optimizer = "adamw"', "lr = 5e-4", 'lr_schedule = "linear"  # warm-up, then linear decay to 0 ...',
                 "warmup = 0.1", 'schedule_span = "run"  # ... over the whole run', "batch_size = 8", "epochs = 1"],
    "translation": ["[client]  # as docs/nmt-study.md's federated runs (experiments/nmt/fedavg.toml)",
                    'optimizer = "adamw"',
                    "lr = 1e-3", "batch_size = 32", "steps = 40  # optimiser steps per round"],
    "multitask": ["[client]  # as experiments/multitask/study.toml (minilm2bert)", 'optimizer = "adamw"',
                  "lr = 1e-4", "batch_size = 8", "epochs = 1"],
    "instruct": ["[client]  # a start for the built-in tiny-llama on a CPU; tune lr on your dev split (the loss)",
                 'optimizer = "adamw"', "lr = 1e-3", "batch_size = 8", "steps = 20  # optimiser steps per round"],
    "text2sql": ["[client]  # as experiments/lorar/small.toml (the Lorar paper: Adafactor)", 'optimizer = "adafactor"',
                 "lr = 3e-3", "epochs = 2", "batch_size = 8"],
}

_EXCHANGE = {  # what a task's paper exchanges, to uncomment
    "translation": ["# [exchange]  # Dynamic Pulling (docs/translation.md): each silo uploads the tensors that changed "
                    "least since its previous round, half of its parameters; the rest stays its own",
                    '# upload = "dp_l"', '# overwrite = "uploaded"', ""],
}
