"""`fedsilo export RUN --out DIR`: a run's best model in Hugging Face's formats.

- A LoRA run's adapters in peft's own format (`adapter_config.json` + `adapter_model.safetensors`),
  which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model unchanged; for a causal
  model the config carries task_type "CAUSAL_LM", so `peft.AutoPeftModelForCausalLM.from_pretrained(DIR)`
  loads it alone (the base from `base_model_name_or_path`, the tokenizer from DIR).
- `--merged`: one full model (peft's merge_and_unload) + tokenizer, which transformers' Auto classes
  load without peft. A run without the lora surgery (full fine-tuning) is always exported so.
- `--silo NAME`: that silo's personal model (its private tensors over the global ones). A `finetune`
  run trained each silo alone, in a run directory of its own (RUN/silos/NAME/): `--silo NAME` is that
  run's model, and without it there is no one model to export.

--out is written whole or not at all, and a folder that holds files is replaced only with --force
(fedsilo.runs.export_folder); README.md is a model card with the line of Python that loads the export,
the one the command prints (fedsilo.runs.export_card, which also says how the base is named portably).

The base is the model the run's config builds without the lora surgery (a pretrained checkpoint as it
is on disk, then `base_model_name_or_path` is the config's `model.name`; a model trained from scratch
from the run's seed). `--with-base` saves it too (under DIR/base, and the adapter config names it
"base"). A QLoRA run's base is its fp32 checkpoint: the export is the adapters over full-precision
weights, as merging them into 4-bit weights would round the update away. With the exact merge the adapters restart every round
and the federation's result is in the base weights: each merged ΔW = W − W₀ is written as a LoRA of
its numerical rank (an SVD; scaling 1), so peft adds it back exactly (to float rounding). Tensors that
are neither adapters nor the head (FedMatch patches) are not peft's: they go to DIR/fedsilo_extra.safetensors,
and a full model cannot hold them (--merged refuses such a run).

`load_trained` is what export and `fedsilo generate` share: best.pt, checked to be this run's and to
hold the model's tensors (`tensor_problem`: names, shapes, dtypes, finite, as resume checks it), loaded
into the model the run's config builds.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from fedsilo.client.silo import federated_parameters, load_tensors, received_only
from fedsilo.client.store import make_store
from fedsilo.config import RunConfig, load_config
from fedsilo.core.lora import LORA_AGGREGATIONS, pairs
from fedsilo.errors import ConfigError, RunDirError
from fedsilo.fileio import regular_file
from fedsilo.models.lora import LoraSettings, lora_settings
from fedsilo.recipe import build_model, exchange_plan, store_root
from fedsilo.rundir.layout import RunDir, config_hash
from fedsilo.rundir.tensor_check import tensor_problem

from .export_card import BUNDLED_BASE, BaseReference, auto_class, base_reference, loader, model_card
from .export_folder import check_out, written_whole

__all__ = ["Trained", "Exported", "run_config", "load_trained", "export_run", "export_adapters"]

_PEFT = (".lora_", ".modules_to_save.")
EXPORTED = "nothing exported"


class Trained(NamedTuple):
    """A run's best model as its config builds it, with best.pt's (and a silo's own) tensors in it."""
    run: RunDir
    cfg: RunConfig
    state: dict            # best.pt
    model: torch.nn.Module
    tokenizer: object
    personal: list[str]    # the silo's own tensors that replaced global ones
    alone: tuple[str, ...] = ()  # a finetune run's silos, each trained alone (the whole model is the silo's own)


class Exported(NamedTuple):
    """What `export_run` wrote."""
    folder: Path
    form: str              # "adapters", "merged" or "full"
    personal: list[str]    # the silo's own tensors that replaced global ones
    alone: bool            # the silo trained alone (a finetune run)
    loader: str            # the Python expression that loads it (also in its README.md)


def run_config(run_dir: str | Path) -> tuple[RunDir, RunConfig]:
    run = RunDir(run_dir)
    if not run.config.is_file():
        raise ConfigError(f"{run.path}: no config.toml (not a run directory)")
    return run, load_config(run.config)


def load_trained(run_dir: str | Path, silo: str | None = None, fp32: bool = False,
                 outcome: str = EXPORTED) -> Trained:
    """The run's best model (`silo`'s personal one; a finetune run's silo's own); `fp32`: without the
    config's quantization (the export's base). Any check that fails raises one line ending in `outcome`."""
    run, cfg = run_config(run_dir)
    if cfg.participation.per_silo_runs:
        return _trained_alone(run, cfg, silo, fp32, outcome)
    state = _best(run, cfg, outcome)
    built = _fp32(cfg) if fp32 else cfg
    model, tokenizer = build_model(built)
    params = federated_parameters(model)
    shared, _ = exchange_plan(cfg).split(params)  # the server's tensors: the private ones stay with the silos
    _check(state["server"]["params"], {k: params[k] for k in shared}, run.best, outcome)
    load_tensors(model, state["server"]["params"])
    personal: list[str] = []
    if silo is not None:
        own, source = _silo_tensors(run, state, silo)
        _check(own, params, source, outcome, partial=True)  # its private tensors, or its whole model
        load_tensors(model, own)
        personal = sorted(own)
    return Trained(run, built, state, model, tokenizer, personal)


def _trained_alone(run: RunDir, cfg: RunConfig, silo: str | None, fp32: bool, outcome: str) -> Trained:
    """A finetune run's silo: the best model of its own run directory, RUN/silos/NAME."""
    silos = cfg.task.client_names()
    if silo is None:
        raise ConfigError(f"{run.path}: the run trained each silo alone (paradigm {cfg.paradigm!r}), so each of "
                          f"{', '.join(silos)} has its own model (under silos/NAME/) and there is no one model: "
                          f"pass --silo NAME; {outcome}")
    if silo not in silos:
        raise ConfigError(f"--silo {silo}: not a silo of {run.path} (its silos: {', '.join(silos)}); {outcome}")
    own = silo if exchange_plan(cfg).private else None  # its private tensors are in its own run's store
    return load_trained(run.path / "silos" / silo, own, fp32, outcome)._replace(alone=tuple(silos))


def _fp32(cfg: RunConfig) -> RunConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantization": None})})


def _without_lora(cfg):
    kept = [s for s in cfg.model.surgeries if not isinstance(s.settings(), LoraSettings)]
    surgery = None if not kept else kept if len(kept) > 1 else kept[0]
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"surgery": surgery})})


def _run_id(run: RunDir) -> str | None:
    """This run's id as the run directory keeps it (OUT/run_id, else its checkpoint.pt's: the resume's
    rule), read without writing anything; never best.pt's own, which is what is checked."""
    path = run.path / "run_id"
    if path.is_file():
        return path.read_text().strip() or None
    if os.path.lexists(run.checkpoint):
        regular_file(run.checkpoint, "checkpoint.pt", RunDirError)  # a FIFO would block torch.load for ever
    state = run.load(run.checkpoint)
    found = state.get("run_id") if isinstance(state, dict) else None
    return found if isinstance(found, str) and found else None


def _best(run: RunDir, cfg, outcome: str) -> dict:
    """best.pt, if it is this run's (its run id and config hash); its tensors are checked against the model
    (`_check`): an export carries no model that resume would refuse."""
    if not os.path.lexists(run.best):
        raise ConfigError(f"{run.path}: no best.pt (the run has no evaluated round yet)")
    regular_file(run.best, "best.pt", RunDirError)
    state = run.load(run.best)
    if not isinstance(state, dict) or not isinstance(state.get("server"), dict) \
            or not isinstance(state["server"].get("params"), dict):
        raise RunDirError(f"{run.best}: not a fedsilo checkpoint")
    ours = _run_id(run)
    if ours is None:
        raise RunDirError(f"{run.best}: cannot be checked against this run: {run.path} has neither run_id nor "
                          "checkpoint.pt")
    if state.get("run_id") != ours:
        raise RunDirError(f"{run.best} belongs to another run (run id {state.get('run_id')}, this run is {ours}); "
                          f"{outcome}")
    if state.get("config") != config_hash(cfg):
        raise RunDirError(f"{run.best} was trained under another config than {run.config}; {outcome}")
    return state


def _check(tensors: dict, params: dict, source: Path, outcome: str, partial: bool = False) -> None:
    """RunDirError naming `source` and the tensor when `tensors` are not the model's (resume's check)."""
    problem = tensor_problem(tensors, params, partial)
    if problem is not None:
        raise RunDirError(f"{source}: {problem}; {outcome}")


def _silo_tensors(run: RunDir, state: dict, silo: str) -> tuple[dict[str, torch.Tensor], Path]:
    """The silo's kept tensors at the best round (its private ones, or its whole model when it keeps one),
    and where they were read."""
    clients = state.get("clients", {}).get("store")
    if clients is None or clients.get("kind") == "flower":
        raise ConfigError(f"--silo {silo}: the run's silos kept their state on their own machines; use it there")
    store = make_store(clients["kind"], store_root(run.path), run.run_id)
    store.load_state_dict(clients)
    kept = store.get(silo)
    if kept is None:
        raise ConfigError(f"--silo {silo}: no state of {silo!r} in {run.path} (not a silo of this run, or it "
                          "never trained)")
    return kept.slot("own"), store_root(run.path) / silo if clients["kind"] == "disk" else run.best


def _merged_as_lora(model, base) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each merged base weight's change W − W₀ as (B, A) of its numerical rank, B·A = ΔW."""
    now, before = dict(model.named_parameters()), dict(base.named_parameters())
    out = {}
    for p in pairs(now):
        delta = (now[p.base].detach().double() - before[p.module + ".weight"].detach().double())
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        keep = max(1, int((s > s[0] * 1e-7).sum())) if s.numel() and s[0] > 0 else 1
        root = s[:keep].sqrt()
        out[p.module] = ((u[:, :keep] * root).float(), (root[:, None] * vh[:keep]).float())
    return out


class _Peft(NamedTuple):
    model: torch.nn.Module          # a peft model over the base, holding the run's adapters and head
    base: torch.nn.Module           # its base (peft's layers injected in place)
    extra: dict[str, torch.Tensor]  # tensors peft does not know (FedMatch patches)
    aggregation: str


def _as_peft(trained: Trained, lora: LoraSettings, before_wrap=None) -> _Peft:
    """The trained model as peft's own model over a fresh base; `before_wrap(base)` sees the base
    before peft injects its layers into it."""
    from peft import LoraConfig, get_peft_model

    model, cfg = trained.model, trained.cfg
    params = federated_parameters(model)
    base, _ = build_model(_without_lora(cfg))
    merged = LORA_AGGREGATIONS.get(lora.aggregation).merge
    factors = _merged_as_lora(model, base) if merged else {}
    ranks = {module: b.shape[1] for module, (b, _) in factors.items()}
    head = [n.split(".modules_to_save.")[0] for n in params if ".modules_to_save." in n]
    adapters = pairs(n for n, _ in model.named_parameters())  # ffa's A is frozen, so not among `params`
    causal = auto_class(model) == "AutoModelForCausalLM"  # peft's CAUSAL_LM: AutoPeftModelForCausalLM insists
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules=sorted({p.module.rsplit(".", 1)[-1] for p in adapters}),
                        modules_to_save=sorted(set(head)) or None, task_type="CAUSAL_LM" if causal else None,
                        rank_pattern=dict(ranks), alpha_pattern=dict(ranks))  # scaling 1 for a merged ΔW
    if before_wrap is not None:
        before_wrap(base)
    with warnings.catch_warnings():  # peft's note that it renames the (unnamed) base; transformers' deprecations
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(base, config)
    target = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".modules_to_save." in name or (".lora_" in name and not merged):  # merged: the factors below
                target["base_model.model." + name].copy_(t)
        for module, (b, a) in factors.items():
            target[f"base_model.model.{module}.lora_A.default.weight"].copy_(a)
            target[f"base_model.model.{module}.lora_B.default.weight"].copy_(b)
    frozen_sent = set(received_only(model))  # exact's merged base weights: already in the factors
    extra = {k: t.detach().contiguous() for k, t in params.items()
             if not any(s in k for s in _PEFT) and k not in frozen_sent}
    return _Peft(peft_model, base, extra, lora.aggregation)


def export_run(run_dir: str | Path, out: str | Path, silo: str | None = None, with_base: bool = False,
               merged: bool = False, force: bool = False) -> Exported:
    """`fedsilo export`: the adapters, or the whole model when `merged` or the run has no lora surgery,
    written whole into `out` (an `out` that holds files is replaced only when `force`)."""
    run, cfg = run_config(run_dir)
    out = Path(out)
    lora = lora_settings(cfg.model)
    form = "adapters" if lora is not None and not merged else "merged" if lora is not None else "full"
    if with_base and form != "adapters":
        raise ConfigError(f"--with-base: a {form} model holds its base weights already (a run "
                          f"{'with' if lora else 'without'} the lora surgery); leave --with-base out")
    others = [s.name for s in cfg.model.surgeries if not isinstance(s.settings(), LoraSettings)]
    if form != "adapters" and others:
        raise ConfigError(f"{run.path}: the model has the {', '.join(others)} surgery, whose tensors no Hugging Face "
                          "model holds; export the adapters (without --merged)")
    check_out(out, run.path, force)
    trained = load_trained(run_dir, silo, fp32=True)
    base = base_reference(trained.cfg, with_base)
    with written_whole(out) as folder:
        if form == "adapters":
            auto = _write_adapters(trained, lora, folder, base, with_base)
        else:
            auto = _write_model(trained, lora, folder)
        load = loader(form, auto, str(out), base)
        facts = _facts(trained, silo, form, lora, base, load, str(out))
        (folder / "README.md").write_text(model_card(facts, trained.tokenizer is not None))
        _record(folder, facts)
    return Exported(out, form, trained.personal, bool(trained.alone), load)


def export_adapters(run_dir: str | Path, out: str | Path, silo: str | None = None, with_base: bool = False,
                    force: bool = False) -> Exported:
    """`export_run` of the adapters, refusing a run that has none."""
    run, cfg = run_config(run_dir)
    if lora_settings(cfg.model) is None:
        raise ConfigError(f"{run.path}: the run has no lora surgery (model.surgery), so it has no adapters to "
                          "export; export its whole model with --merged")
    return export_run(run_dir, out, silo, with_base, merged=False, force=force)


def _write_adapters(trained: Trained, lora: LoraSettings, folder: Path, base: BaseReference, with_base: bool) -> str:
    """The adapters and the tokenizer in peft's format (and the base under base/); returns the base's Auto class."""
    def save_base(model) -> None:  # before peft injects its layers into it
        if with_base:
            _save_model(model, trained.tokenizer, folder / BUNDLED_BASE)

    peft = _as_peft(trained, lora, save_base)
    peft.model.peft_config["default"].base_model_name_or_path = base.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.model.save_pretrained(folder)
    if trained.tokenizer is not None:  # AutoPeftModel reads it (to size the embeddings)
        trained.tokenizer.save_pretrained(folder)
    if peft.extra:
        save_file(peft.extra, folder / "fedsilo_extra.safetensors")
    return auto_class(peft.base)  # peft injects its layers in place: the base keeps its class


def _write_model(trained: Trained, lora: LoraSettings | None, folder: Path) -> str:
    """The whole model (a LoRA run's adapters merged into the base) and its tokenizer; returns its Auto class."""
    model = trained.model
    if lora is not None:
        peft = _as_peft(trained, lora)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.model.merge_and_unload()
    if not hasattr(model, "save_pretrained"):
        raise ConfigError(f"{trained.run.path}: the run's model ({type(model).__name__}) is not a Hugging Face "
                          f"model; {EXPORTED}")
    _save_model(model, trained.tokenizer, folder)
    return auto_class(model)


def _facts(trained: Trained, silo: str | None, form: str, lora: LoraSettings | None, base: BaseReference,
           load: str, folder: str) -> dict:
    """fedsilo_export.json's record, which the model card tells in words."""
    silos = list(trained.alone or trained.cfg.task.client_names())  # a finetune run's silo's run has it alone
    return {"name": trained.cfg.name, "run": str(trained.run.path), "round": trained.state.get("round"),
            "silo": silo, "alone": bool(trained.alone), "silos": silos, "task": trained.cfg.task.name, "form": form,
            "aggregation": lora.aggregation if lora else None, "base": base.name, "base_path": base.path,
            "base_bundled": base.bundled,
            "private": list(exchange_plan(trained.cfg).private), "personal_tensors": trained.personal,
            "folder": folder, "loader": load}


def _record(folder: Path, facts: dict) -> None:
    (folder / "fedsilo_export.json").write_text(json.dumps(facts, indent=1) + "\n")


def _save_model(model, tokenizer, folder: Path) -> None:
    """save_pretrained of the model and its tokenizer. A trained LM head is its own tensor: untied
    from the embeddings, else saving keeps one of the two and loading ties them again."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embeddings is not None and head.weight is not embeddings.weight:
        model.config.tie_word_embeddings = False
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
