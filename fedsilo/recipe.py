"""A validated config turned into the parts of a run, once, for every engine.

`build_recipe` resolves each policy the config names (Registry.resolve: the entry's implementation
with its options validated) into a frozen `Recipe`; the server, the aggregator, the exchange plan and
the clients hold those objects, never a name to look up again. The in-process engine, the Flower
ServerApp (model only: it never opens client data) and the Flower ClientApp (one silo's data) all
build through these functions, so they start from the same model, surgery, plan and policies.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsilo.client.hooks import AFTER_TRAINING, PSEUDO_SOURCES, ROUND_HOOKS
from fedsilo.client.batching import BATCH_ORDERS
from fedsilo.client.objective import CLIENT_OBJECTIVES, REGULARIZERS, Term
from fedsilo.client.optim import CLIENT_OPTIMIZERS
from fedsilo.client.policy import read_policy
from fedsilo.client.recipe import ClientRecipe
from fedsilo.client.schedule import LR_SCHEDULES
from fedsilo.client.settings import ClientConfig
from fedsilo.client.silo import SiloClient, federated_parameters, load_tensors
from fedsilo.client.store import ClientStore
from fedsilo.client.train import TrainingParts
from fedsilo.client.trainers import DPSGDTrainer, PlainTrainer
from fedsilo.config import RunConfig, saved_tokenizer
from fedsilo.config import TOKENIZER_DIR as _TOKENIZER_DIR
from fedsilo.core.aggregate import AGGREGATIONS
from fedsilo.core.compression import DOWNLOAD_CODECS, SEP
from fedsilo.core.exchange import DOWNLOADS, OVERWRITES, SELECTORS, ExchangePlan, matches
from fedsilo.core.lora import LORA_AGGREGATIONS
from fedsilo.core.rounds import Limits
from fedsilo.core.server_opt import ServerOptimizer
from fedsilo.core.transforms import SILO_CHECKS, UPLOAD_TRANSFORMS
from fedsilo.core.weighting import WEIGHTINGS
from fedsilo.errors import ConfigError
from fedsilo.features import RECIPE_CHECKS, ROUND_STAGES
from fedsilo.features.silo_dp import release as silo_dp_release
from fedsilo.models import MODEL_KINDS, SURGERIES
from fedsilo.models.lora import lora_settings
from fedsilo.models.precision import check_precision, set_tf32
from fedsilo.models.settings import reads_task_tokenizer
from fedsilo.privacy.ledger import PrivacyLedger, SiloLedger, data_scope, examples_scope
from fedsilo.privacy.secure_stages import SecureMask, secure_sum_round
from fedsilo.privacy.silo_dp import SiloRelease
from fedsilo.rundir.layout import init_tensors, tokenizer_identity
from fedsilo.server import Server, ServerRecipe, mean_round
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import PerExampleLoss
from fedsilo.tasks.tokens import default_cache_dir


@dataclass(frozen=True)
class Recipe:
    """A run's resolved parts: the server's and each participant's (a silo, or the pooled client)."""
    config: RunConfig
    server: ServerRecipe
    clients: dict[str, ClientRecipe]

    def client(self, name: str) -> ClientRecipe:
        return self.clients[name]

    @property
    def plan(self) -> ExchangePlan:
        return self.server.plan


def build_recipe(cfg: RunConfig, source: str = "config") -> Recipe:
    """Every policy the config names, resolved once; then every feature's check on the whole (a
    combination that cannot hold is one ConfigError naming its keys, after `source`)."""
    plan = exchange_plan(cfg)
    release = silo_dp_release(cfg)
    recipe = Recipe(cfg, server_recipe(cfg, plan),
                    {name: client_recipe(cfg, name, i, plan, release) for i, name in enumerate(member_names(cfg))})
    for check in RECIPE_CHECKS:
        problem = RECIPE_CHECKS.get(check)(recipe)
        if problem:
            raise ConfigError(f"{source}: {problem}")
    return recipe


def exchange_plan(cfg: RunConfig) -> ExchangePlan:
    """The config's exchange section; a LoRA head kept by each silo (`head = "private"`) is private."""
    x = cfg.exchange
    lora = lora_settings(cfg.model)
    private = tuple(x.private) + (("*.modules_to_save.*",) if lora and lora.head_private else ())
    return ExchangePlan(tuple(x.shared), private,
                        SELECTORS.resolve(x.upload, x.upload_options, "exchange.upload_options"),
                        DOWNLOADS.resolve(x.download), OVERWRITES.resolve(x.overwrite),
                        UPLOAD_TRANSFORMS.resolve_chain(x.upload_transforms, "exchange.upload_transforms"),
                        DOWNLOAD_CODECS.resolve_chain(x.download_transforms, "exchange.download_transforms"))


def server_recipe(cfg: RunConfig, plan: ExchangePlan) -> ServerRecipe:
    """The server's parts: optimiser, weighting, aggregation and its limits, and the stages around it
    (each registered ROUND_STAGES entry the config asks for; a stage may switch per-update limits off)."""
    s, f = cfg.server, cfg.federation
    weighting = WEIGHTINGS.resolve(f.weighting)
    limits = Limits(f.max_client_weight, _on(f.max_weight_ratio), f.clip_norm, _on(f.max_update_ratio),
                    _on(f.max_step_ratio))
    built = (ROUND_STAGES.get(name)(cfg, weighting) for name in ROUND_STAGES)
    stages = tuple(stage for stage in built if stage is not None)
    for stage in stages:
        limits = stage.limits(limits)
    return ServerRecipe(
        ServerOptimizer(s.optimizer, s.effective_lr, s.momentum, s.beta1, s.beta2, s.tau, v0=s.v0,
                        bias_correction=s.bias_correction),
        weighting, f.weighting_stat,
        AGGREGATIONS.resolve(f.aggregation, f.aggregation_options, "federation.aggregation_options"),
        limits, plan, secure_sum_round if f.secure_aggregation is not None else mean_round, stages,
        _merge_scaling(cfg))


def client_recipe(cfg: RunConfig, name: str, index: int, plan: ExchangePlan, release: SiloRelease | None
                  ) -> ClientRecipe:
    """One participant's parts (`name`: a silo, or "pooled")."""
    c = cfg.client_config(name) if name != "pooled" else cfg.client
    f = cfg.federation
    mask = None
    if f.secure_aggregation is not None:
        weighting = WEIGHTINGS.get(f.weighting)
        mask = SecureMask.factory(weighting, f.weighting_stat or weighting.reads, plan.upload_transforms)
    lora = lora_settings(cfg.model)
    return silo_recipe(c, plan, index, f.rounds, release=release, mask=mask, persist_optimizer=cfg.persist_optimizer,
                       token_cache=default_cache_dir() if cfg.engine.token_cache else None,
                       precision=cfg.model.precision, lora_rank=lora.ranks.get(name) if lora is not None else None)


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
    `model.init_from`'s tensors (a bare model's checkpoint loads before the surgery, a surgered one's after)."""
    mcfg = model_config(cfg)
    model, tokenizer = MODEL_KINDS.get(mcfg.kind)(mcfg, cfg.seed, task_tokenizer(cfg))
    # a tokenizer fitted here, not saved beside the checkpoint, is checked against it
    fitted = bool(mcfg.init_from) and saved_tokenizer(mcfg.init_from) is None and task_tokenizer(cfg) is not None \
        and reads_task_tokenizer(mcfg.kind, mcfg.name)
    identity = tokenizer_identity(tokenizer) if fitted else None
    base = None
    if mcfg.init_from and mcfg.surgeries:
        try:  # a bare model (a generic base) is what a surgery adapts: loaded before LoRA freezes and wraps its layers
            base = init_tensors(mcfg.init_from, federated_parameters(model), identity, mcfg)
            load_tensors(model, base)
        except ConfigError:
            base = None  # not the bare model's tensors (a LoRA run's adapters): loaded after the surgery
    for surgery in mcfg.surgeries:
        device = next(model.parameters()).device
        SURGERIES.get(surgery.name)(model, surgery.settings(), cfg.seed)
        model.to(device)
    if mcfg.init_from and base is None:
        load_tensors(model, init_tensors(mcfg.init_from, federated_parameters(model), identity, mcfg))
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


def check_plan(model: torch.nn.Module, plan: ExchangePlan) -> None:
    """Globs that match no tensor are a config mistake, not a silent no-op."""
    names = list(federated_parameters(model))
    clash = next((n for n in names if SEP in n), None)
    if clash is not None:  # the wire names a codec's side parts `<tensor>::<part>`
        raise ConfigError(f"model: the tensor name {clash!r} holds {SEP!r}, which the exchange's wire reserves "
                          "for a codec's parts; rename the module")
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
    return Server({k: params[k].detach() for k in shared}, recipe.server)


def _merge_scaling(cfg: RunConfig) -> float | None:
    """The exact LoRA merge's scaling alpha / rank (None: no merge)."""
    lora = lora_settings(cfg.model)
    return lora.scaling if lora is not None and LORA_AGGREGATIONS.get(lora.aggregation).merge else None


def _on(limit: float | str) -> float | None:
    """A safeguard's limit, None when the config says "off"."""
    return None if limit == "off" else limit


def member_names(cfg: RunConfig) -> list[str]:
    """The participants: every silo, or one pooled client when the paradigm pools them."""
    return ["pooled"] if cfg.participation.pools_silos else cfg.task.client_names()


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


def give_ledger(client: SiloClient, path: Path, run_key, scope: str | None = None,
                files: Mapping[str, Mapping] | None = None, one_operator: bool = False) -> None:
    """A silo whose updates are DP releases keeps its privacy ledger at `path` (fedsilo.privacy.ledger):
    `run_key` names this run (or a function giving it once the run exists); `scope`: whose budget, by
    default the data its operator gave it (`files`, as the data check fingerprinted them), else, for a
    task that names no files, its training examples; `one_operator`: the engine runs the server too
    (fedsilo.privacy.ledger.SiloLedger)."""
    if client.keeps_ledger:
        scope = scope or (data_scope(files) if files else examples_scope(client.examples))
        client.ledger = SiloLedger(PrivacyLedger(path), run_key, scope, client.name, one_operator)




def give_ledgers(clients: dict[str, SiloClient], folder: Path, run_key,
                 files: Mapping[str, Mapping[str, Mapping]] | None = None) -> None:
    """In-process: each silo's ledger is `folder/<silo>.jsonl` (the run directory's privacy-ledger/)."""
    for name, client in clients.items():
        give_ledger(client, Path(folder) / f"{name}.jsonl", run_key, files=(files or {}).get(name), one_operator=True)


def build_client(cfg: RunConfig, task, model, store: ClientStore, name: str, examples,
                 recipe: Recipe | None = None) -> SiloClient:
    """One participant over the working `model`, refused (ConfigError) when the task cannot serve what
    its recipe asks (a round hook's needs, DP-SGD's per-example losses, the objective)."""
    part = (recipe or build_recipe(cfg)).client(name)
    if not examples:
        raise ConfigError(f"client {name!r} has no training examples")
    c = part.settings
    needs = part.hook and part.hook.value.needs
    if needs and not isinstance(task, needs):
        raise ConfigError(f"client.before_training = {c.before_training!r}: the {task.name} task "
                          f"does not offer it ({needs.__name__})")
    if c.dp is not None and not isinstance(task, PerExampleLoss):
        why = getattr(task, "no_example_losses", "")  # a task may say why (a packed batch mixes examples)
        raise ConfigError(f"client.dp: the {task.name} task gives no per-example losses (example_losses, "
                          f"rows_per_example), which DP-SGD clips{why}")
    try:
        return SiloClient(name, task, examples, model, store, part)
    except TypeError as err:  # an objective the task cannot serve
        raise ConfigError(f"client.objective = {c.objective!r}: {err}") from None


def build_clients(cfg: RunConfig, task, model, store: ClientStore, recipe: Recipe | None = None
                  ) -> dict[str, SiloClient]:
    """Every participant over the one working `model` (members' order: the silo index of each)."""
    recipe = recipe or build_recipe(cfg)
    return {name: build_client(cfg, task, model, store, name, examples, recipe)
            for name, examples, _ in members(cfg, task)}


def store_root(run_path: Path) -> Path:
    return Path(run_path) / "clients"


def silo_recipe(settings: ClientConfig, plan: ExchangePlan | None = None, index: int = 0, rounds: int = 1,
                **parts) -> ClientRecipe:
    """A participant's parts from its [client] section alone (no run config): for driving a SiloClient
    directly (tests, benchmarks). `parts`: any other ClientRecipe field."""
    after = settings.after_pass()
    return ClientRecipe(
        index, settings, plan or ExchangePlan(), CLIENT_OBJECTIVES.get(settings.objective),
        (DPSGDTrainer if settings.dp is not None else PlainTrainer)(training_parts(settings)),
        SILO_CHECKS.resolve_chain(settings.upload_checks, "upload_checks"),
        ROUND_HOOKS.resolve(settings.before_training, settings.hook_options, "hook_options")
        if settings.before_training else None,
        PSEUDO_SOURCES.resolve(settings.pseudo_source),
        AFTER_TRAINING.resolve(*after, where="after_training_options") if after else None,
        rounds=rounds, **parts)


def training_parts(settings: ClientConfig) -> TrainingParts:
    """The [client] section's optimiser, schedule, batch order and regularisers, looked up once."""
    return TrainingParts(CLIENT_OPTIMIZERS.get(settings.optimizer), LR_SCHEDULES.get(settings.lr_schedule),
                         BATCH_ORDERS.get(settings.batching),
                         tuple(Term(name, REGULARIZERS.get(name), coef) for name, coef in settings.regularizers.items()))
