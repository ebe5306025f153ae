"""Fertility (subword pieces per whitespace word) and unknown-piece rate of the translation task's
joint tokenizer on every domain's training pairs, per side, for a few vocabulary sizes.

The tokenizer is fitted on the news domain's training pairs only (the generic engine's data), so
the other domains show how well a vocabulary from news covers them.

    python bench/nmt_tokenizer.py [--vocab 4000 8000] [--model unigram]
"""
from __future__ import annotations

import argparse
import platform
import time
from datetime import date

from fedsilo.datafetch import default_data_root
from fedsilo.runs.tables import markdown_table
from fedsilo.tasks import TASKS
from fedsilo.tasks.translation.data import DISPLAY, DOMAINS, load_domain
from fedsilo.tasks.translation.plugin import TranslationSettings
from fedsilo.tasks.translation.task import task_tokenizer
from fedsilo.tasks.translation.tokenizer import fertility


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--model", choices=("unigram", "bpe"), default="unigram")
    args = parser.parse_args()
    print(f"Measured {date.today()} on {platform.machine()}; data cache {default_data_root()}\n")
    settings = TranslationSettings(name="translation")
    data_dir = TASKS.get("translation").data_dir(settings)
    train = {d: load_domain(data_dir, d)["train"] for d in DOMAINS}
    rows = [["vocab", "side", *(DISPLAY[d] for d in DOMAINS)]]
    for vocab in args.vocab:
        t0 = time.perf_counter()
        tok = task_tokenizer(settings.model_copy(update={"vocab_size": vocab, "tokenizer_model": args.model}),
                             data_dir)
        print(f"{args.model} {vocab}: {len(tok)} pieces, fitted or loaded in {time.perf_counter() - t0:.1f}s")
        for side in ("source", "target"):
            stats = {d: fertility(tok, [getattr(p, side) for p in train[d]]) for d in DOMAINS}
            rows.append([str(len(tok)), "de" if side == "source" else "en",
                         *(f"{s['pieces_per_word']:.2f} / {100 * s['unk_rate']:.3f}%" for s in stats.values())])
    print("\npieces per word / unknown pieces, training pairs of each domain\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
