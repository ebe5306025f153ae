"""ROUGE-L: CrossFit's scorer (`rouge`) vs Google's (`rouge-score`) on the multitask test pools.

Per task: the mean over test records of the best ROUGE-L over the references, x100, exactly as
fedsilo scores a row (metrics.example_stats), for simple baseline predictions:
  other-ref : the first reference of the next record (text of the right kind, no copying)
  source    : the input's first L words, L = the first reference's length in words
Settings: as-is (cased text: a cased model such as BART), minilm (prediction and references through
MiniLM's uncased tokenizer round trip, as the default model is scored), and the case effect:
prediction lowercased against cased references (as-is) and prediction = the reference lowercased.
"""
import sys
from pathlib import Path

from fedsilo.tasks.multitask.catalog import CATALOG
from fedsilo.tasks.multitask.converters import load_all
from fedsilo.tasks.multitask.metrics import example_stats

ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "multitask"  # ../shared/data
TASKS = ("aeslc", "e2e_nlg_cleaned", "wiki_split")
load_all()


def source_words(text: str) -> list[str]:
    for junk in ("summarize: ", "sentence 1: ", " [SEP] sentence 2: "):
        text = text.replace(junk, " ")
    return text.split()


def mean(preds, refs, scorer):
    s = example_stats("rouge_l", preds, refs, rouge=scorer)
    return 100 * s["rouge_sum"] / s["n"]


def main():
    from transformers import AutoTokenizer
    from fedsilo.models.seq2seq import minilm_path
    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    rt = lambda texts: [t.strip() for t in tok.batch_decode(tok(texts, add_special_tokens=False)["input_ids"],
                                                             skip_special_tokens=True)]
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else None
    print("| task | records | prediction | setting | crossfit | google | crossfit - google |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
    for name in TASKS:
        records = CATALOG.get(name).convert(ROOT).test[:limit]
        refs = [r.outputs for r in records]
        empty = sum(1 for rs in refs for x in rs if not x.replace(".", "").strip())
        assert not empty, (name, empty)
        baselines = {
            "other-ref": [refs[(i + 1) % len(refs)][0] for i in range(len(refs))],
            "source": [" ".join(source_words(r.input)[:max(1, len(r.outputs[0].split()))]) for r in records],
        }
        flat = [x for rs in refs for x in rs]
        written = dict(zip(flat, rt(flat)))
        rt_refs = [tuple(written[x] or x for x in rs) for rs in refs]
        for pname, preds in baselines.items():
            settings = {"as-is": (preds, refs), "minilm": (rt(preds), rt_refs),
                        "pred lowercased": ([p.lower() for p in preds], refs)}
            for sname, (p, r) in settings.items():
                c, g = mean(p, r, "crossfit"), mean(p, r, "google")
                print(f"| {name} | {len(records)} | {pname} | {sname} | {c:.2f} | {g:.2f} | {c - g:+.2f} |",
                      flush=True)
        lower = [rs[0].lower() for rs in refs]
        c, g = mean(lower, refs, "crossfit"), mean(lower, refs, "google")
        print(f"| {name} | {len(records)} | reference lowercased | as-is | {c:.2f} | {g:.2f} | {c - g:+.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
