"""Four tiny multitask tasks in the catalogue, read from files a test writes, and a config over them
with a tiny T5: the FewFedWeight machinery end to end in seconds, without the benchmark data."""
import random
from pathlib import Path

from fedsilo.tasks.multitask.catalog import CATALOG, Pools, Record, register

TOY = ("toy-sentiment", "toy-parity", "toy-copy", "toy-count")
_WORDS = "good bad fine awful great poor nice grim".split()


def _read(root: Path, name: str) -> Pools:
    parts = {}
    for split in ("train", "test"):
        lines = (Path(root) / "toy" / f"{name}-{split}.tsv").read_text().splitlines()
        parts[split] = [Record(a, tuple(b.split("|"))) for a, b in (line.split("\t") for line in lines)]
    return Pools(parts["train"], parts["test"])


def _register() -> None:
    if "toy-sentiment" in CATALOG:
        return
    for name, per_class, metric, group in (("toy-sentiment", True, "acc", "classification"),
                                           ("toy-parity", True, "macro_f1", "classification"),
                                           ("toy-copy", False, "rouge_l", "generation"),
                                           ("toy-count", False, "em", "qa")):
        register(name, group=group, metric=metric, per_class=per_class, in_paper=False, license="test data",
                 files=(f"toy/{name}-train.tsv", f"toy/{name}-test.tsv"))(lambda root, n=name: _read(root, n))


_register()


def _example(name: str, rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 5))]
    if name == "toy-sentiment":
        pos = sum(w in ("good", "fine", "great", "nice") for w in words)
        return " ".join(words), "positive" if 2 * pos >= len(words) else "negative"
    if name == "toy-parity":
        return " ".join(words), "even" if len(words) % 2 == 0 else "odd"
    if name == "toy-copy":
        return " ".join(words), " ".join(reversed(words))
    return " ".join(words), f"{len(words)}|{['zero', 'one', 'two', 'three', 'four', 'five'][len(words)]}"


def write_data(root: Path, n: int = 60) -> Path:
    rng = random.Random(7)
    (root / "toy").mkdir(parents=True, exist_ok=True)
    for name in TOY:
        for split, size in (("train", n), ("test", n // 2)):
            rows = [_example(name, rng) for _ in range(size)]
            (root / "toy" / f"{name}-{split}.tsv").write_text("".join(f"{split} {i}: {a}\t{b}\n"
                                                                      for i, (a, b) in enumerate(rows)))
    return root


def config(root: Path, **sections) -> dict:
    """2 clients × 2 tasks × 2 rounds, tiny T5, FedAvg; `sections` update the sections."""
    cfg = {
        "plugins": ["tests.mtoy"], "name": "mt", "seed": 1,
        "task": {"name": "multitask", "data_dir": str(root), "tasks": list(TOY), "clients": 2,
                 "k_per_class": 4, "k_total": 6, "max_source_length": 24, "max_target_length": 8,
                 "eval_batch_size": 8},
        "model": {"kind": "seq2seq", "name": "tiny-t5", "d_model": 32, "d_ff": 64, "num_layers": 1,
                  "num_decoder_layers": 1, "num_heads": 2, "dropout": 0.0},
        "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 4, "logging_steps": 1},
        "federation": {"rounds": 2},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


FEWFEDWEIGHT = {
    "client": {"before_training": "pseudo_labels", "hook_options": {"weighting": "energy", "top_k": 7},
               "regularizers": {"personal": 0.01}, "tracked_terms": ["annotated", "pseudo"]},
    "exchange": {"overwrite": "none"},
    "federation": {"weighting": "loss"},
}
