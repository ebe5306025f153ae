"""Does initialising the encoder from pretrained MiniLM-L6 help? (issue: "try it and report")

Trains the same federation twice — `tiny-t5` from scratch vs `minilm2bert` (pretrained MiniLM-L6
encoder + a small random BERT decoder, same WordPiece vocabulary) — with identical data, rounds and
client settings, and reports dev loss per round, test EM/loss and wall time side by side.

    python bench/encoder_init.py --out runs/encoder-init --doc docs/encoder-init.md
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

from fedsilo.config import load_config
from fedsilo.runs.runner import run_experiment
from fedsilo.runs.tables import markdown_table

MODELS = ["tiny-t5", "minilm2bert"]
SCALE = ["task.silos=['geography', 'restaurants', 'scholar', 'yelp']", "task.train_fraction=1.0",
         "task.min_train=0", "task.max_train=48", "task.max_eval=16",
         "federation.rounds=4", "federation.eval_every=1", "federation.weighting=lorar",
         "server.optimizer=sgdm", "client.lr=1e-3"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/lorar/bench.toml")
    ap.add_argument("--out", default="runs/encoder-init")
    ap.add_argument("--doc", default="docs/encoder-init.md")
    args = ap.parse_args()
    results, seconds, dev = {}, {}, {}
    for model in MODELS:
        out = Path(args.out) / model
        cfg = load_config(args.config, SCALE + [f"model.name={model}", f"name={model}"])
        t = time.perf_counter()
        results[model] = run_experiment(cfg, out, show_progress=False)
        seconds[model] = time.perf_counter() - t
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        dev[model] = [(r["round"], r["dev"]["pooled"]["loss"], r["dev"]["score"]) for r in rounds if r["dev"]]
        print(f"{model}: test EM macro {results[model]['test']['macro']['em']:.2f} ({seconds[model]:.0f}s)",
              flush=True)
    per_silo = {m: {row["client"]: row["metrics"] for row in results[m]["test"]["rows"]} for m in MODELS}
    silos = list(per_silo[MODELS[0]])
    test_rows = [["model", *(f"{s} EM / loss" for s in silos), "EM macro", "wall s"]]
    for m in MODELS:
        ps = per_silo[m]
        test_rows.append([m, *(f"{ps[s]['em']:.1f} / {ps[s]['loss']:.3f}" for s in silos),
                          f"{results[m]['test']['macro']['em']:.2f}", f"{seconds[m]:.0f}"])
    dev_rows = [["round", *(f"{m} dev loss / EM" for m in MODELS)]]
    for i, (r, _, _) in enumerate(dev[MODELS[0]]):
        dev_rows.append([str(r), *(f"{dev[m][i][1]:.3f} / {dev[m][i][2]:.1f}" for m in MODELS)])
    doc = ["# Encoder initialisation: MiniLM-L6 vs from scratch\n",
           f"Command: `python bench/encoder_init.py --config {args.config} --out {args.out} --doc {args.doc}`",
           f"Date: {date.today()}; machine: {platform.machine()}, {__import__('os').cpu_count()} cores, no GPU.",
           f"Scale (overrides of {args.config}): `{' '.join(SCALE)}`\n",
           "## Test (selected model)\n", markdown_table(test_rows), "",
           "## Merged dev set per round\n", markdown_table(dev_rows), ""]
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text("\n".join(doc))
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
