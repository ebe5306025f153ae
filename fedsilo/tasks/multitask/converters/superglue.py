"""SuperGLUE tasks from FewGLUE_32dev (P-tuning's copy): `superglue-rte`, `-cb`, `-copa`, `-wic`,
`-wsc`, `-multirc`, `-record` and `boolq`, each as CrossFit's task script writes it. (`glue-rte` is
not made from FewGLUE's RTE: CrossFit's glue-rte test file does not match SuperGLUE's RTE val
written in glue-rte's layout, so the copy is not known to hold GLUE's strings.)

Pools: CrossFit draws its few-shot train and dev from HF's full SuperGLUE train split; here only
FewGLUE's 32 train examples and FewGLUE_32dev's 32 dev examples (both drawn from SuperGLUE train)
are present, so they are the train pool together (64, exactly 2 x 32 for the text-to-text tasks),
and SuperGLUE's val.jsonl (HF's "validation", CrossFit's test) is the test pool. ReCoRD has no
val.jsonl in the copy: its 64 records are split 80/20 (`split_80_20`) into train and test pools.

CrossFit's strings (before `clean`, the RTE, CB, COPA, WiC, WSC and BoolQ test pools are byte for
byte CrossFit's test files, by the checksums in its tasks/_md5sum.py), with their oddities kept and
one forced departure (MultiRC):
- boolq reads HF's `boolq` (Google's release), whose passage has no "<title> -- " prefix; the
  SuperGLUE copy's passages all have it, and it is removed at the first " -- ".
- superglue-wsc reads HF's `wsc.fixed`: span texts that are not substrings of the text are
  re-cased and stripped of a trailing "." as HF's `_fix_wst` does; CrossFit writes
  " [SEP] span1_text" with no ": " (kept).
- superglue-copa ignores the cause/effect question, as CrossFit does.
- superglue-multirc joins the correct answers of a question with " [SEP] " in CrossFit; outputs
  may not hold "[SEP]" (catalog.py), so they are joined with " ; " here (SQuAD normalisation drops
  both separators' punctuation; only CrossFit's literal word "sep" is lost). "NO ANSWER!" as CrossFit.
- superglue-record answers with HF's first answer: the alphabetically first distinct answer text.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..catalog import Group, Metric, Pools, Record, register, split_80_20
from ..reading import Source, label
from .pairs import SEP, fields, read_jsonl, record

FEWGLUE = "P-tuning/FewGLUE_32dev"
POOL_NOTE = ("train pool: FewGLUE train.jsonl (32) + FewGLUE_32dev dev32.jsonl (32), both from SuperGLUE train "
             "(CrossFit samples HF's full train split); test pool: SuperGLUE val.jsonl (= HF validation)")
Rows = Callable[[dict], list[Record]]


def fewglue_file(task: str, split: str) -> str:
    return f"{FEWGLUE}/{task}/{split}.jsonl"


def fewglue_records(root: Path, task: str, split: str, rows: Rows) -> list[Record]:
    with Source(root / fewglue_file(task, split)) as src:
        return [r for row in read_jsonl(src) for r in rows(row)]


def fewglue_task(name: str, task: str, rows: Rows, *, group: Group, metric: Metric, per_class: bool,
                 license: str) -> None:
    """Register `name`: FewGLUE train + dev32 as the train pool, SuperGLUE val as the test pool."""
    @register(name, group=group, metric=metric, per_class=per_class, license=license,
              files=tuple(fewglue_file(task, s) for s in ("train", "dev32", "val")))
    def convert(root: Path) -> Pools:
        train = [r for s in ("train", "dev32") for r in fewglue_records(root, task, s, rows)]
        return Pools(train, fewglue_records(root, task, "val", rows), note=POOL_NOTE)


# --- Classification rows ------------------------------------------------------------------------------------

YES_NO = {True: "yes", False: "no"}
TRUE_FALSE = {True: "true", False: "false"}


def nli_rows(first: str, second: str) -> Rows:
    """RTE and CB: the premise and hypothesis under CrossFit's field names; the label word as is."""
    return lambda row: [record(fields((first, row["premise"]), (second, row["hypothesis"])), row["label"])]


def wic_rows(row: dict) -> list[Record]:
    text = fields(("word", row["word"]), ("sentence 1", row["sentence1"]), ("sentence 2", row["sentence2"]))
    return [record(text, label(TRUE_FALSE, row["label"]))]


def fix_wsc_span(text: str, span: str, index: int) -> str:
    """HF's `_fix_wst` for one span: a span that is not in the text takes the case of the text's
    word at `index` and loses a trailing "." (two known spans cannot be fixed and stay)."""
    if span in text or span in ("Kamenev and Zinoviev", "Kamenev, Zinoviev, and Stalin"):
        return span
    first = text.split()[index]
    span = (span[0].lower() if first[0].islower() else span[0].upper()) + span[1:]
    return span.rstrip(".").replace("\n", " ")


def wsc_rows(row: dict) -> list[Record]:
    target, text = row["target"], row["text"]
    span1 = fix_wsc_span(text, target["span1_text"], target["span1_index"])
    span2 = fix_wsc_span(text, target["span2_text"], target["span2_index"])
    return [record("text: " + text + SEP + "span1_text" + span1 + SEP + "span2_text: " + span2,
                   label(TRUE_FALSE, row["label"]))]


def boolq_rows(row: dict) -> list[Record]:
    passage = row["passage"].split(" -- ", 1)[-1]  # HF's boolq passage has no "<title> -- "
    return [record(fields(("question", row["question"]), ("context", passage)), label(YES_NO, row["label"]))]


# --- Text-to-text rows --------------------------------------------------------------------------------------

def copa_rows(row: dict) -> list[Record]:
    answer = row["choice2"] if row["label"] else row["choice1"]
    return [record(row["premise"] + " (A) " + row["choice1"] + " (B) " + row["choice2"], answer)]


def choice_letter(i: int) -> str:
    return f"({chr(65 + i)})"


def multirc_rows(row: dict) -> list[Record]:
    """One record per question: its candidate answers lettered, the correct ones joined."""
    passage = row["passage"]
    out = []
    for question in passage["questions"]:
        answers = question["answers"]
        text = "question: " + question["question"]
        text += "".join(f" {choice_letter(i)} {a['text']}" for i, a in enumerate(answers))
        text += " context: " + passage["text"]
        correct = [a["text"] for a in answers if a["label"] == 1]
        out.append(record(text, " ; ".join(correct) if correct else "NO ANSWER!"))
    return out


def record_rows(row: dict) -> list[Record]:
    """One record per query; HF's answers are the sorted distinct answer texts, CrossFit takes the first."""
    return [record("question: " + qa["query"] + " context: " + row["passage"]["text"],
                   sorted({a["text"] for a in qa["answers"]})[0])
            for qa in row["qas"]]


# --- Registration -----------------------------------------------------------------------------------------

fewglue_task("superglue-rte", "RTE", nli_rows("premise", "hypothesis"), group="classification", metric="acc",
             per_class=True, license="none stated (PASCAL RTE data; research use)")
fewglue_task("superglue-cb", "CB", nli_rows("premise", "hypothesis"), group="classification", metric="acc",
             per_class=True, license="none stated (CommitmentBank; research use)")
fewglue_task("superglue-wic", "WiC", wic_rows, group="classification", metric="acc", per_class=True,
             license="CC-BY-NC-4.0 (non-commercial)")
fewglue_task("superglue-wsc", "WSC", wsc_rows, group="classification", metric="acc", per_class=True,
             license="CC-BY-4.0")
fewglue_task("boolq", "BoolQ", boolq_rows, group="qa", metric="acc", per_class=True, license="CC-BY-SA-3.0")
fewglue_task("superglue-copa", "COPA", copa_rows, group="qa", metric="acc", per_class=False,
             license="BSD-2-Clause")
fewglue_task("superglue-multirc", "MultiRC", multirc_rows, group="qa", metric="em", per_class=False,
             license="research only (MultiRC)")


@register("superglue-record", group="qa", metric="qa_f1", per_class=False,
          files=(fewglue_file("ReCoRD", "train"), fewglue_file("ReCoRD", "dev32")),
          license="research only (ReCoRD; CNN/Daily Mail text)")
def superglue_record(root: Path) -> Pools:
    records = [r for s in ("train", "dev32") for r in fewglue_records(root, "ReCoRD", s, record_rows)]
    train, test = split_80_20(records)
    return Pools(train, test, note="no SuperGLUE val.jsonl for ReCoRD in the copy: FewGLUE train.jsonl (32) + "
                                   "FewGLUE_32dev dev32.jsonl (32) queries split 80/20 (numpy seed 42) into "
                                   "train and test pools")
