"""Per-item test statistics in every run directory (issue 41): `items/test.jsonl`, what the
significance tests over test items (paired bootstrap for BLEU/chrF, paired randomisation for
MAP/MRR/accuracy) pair and resample.

For each built-in task family on a tiny example written here: the file exists after a run, holds no
silo text (ids are hashes), its pooled item stats equal the row's stats in results.json and give the
same metrics, and two runs with different seeds on the same data have equal ids. One small run is
compared in-process vs Flower's simulation; a plug-in task without the ability writes no file.
"""
import json
import os
import random
import re

import pytest

from fedsilo.config import validate
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks import TASKS
from fedsilo.tasks.base import pool

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

HEX16 = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Prepared splits and fitted tokenizers go to this test's cache, never the user's."""
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path / "fedsilo-data"))


# ---- tiny data of each family, written here ----------------------------------------------------

def text2sql_config(tmp_path, seed):
    from tests.synth import tiny_config, write_silos
    data = tmp_path / "t2s"
    if not data.is_dir():
        write_silos(data)
    return validate({**tiny_config(data, federation={"rounds": 1}), "seed": seed}), ["population of city_name0 in yelp"]


def multitask_config(tmp_path, seed):
    from tests.mtoy import config, write_data
    data = tmp_path / "mt"
    if not data.is_dir():
        write_data(data)
    texts = [line.split("\t")[0].split(": ", 1)[1] for line in (data / "toy" / "toy-copy-test.tsv").read_text().splitlines()]
    return validate({**config(data, federation={"rounds": 1}), "seed": seed}), texts


def translation_config(tmp_path, seed):
    rnd = random.Random(4)
    de = ["der", "vertrag", "gilt", "ab", "heute", "und", "endet", "morgen", "das", "gericht"]
    en = ["the", "contract", "applies", "from", "today", "and", "ends", "tomorrow", "the", "court"]
    texts = []
    for silo in ("north", "south"):
        path = tmp_path / f"{silo}.jsonl"
        with open(path, "w") as fh:
            for i in range(30):
                idx = [rnd.randrange(len(de)) for _ in range(4)]
                pair = (" ".join(de[j] for j in idx) + f" {silo}{i}", " ".join(en[j] for j in idx) + f" {silo}{i}")
                texts += pair
                fh.write(json.dumps({"src": pair[0], "tgt": pair[1]}) + "\n")
    own = {s: {"path": str(tmp_path / f"{s}.jsonl"), "fields": {"source": "src", "target": "tgt"},
               "split": {"dev": 0.2, "test": 0.2}} for s in ("north", "south")}
    cfg = {"name": "nmt", "seed": seed,
           "task": {"name": "translation", "sources": own, "tokenizer_domain": "north", "matrix": [],
                    "vocab_size": 120, "max_source_length": 24, "max_target_length": 24, "eval_batch_size": 8},
           "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2},
           "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "logging_steps": 1},
           "federation": {"rounds": 1}}
    return validate(cfg), texts


def matching_config(tmp_path, seed):
    topics = ["password", "invoice", "refund", "parcel", "account", "warranty", "voucher", "battery"]
    texts = []
    for s_idx, silo in enumerate(("helpdesk", "faq")):
        with open(tmp_path / f"{silo}.jsonl", "w") as fh:
            for i in range(20):
                t = topics[(i + s_idx) % len(topics)]
                q = f"how do i change the {t} limit on plan {silo}-{i}?"
                cands = [f"to change the {t} limit of plan {silo}-{i}, open settings.",
                         f"our {topics[(i + 3) % len(topics)]} page lists offers {i}.",
                         f"the {topics[(i + 5) % len(topics)]} desk closes at {i}."]
                texts += [q, *cands]
                fh.write(json.dumps({"question": q, "candidate": cands, "label": [1, 0, 0]}) + "\n")
    own = {s: {"path": str(tmp_path / f"{s}.jsonl"), "split": {"dev": 0.25, "test": 0.25}}
           for s in ("helpdesk", "faq")}
    cfg = {"name": "qa", "seed": seed,
           "task": {"name": "matching", "sources": own, "max_length": 48, "eval_batch_size": 16},
           "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 1,
                     "num_heads": 4},
           "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 8, "logging_steps": 1},
           "federation": {"rounds": 1}}
    return validate(cfg), texts


FAMILIES = {"text2sql": text2sql_config, "multitask": multitask_config, "translation": translation_config,
            "matching": matching_config}


# ---- checks ------------------------------------------------------------------------------------

def read_items(run):
    from fedsilo.rundir.records import read_items as checked
    records = [json.loads(line) for line in (run / "items" / "test.jsonl").read_text().splitlines()]
    assert checked(run) == records  # the reader the significance tests use accepts it as written
    return records


def close(a, b) -> bool:
    a, b = float(a), float(b)
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def assert_pools_to(items: list[dict], stats: dict) -> None:
    """The items' pooled stats equal the row's (an absent key is 0: stats are additive)."""
    pooled = pool(items)
    for key in set(pooled) | set(stats):
        got, want = pooled.get(key, 0.0), stats.get(key, 0.0)
        if isinstance(want, list) or isinstance(got, list):
            got = got or [0.0] * len(want)
            assert len(got) == len(want) and all(close(x, y) for x, y in zip(got, want)), key
        else:
            assert close(got, want), (key, got, want)


def assert_items_match_results(run, texts) -> list[dict]:
    records = read_items(run)
    results = json.loads((run / "results.json").read_text())
    rows = results["test"]["rows"]
    assert [(r["client"], r["task"]) for r in records] == [(r["client"], r["task"]) for r in rows]
    spec = TASKS.get(results["task"]).spec()
    for record, row in zip(records, rows):
        assert set(record) == {"client", "task", "split", "ids", "stats"} and record["split"] == "test"
        assert record["ids"] and len(record["ids"]) == len(record["stats"])
        assert all(HEX16.match(i) for i in record["ids"])
        assert_pools_to(record["stats"], row["stats"])
        metrics = spec.compute(pool(record["stats"]))  # what a resample's metric is computed by
        for key, value in row["metrics"].items():
            assert (metrics[key] is None) == (value is None) and (value is None or close(metrics[key], value)), key
    text = (run / "items" / "test.jsonl").read_text()
    leaked = [t for t in texts if t in text]
    assert not leaked, leaked[:3]
    return records


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_task_family_records_its_test_items_pooling_to_the_row_with_ids_equal_across_seeds(tmp_path, family):
    cfg_a, texts = FAMILIES[family](tmp_path, 1)
    cfg_b, _ = FAMILIES[family](tmp_path, 2)
    run_experiment(cfg_a, tmp_path / "a", show_progress=False)
    run_experiment(cfg_b, tmp_path / "b", show_progress=False)
    a = assert_items_match_results(tmp_path / "a", texts)
    b = assert_items_match_results(tmp_path / "b", texts)
    assert [r["ids"] for r in a] == [r["ids"] for r in b]
    assert all(len(set(r["ids"])) == len(r["ids"]) for r in a)  # distinct items, distinct ids


def test_each_silo_of_an_alone_run_and_the_run_itself_hold_the_items(tmp_path):
    cfg, texts = text2sql_config(tmp_path, 1)
    cfg = cfg.model_copy(update={"paradigm": "finetune"})
    run_experiment(validate(cfg.model_dump(exclude_none=True)), tmp_path / "alone", show_progress=False)
    top = assert_items_match_results(tmp_path / "alone", texts)
    per_silo = [r for silo in cfg.task.client_names() for r in read_items(tmp_path / "alone" / "silos" / silo)]
    assert top == per_silo


def test_a_plugin_task_without_item_stats_writes_no_items_file(tmp_path):
    from tests.test_plugins import toy_config

    results = run_experiment(toy_config(federation={"rounds": 1}), tmp_path / "run", show_progress=False)
    assert results["test"]["rows"] and not (tmp_path / "run" / "items").exists()


def test_a_plugin_task_declares_the_ability_through_the_generic_path():
    """A plug-in task gets items by being `ItemStats` (evaluate_items, rows built by `item_row`); only
    the final evaluation asks for them."""
    from fedsilo.tasks.base import ItemStats, evaluate_rows, item_row

    class Counting:
        name = "counting"

        def examples(self, client, split):
            return ["a", "b", "c"]

        def evaluate_items(self, model, client, split, progress=None, final=False):
            items = self.examples(client, split)
            return [item_row(client, self.name, items, [{"correct": float(x != "b"), "n": 1.0} for x in items])]

        def evaluate(self, model, client, split, progress=None, final=False):
            return [{k: v for k, v in r.items() if k != "items"} for r in self.evaluate_items(model, client, split)]

    task = Counting()
    assert isinstance(task, ItemStats)
    final = evaluate_rows(task, None, "c", "test", final=True)
    assert final[0]["stats"] == {"correct": 2.0, "n": 3.0}
    assert len(final[0]["items"]["ids"]) == 3 and all(HEX16.match(i) for i in final[0]["items"]["ids"])
    assert "items" not in evaluate_rows(task, None, "c", "dev")[0]


def test_the_items_file_is_the_same_in_process_and_on_flower(tmp_path):
    from tests.parity import local_and_simulation

    cfg, texts = text2sql_config(tmp_path, 1)
    local, sim = local_and_simulation(cfg, tmp_path)
    assert_items_match_results(local, texts)
    assert_items_match_results(sim, texts)
    assert (sim / "items" / "test.jsonl").read_bytes() == (local / "items" / "test.jsonl").read_bytes()


def test_a_silos_evaluate_reply_carries_numbers_and_hashes_only():
    from fedsilo.engines.flower.codec import MalformedReply, content_to_rows, rows_to_record

    row = {"client": "a", "task": "t", "stats": {"n": 2.0},
           "items": {"ids": ["0123456789abcdef", "fedcba9876543210"], "stats": [{"n": 1.0}, {"n": 1.0}]}}
    with pytest.raises(TypeError, match="item"):
        rows_to_record([{**row, "items": {**row["items"], "stats": [{"n": "the text"}, {"n": 1.0}]}}])
    with pytest.raises(TypeError, match="item"):
        rows_to_record([{**row, "items": {**row["items"], "ids": ["how do i reset it?", "0123456789abcdef"]}}])
    from flwr.app import RecordDict
    assert content_to_rows(RecordDict({"rows": rows_to_record([row])}), "a") == [row]
    for bad in ({"ids": ["secret text here!", "0123456789abcdef"], "stats": row["items"]["stats"]},
                {"ids": row["items"]["ids"], "stats": [{"n": 1.0}]},
                {"ids": row["items"]["ids"], "stats": [{"n": "x"}, {"n": 1.0}]}):
        sent = RecordDict({"rows": rows_to_record([{k: v for k, v in row.items() if k != "items"}])})
        sent["rows"]["rows"] = json.dumps([{**row, "items": bad}])
        with pytest.raises(MalformedReply):
            content_to_rows(sent, "a")


def test_an_altered_items_file_is_refused_naming_file_and_line(tmp_path):
    from fedsilo.rundir.records import item_records, read_items, write_items

    row = {"client": "a", "task": "t", "stats": {"n": 2.0},
           "items": {"ids": ["0123456789abcdef", "fedcba9876543210"], "stats": [{"n": 1.0}, {"n": 1.0}]}}
    assert read_items(tmp_path) is None and write_items(tmp_path, item_records([{**row, "items": None}])) is None
    path = write_items(tmp_path, item_records([row]))
    assert read_items(tmp_path) == [{"client": "a", "task": "t", "split": "test", **row["items"]}]
    good = path.read_text()
    for bad, why in ((good.replace("0123456789abcdef", "how do i log in?"), "ids"),
                     (good.replace('{"n":1.0}]', '{"n":"text"}]'), r"stats\[1\]\['n'\]"),
                     (good.replace('{"n":1.0},', ""), "one object per id"),
                     (good[:-5], "partly written")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=why):
            read_items(tmp_path)
