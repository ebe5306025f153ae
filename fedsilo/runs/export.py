"""`fedsilo export RUN --out DIR`: a LoRA run's adapters in peft's own format (`adapter_config.json` +
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the base
model unchanged; `--silo NAME`: that silo's personal adapters (its private tensors over the global
ones).

The base is the model the run's config builds without the lora surgery (a pretrained checkpoint as it
is on disk; a model trained from scratch from the run's seed). `--with-base` saves it too (under
DIR/base, and the adapter config points to it). With the exact merge the adapters restart every round
and the federation's result is in the base weights: each merged ΔW = W − W₀ is written as a LoRA of
its numerical rank (an SVD; scaling 1), so peft adds it back exactly (to float rounding). Tensors that
are neither adapters nor the head (FedMatch patches) are not peft's: they go to DIR/fedsilo_extra.safetensors.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from fedsilo.client.silo import federated_parameters, load_tensors, received_only
from fedsilo.client.store import make_store
from fedsilo.config import load_config
from fedsilo.core.lora import LORA_AGGREGATIONS, pairs
from fedsilo.errors import ConfigError, RunDirError
from fedsilo.models.lora import LoraSettings, lora_settings
from fedsilo.recipe import build_model, exchange_plan, store_root
from fedsilo.rundir.layout import RunDir, config_hash

_PEFT = (".lora_", ".modules_to_save.")


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
    state = run.load(run.checkpoint)
    found = state.get("run_id") if isinstance(state, dict) else None
    return found if isinstance(found, str) and found else None


def _best(run: RunDir, cfg) -> dict:
    """best.pt, if it is this run's (its run id and config hash) and holds only finite tensors: an export
    carries no model that resume would refuse."""
    if not run.best.is_file():
        raise ConfigError(f"{run.path}: no best.pt (the run has no evaluated round yet)")
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
                          "nothing exported")
    if state.get("config") != config_hash(cfg):
        raise RunDirError(f"{run.best} was trained under another config than {run.config}; nothing exported")
    _finite(state["server"]["params"], run.best)
    return state


def _finite(tensors: dict, source: Path) -> None:
    """Every tensor a tensor and finite, else RunDirError naming `source` and the tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise RunDirError(f"{source}: {name!r} is not a tensor; nothing exported")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise RunDirError(f"{source}: tensor {name!r} holds {bad} NaN/Inf values; nothing exported")


def _fits(tensors: dict, params: dict, source: Path) -> None:
    """Each tensor shaped as the model's (a best.pt of another model size is named, not a traceback)."""
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise RunDirError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, the model's is "
                              f"{tuple(params[name].shape)}; nothing exported")


def _silo_tensors(run: RunDir, state: dict, silo: str) -> dict[str, torch.Tensor]:
    """The silo's kept tensors at the best round (its private ones, or its whole model when it keeps one)."""
    clients = state.get("clients", {}).get("store")
    if clients is None or clients.get("kind") == "flower":
        raise ConfigError(f"--silo {silo}: the run's silos kept their state on their own machines; export there")
    store = make_store(clients["kind"], store_root(run.path), run.run_id)
    store.load_state_dict(clients)
    kept = store.get(silo)
    if kept is None:
        raise ConfigError(f"--silo {silo}: no state of {silo!r} in {run.path} (not a silo of this run, or it "
                          "never trained)")
    own = kept.slot("own")
    _finite(own, store_root(run.path) / silo if clients["kind"] == "disk" else run.best)
    return own


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


def export_adapters(run_dir: str | Path, out: str | Path, silo: str | None = None,
                    with_base: bool = False) -> tuple[Path, list[str]]:
    """Write the run's (or `silo`'s) adapters to `out` in peft's format; returns (`out`, the silo's own
    tensors that replaced global ones)."""
    from peft import LoraConfig, get_peft_model

    run = RunDir(run_dir)
    if not run.config.is_file():
        raise ConfigError(f"{run.path}: no config.toml (not a run directory)")
    cfg = load_config(run.config)
    lora = lora_settings(cfg.model)
    if lora is None:
        raise ConfigError(f"{run.path}: the run has no lora surgery (model.surgery), so it has no adapters to export")
    state = _best(run, cfg)
    model, tokenizer = build_model(cfg)
    params = federated_parameters(model)
    shared = {k: v for k, v in state["server"]["params"].items() if k in params}
    _fits(shared, params, run.best)
    load_tensors(model, shared)
    personal: list[str] = []
    if silo is not None:
        own = {k: v for k, v in _silo_tensors(run, state, silo).items() if k in params}
        _fits(own, params, run.path / "clients" / silo)
        load_tensors(model, own)
        personal = sorted(own)
    base, _ = build_model(_without_lora(cfg))
    merged = LORA_AGGREGATIONS.get(lora.aggregation).merge
    factors = _merged_as_lora(model, base) if merged else {}
    ranks = {module: b.shape[1] for module, (b, _) in factors.items()}
    head = [n.split(".modules_to_save.")[0] for n in params if ".modules_to_save." in n]
    adapters = pairs(n for n, _ in model.named_parameters())  # ffa's A is frozen, so not among `params`
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules=sorted({p.module.rsplit(".", 1)[-1] for p in adapters}),
                        modules_to_save=sorted(set(head)) or None,
                        rank_pattern=dict(ranks), alpha_pattern=dict(ranks))  # scaling 1 for a merged ΔW
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if with_base:  # before peft injects its layers into it
        base.save_pretrained(out / "base")
        if tokenizer is not None:
            tokenizer.save_pretrained(out / "base")
    with warnings.catch_warnings():  # peft's note that it renames the (unnamed) base; transformers' deprecations
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(base, config)
    if with_base:
        peft_model.peft_config["default"].base_model_name_or_path = str((out / "base").resolve())
    target = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".modules_to_save." in name or (".lora_" in name and not merged):  # merged: the factors below
                target["base_model.model." + name].copy_(t)
        for module, (b, a) in factors.items():
            target[f"base_model.model.{module}.lora_A.default.weight"].copy_(a)
            target[f"base_model.model.{module}.lora_B.default.weight"].copy_(b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(out)
    frozen_sent = set(received_only(model))  # exact's merged base weights: already in the factors
    extra = {k: t.detach().contiguous() for k, t in params.items()
             if not any(s in k for s in _PEFT) and k not in frozen_sent}
    if extra:
        save_file(extra, out / "fedsilo_extra.safetensors")
    (out / "fedsilo_export.json").write_text(json.dumps(
        {"run": str(run.path), "round": state.get("round"), "silo": silo, "aggregation": lora.aggregation,
         "private": list(exchange_plan(cfg).private), "personal_tensors": personal}, indent=1) + "\n")
    return out, personal
