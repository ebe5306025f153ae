"""The multitask catalogue as a markdown table: every converted task with its group, metric, pools,
few-shot sizes (seed 100, CrossFit's k) and licence, read from the real sources.

    python bench/multitask_catalog.py [--data ../shared/data/multitask] > /tmp/catalog.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fedsilo.runs.tables import markdown_table
from fedsilo.tasks.multitask.catalog import CATALOG
from fedsilo.tasks.multitask.fewshot import K_PER_CLASS, K_TOTAL, sample_seeds
from fedsilo.tasks.multitask.pin import needed_files  # noqa: F401  (loads the converters)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multitask"))
    args = ap.parse_args()
    needed_files()
    rows = [["task", "group", "metric", "k", "pools train / test", "few-shot train / dev / test", "in paper",
             "licence", "how the pools were made"]]
    names = sorted((n for n in CATALOG if CATALOG.get(n).module.startswith("fedsilo.tasks.multitask.converters")),
                   key=lambda n: (CATALOG.get(n).group, n))
    for name in names:
        info = CATALOG.get(name)
        pools = info.convert(Path(args.data))
        k = K_PER_CLASS if info.per_class else K_TOTAL
        shots = sample_seeds(pools, info.per_class, k, [100])
        rows.append([name, info.group, info.metric, f"{k}{' per class' if info.per_class else ''}",
                     f"{len(pools.train)} / {len(pools.test)}",
                     f"{len(shots.train)} / {len(shots.dev)} / {len(shots.test)}", "yes" if info.in_paper else "no",
                     info.license, pools.note or "the source's own splits"])
    print(markdown_table(rows))
    print(f"\n{len(names)} tasks; {sum(CATALOG.get(n).in_paper for n in names)} of them among the paper's.")


if __name__ == "__main__":
    main()
