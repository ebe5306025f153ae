"""A validated config turned into the parts of a run, once, for every engine.

`build_recipe` resolves each policy the config names (Registry.resolve: the entry's implementation
with its options validated) into a frozen `Recipe`; the server, the aggregator, the exchange plan and
the clients hold those objects, never a name to look up again. The in-process engine, the Flower
ServerApp (model only: it never opens client data) and the Flower ClientApp (one silo's data) all
build through these functions, so they start from the same model, surgery, plan and policies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsilo.client.hooks import ROUND_HOOKS
from fedsilo.client.policy import read_policy
from fedsilo.client.silo import SiloClient, federated_parameters, load_tensors
from fedsilo.client.store import ClientStore
from fedsilo.config import RunConfig, saved_tokenizer
from fedsilo.config import TOKENIZER_DIR as _TOKENIZER_DIR
from fedsilo.core.aggregate import AGGREGATIONS, Aggregation
from fedsilo.core.compression import DOWNLOAD_CODECS
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS, ExchangePlan, matches
from fedsilo.core.lora import LORA_AGGREGATIONS
from fedsilo.core.masking import Layout
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.tensors import Tensors
from fedsilo.core.transforms import UPLOAD_TRANSFORMS
from fedsilo.core.weighting import WEIGHTINGS, WeightingPolicy
from fedsilo.errors import ConfigError
from fedsilo.models import MODEL_KINDS, SURGERIES
from fedsilo.models.lora import lora_settings
from fedsilo.models.precision import check_precision, set_tf32
from fedsilo.privacy.accountant import Budget, noise_for
from fedsilo.privacy.silo_dp import SiloDP
from fedsilo.registry import Policy
from fedsilo.rundir.layout import init_tensors
from fedsilo.server import Server
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import PerExampleLoss
from fedsilo.tasks.tokens import default_cache_dir


@dataclass(frozen=True)
class Recipe:
    """The run's federation policies, resolved once from its config."""
    plan: ExchangePlan                      # shared/private globs; upload selector, download, overwrite
    weighting: Policy[WeightingPolicy]
    statistic: str | None                   # what the weighting reads (None: the policy's default)
    aggregation: Policy[Aggregation]


def build_recipe(cfg: RunConfig) -> Recipe:
    f = cfg.federation
    return Recipe(exchange_plan(cfg), WEIGHTINGS.resolve(f.weighting), f.weighting_stat,
                  AGGREGATIONS.resolve(f.aggregation, f.aggregation_options, "federation.aggregation_options"))


def exchange_plan(cfg: RunConfig) -> ExchangePlan:
    """The config's exchange section; a LoRA head kept by each silo (`head = "private"`) is private."""
    x = cfg.exchange
    lora = lora_settings(cfg.model)
    private = tuple(x.private) + (("*.modules_to_save.*",) if lora and lora.head == "private" else ())
    return ExchangePlan(tuple(x.shared), private,
                        SELECTORS.resolve(x.upload, x.upload_options, "exchange.upload_options"),
                        DOWNLOADS.resolve(x.download), OVERWRITES.resolve(x.overwrite),
                        UPLOAD_TRANSFORMS.resolve_chain(x.upload_transforms, "exchange.upload_transforms"),
                        DOWNLOAD_CODECS.resolve_chain(x.download_transforms, "exchange.download_transforms"))


def model_config(cfg: RunConfig):
    """The model section with the task's defaults filled in (kind, name)."""
    defaults = TASKS.get(cfg.task.name).default_model
    update = {k: v for k, v in defaults.items() if getattr(cfg.model, k) is None}
    return cfg.model.model_copy(update=update)


TOKENIZER_DIR = _TOKENIZER_DIR  # in a run directory: the task tokenizer its model was trained with


def task_tokenizer(cfg: RunConfig):
    """A zero-argument function giving the task's own tokenizer (None when the task has none): the
    one saved beside `model.init_from`'s checkpoint when there is one (a model keeps the vocabulary
    it was trained with, whatever the data or library versions here; the config's tokenizer keys are
    then that tokenizer's, fedsilo.config.tokenizer_fill), else the task's."""
    plugin = TASKS.get(cfg.task.name)
    if plugin.tokenizer is None:
        return None

    def make():
        saved = saved_tokenizer(cfg.model.init_from)
        if saved is not None:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(str(saved))
        return plugin.tokenizer(cfg.task, plugin.data_dir(cfg.task))
    return make


def build_model(cfg: RunConfig) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer): the model kind's builder, then the optional surgery, both seeded, then
    `model.init_from`'s tensors."""
    mcfg = model_config(cfg)
    model, tokenizer = MODEL_KINDS.get(mcfg.kind)(mcfg, cfg.seed, task_tokenizer(cfg))
    for surgery in mcfg.surgeries:
        device = next(model.parameters()).device
        SURGERIES.get(surgery.name)(model, surgery.settings(), cfg.seed)
        model.to(device)
    if mcfg.init_from:
        load_tensors(model, init_tensors(mcfg.init_from, federated_parameters(model)))
    device = next(model.parameters()).device
    check_precision(mcfg.precision, device)
    set_tf32(device, mcfg.tf32)
    model.eval()
    return model, tokenizer


def build_task(cfg: RunConfig, tokenizer, clients: list[str] | None = None):
    """The task over the config's clients (or only `clients`: a Flower silo loads its own data)."""
    plugin = TASKS.get(cfg.task.name)
    settings = cfg.task
    if clients is not None:
        settings = settings.for_silos(clients)
    return plugin.build(settings, tokenizer, plugin.data_dir(settings))


def initial_private(model: torch.nn.Module, plan: ExchangePlan) -> Tensors:
    """Initial values of the private tensors: one copy, the start of every client."""
    params = federated_parameters(model)
    _, private = plan.split(params)
    return {k: params[k].detach().clone() for k in private}


def check_plan(model: torch.nn.Module, plan: ExchangePlan) -> None:
    """Globs that match no tensor are a config mistake, not a silent no-op."""
    names = list(federated_parameters(model))
    for key, patterns in (("exchange.shared", plan.shared), ("exchange.private", plan.private)):
        for p in patterns:
            if not any(matches(n, [p]) for n in names):
                raise ConfigError(f"{key}: {p!r} matches no tensor of the model (e.g. {names[0]!r})")
    if not plan.split(names)[0]:
        raise ConfigError("exchange: no tensor is shared (every tensor is private)")


def build_server(cfg: RunConfig, model: torch.nn.Module, recipe: Recipe | None = None) -> Server:
    """The server over the model's shared tensors, as the recipe's exchange plan splits them."""
    recipe = recipe or build_recipe(cfg)
    check_plan(model, recipe.plan)
    params = federated_parameters(model)
    shared, _ = recipe.plan.split(params)
    s = cfg.server
    opt = ServerOptimizer(s.optimizer, s.effective_lr, s.momentum, s.beta1, s.beta2, s.tau, v0=s.v0,
                          bias_correction=s.bias_correction)
    f = cfg.federation
    dp = None
    if f.silo_dp is not None:
        sigma, clip, _ = silo_dp_plan(cfg)
        dp = SiloDP(f.silo_dp.mode, clip, sigma, Budget(sigma, 1.0, f.silo_dp.delta, f.silo_dp.target_epsilon),
                    seed=cfg.seed if f.silo_dp.noise == "seeded" else None)
    return Server({k: params[k].detach() for k in shared}, opt, recipe.weighting, recipe.plan, recipe.statistic,
                  aggregation=recipe.aggregation, max_client_weight=f.max_client_weight,
                  max_weight_ratio=_on(f.max_weight_ratio), clip_norm=f.clip_norm,
                  max_update_ratio=_on(f.max_update_ratio), max_step_ratio=_on(f.max_step_ratio), silo_dp=dp,
                  lora_merge=_merge_scaling(cfg))


def _merge_scaling(cfg: RunConfig) -> float | None:
    """The exact LoRA merge's scaling alpha / rank (None: no merge)."""
    lora = lora_settings(cfg.model)
    return lora.scaling if lora is not None and LORA_AGGREGATIONS.get(lora.aggregation).merge else None


def silo_dp_plan(cfg: RunConfig) -> tuple[float, float, float]:
    """(σ, C, the noise std each silo adds: σ·C/√m in distributed mode for m silos a round, else 0)."""
    dp, f = cfg.federation.silo_dp, cfg.federation
    sigma = dp.noise_multiplier or noise_for(dp.target_epsilon, dp.delta, 1.0, f.rounds)
    return sigma, dp.clip, (sigma * dp.clip / math.sqrt(cfg.silos_per_round) if dp.mode == "distributed" else 0.0)


def _on(limit: float | str) -> float | None:
    """A safeguard's limit, None when the config says "off"."""
    return None if limit == "off" else limit


def members(cfg: RunConfig, task) -> list[tuple[str, list, object]]:
    """(name, training examples, client config) per participant; one pooled client when centralized."""
    if cfg.participation.pools_silos:
        return [("pooled", [e for c in task.clients for e in task.examples(c, "train")], cfg.client)]
    return [(c, task.examples(c, "train"), cfg.client_config(c)) for c in task.clients]


def give_policies(clients: dict[str, SiloClient], policies: dict[str, str]) -> None:
    """Each named silo checks every round against its own policy file (fedsilo.client.policy)."""
    unknown = sorted(set(policies) - set(clients))
    if unknown:
        raise ConfigError(f"--policy {unknown[0]}=…: {unknown[0]!r} is not a silo of this run ({', '.join(clients)})")
    for silo, path in policies.items():
        clients[silo].policy = read_policy(path)


def secure_upload(cfg: RunConfig, model, plan: ExchangePlan) -> tuple | None:
    """What a silo needs to build its masked vector: the layout of the shared tensors, the weighting
    policy and the statistic it reads (None without secure aggregation)."""
    if cfg.federation.secure_aggregation is None:
        return None
    policy = WEIGHTINGS.get(cfg.federation.weighting)
    shared, _ = plan.split(federated_parameters(model))
    like = dict(model.named_parameters())
    return Layout.of(like, shared, policy), policy, cfg.federation.weighting_stat or policy.reads


def build_client(cfg: RunConfig, task, model, store: ClientStore, name: str, index: int, examples,
                 client_cfg, initial: Tensors, plan: ExchangePlan | None = None) -> SiloClient:
    if not examples:
        raise ConfigError(f"client {name!r} has no training examples")
    needs = client_cfg.before_training and ROUND_HOOKS.get(client_cfg.before_training).needs
    if needs and not isinstance(task, needs):
        raise ConfigError(f"client.before_training = {client_cfg.before_training!r}: the {task.name} task "
                          f"does not offer it ({needs.__name__})")
    if client_cfg.dp is not None and not isinstance(task, PerExampleLoss):
        raise ConfigError(f"client.dp: the {task.name} task gives no per-example losses (example_losses, "
                          "rows_per_example), which DP-SGD clips")
    try:
        plan = plan or exchange_plan(cfg)
        return SiloClient(name, index, examples, task, client_cfg, model, plan, store, initial,
                          persist_optimizer=cfg.persist_optimizer,
                          token_cache=default_cache_dir() if cfg.engine.token_cache else None,
                          precision=cfg.model.precision, rounds=cfg.federation.rounds,
                          secure=secure_upload(cfg, model, plan),
                          silo_clip=silo_dp_plan(cfg)[1:] if cfg.federation.silo_dp is not None else None,
                          seeded_noise=cfg.federation.silo_dp is not None and cfg.federation.silo_dp.noise == "seeded",
                          lora_rank=_lora_rank(cfg, name))
    except TypeError as err:  # an objective the task cannot serve
        raise ConfigError(f"client.objective = {client_cfg.objective!r}: {err}") from None


def _lora_rank(cfg: RunConfig, silo: str) -> int | None:
    """The silo's own LoRA rank when it trains below the layers' rank."""
    lora = lora_settings(cfg.model)
    return lora.ranks.get(silo) if lora is not None else None


def build_clients(cfg: RunConfig, task, model, store: ClientStore, initial: Tensors | None = None,
                  plan: ExchangePlan | None = None) -> dict[str, SiloClient]:
    """Every participant over the one working `model` (members' order: the silo index of each),
    sharing one exchange plan and one copy of the `initial` private tensors (taken from the model
    when not given)."""
    plan = plan or exchange_plan(cfg)
    if initial is None:
        initial = initial_private(model, plan)
    return {name: build_client(cfg, task, model, store, name, i, examples, ccfg, initial, plan)
            for i, (name, examples, ccfg) in enumerate(members(cfg, task))}


def store_root(run_path: Path) -> Path:
    return Path(run_path) / "clients"
