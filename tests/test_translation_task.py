"""The translation task end to end on the real domains with a tiny Transformer: Dynamic Pulling in a
federation, the cross-domain matrix, sacreBLEU agreement, resume with DP state, `model.init_from`
and its tokenizer, and a local Hugging Face checkpoint loaded unchanged."""
import json
from pathlib import Path

import pytest
import sacrebleu
import torch

from fedsilo.config import ConfigError, validate
from fedsilo.recipe import build_model, build_task
from fedsilo.runs.runner import run_experiment
from fedsilo.tasks.translation.metrics import bleu_from_stats

NMT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "nmt"
pytestmark = pytest.mark.skipif(not NMT.is_dir(), reason=f"real translation data not found at {NMT}")

DOMAINS3 = ["news", "ted", "tatoeba"]


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Prepared splits and the fitted tokenizer go to this module's cache, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(tmp_path_factory.mktemp("fedsilo-data")))
        yield


def nmt_config(**sections) -> dict:
    cfg = {
        "name": "nmt", "seed": 1,
        "task": {"name": "translation", "data_dir": str(NMT), "silos": DOMAINS3, "max_train": 24,
                 "max_eval": 6, "vocab_size": 400, "matrix": DOMAINS3, "max_source_length": 32,
                 "max_target_length": 24, "eval_batch_size": 8},
        "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2},
        "client": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 8, "logging_steps": 1},
        "federation": {"rounds": 2},
        "exchange": {"upload": "dp_l", "overwrite": "uploaded"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def rounds_of(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "run"
    results = run_experiment(validate(nmt_config()), out, show_progress=False)
    return out, results


def test_tokenizer_is_fitted_on_the_news_training_pairs_only(monkeypatch):
    from fedsilo.tasks.translation import task as task_module
    seen = []
    real_load = task_module.load_silo
    monkeypatch.setattr(task_module, "load_silo",
                        lambda settings, domain, d: seen.append(domain) or real_load(settings, domain, d))
    from fedsilo.recipe import task_tokenizer
    tok = task_tokenizer(validate(nmt_config()))()
    assert seen == ["news"]
    assert tok.decode(tok("Das Haus ist groß.")["input_ids"], skip_special_tokens=True) == "Das Haus ist groß."


def test_collate_appends_eos_pads_labels_with_minus_100_and_cuts_at_the_limits():
    cfg = validate(nmt_config(task={"max_source_length": 5, "max_target_length": 4}))
    model, tok = build_model(cfg)
    task = build_task(cfg, tok)
    pairs = task.examples("news", "train")[:3]
    batch = task.collate(pairs)
    assert batch["input_ids"].shape[1] <= 5 and batch["labels"].shape[1] <= 4
    for row, pair in zip(batch["labels"], pairs):
        ids = [i for i in row.tolist() if i != -100]
        assert ids[-1] == tok.eos_token_id and -100 not in ids
        assert len(ids) == min(4, len(tok(pair.target)["input_ids"]))
    assert model(**batch).loss.isfinite()


def assert_stats_close(got: dict, want: dict) -> None:
    """Nested row stats (counts, lists of n-gram statistics) equal up to float rounding, compared
    key by key: pytest.approx takes no nested dicts from pytest 9 on."""
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, (list, tuple)):
            assert len(got[key]) == len(value), key
            assert list(got[key]) == pytest.approx(list(value)), key
        else:
            assert got[key] == pytest.approx(value), key


def test_three_domains_two_rounds_with_dynamic_pulling(dp_run):
    out, results = dp_run
    r1, r2 = rounds_of(out)
    for c in DOMAINS3:
        for r in (r1, r2):  # a part in every round, the first too (ranked against the start model)
            share = r["clients"][c]["params_up"] / r["clients"][c]["params_down"]
            assert 0.3 < share < 0.7, (c, share)
            assert r["clients"][c]["bytes_up"] == 4 * r["clients"][c]["params_up"]
    assert r2["params_up"] == sum(r2["clients"][c]["params_up"] for c in DOMAINS3)
    rows = results["test"]["rows"]
    assert [r["client"] for r in rows] == DOMAINS3 and all(r["stats"]["n"] == 6 for r in rows)
    macro = sum(r["metrics"]["bleu"] for r in rows) / 3
    assert results["test"]["macro"]["bleu"] == pytest.approx(macro)
    pooled = [sum(v) for v in zip(*(r["stats"]["bleu_stats"] for r in rows))]
    assert results["test"]["pooled"]["bleu"] == pytest.approx(bleu_from_stats(pooled))
    assert "tok:13a" in results["metric_spec"]["signature"]
    # the matrix: the global model and each client's own model (DP keeps tensors of its own) x 3 domains
    models = results["matrix"]["models"]
    assert list(models) == ["global", *DOMAINS3]
    assert all([r["client"] for r in m["rows"]] == DOMAINS3 for m in models.values())
    # a client's own model on its own domain is the diagonal of the usual test table
    for row in rows:
        own = next(r for r in models[row["client"]]["rows"] if r["client"] == row["client"])
        assert_stats_close(own["stats"], row["stats"])
    report = (out / "report.md").read_text() if (out / "report.md").exists() else None
    from fedsilo.runs.report import write_report
    report = write_report(out).read_text()
    assert "## Cross-domain matrix" in report and "parameters up" in report


def test_bleu_of_a_row_is_sacrebleus_on_the_same_translations(dp_run):
    out, _ = dp_run
    cfg = validate(nmt_config())
    model, tok = build_model(cfg)
    task = build_task(cfg, tok)
    pairs = task.examples("ted", "test")
    _, _, hyps, _ = task.evaluate_batch(model, task.tokenize(pairs))
    row = task.evaluate(model, "ted", "test")[0]
    expected = sacrebleu.corpus_bleu(hyps, [[p.target for p in pairs]])
    assert bleu_from_stats(row["stats"]) == pytest.approx(expected.score, abs=1e-9)
    assert row["stats"]["bleu_stats"][:2] == [expected.sys_len, expected.ref_len]


def test_resume_with_dynamic_pulling_state_equals_uninterrupted(dp_run, tmp_path):
    uninterrupted, _ = dp_run
    out = tmp_path / "resumed"
    run_experiment(validate(nmt_config(federation={"rounds": 1})), out, show_progress=False)
    run_experiment(validate(nmt_config()), out, resume=True, show_progress=False)
    a, b = rounds_of(uninterrupted), rounds_of(out)
    for x, y in zip(a, b):
        for c in DOMAINS3:  # the same tensors selected in round 2: it read round 1's kept tensors
            assert y["clients"][c]["params_up"] == x["clients"][c]["params_up"]
            assert y["clients"][c]["losses"] == x["clients"][c]["losses"]
    pa = torch.load(uninterrupted / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(out / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=0)


def test_init_from_a_run_directory_starts_from_its_best_model_and_tokenizer(dp_run, tmp_path):
    source, _ = dp_run
    best = torch.load(source / "best.pt", weights_only=True)["server"]["params"]
    # the run's saved tokenizer is used: another vocabulary size is refused by name, not ignored ...
    with pytest.raises(ConfigError, match=r"task\.vocab_size = 300: not read, model\.init_from = .* fitted with "
                                          r"vocab_size = 400"):
        validate(nmt_config(model={"init_from": str(source)}, task={"vocab_size": 300}))
    # ... and one left out is the saved tokenizer's (what this run's config.toml records), not the default
    raw = nmt_config(model={"init_from": str(source)})
    del raw["task"]["vocab_size"]
    cfg = validate(raw)
    assert cfg.task.vocab_size == 400
    model, tok = build_model(cfg)
    assert len(tok) == best["model.shared.weight"].shape[0]
    params = dict(model.named_parameters())
    for name, t in best.items():
        assert torch.equal(params[name].detach(), t)


def test_init_from_errors_name_the_problem(dp_run, tmp_path):
    source, _ = dp_run
    with pytest.raises(ConfigError, match="holds no best.pt"):
        build_model(validate(nmt_config(model={"init_from": str(tmp_path)})))
    with pytest.raises(ConfigError, match=r"has shape .* \(another tokenizer or model size"):
        build_model(validate(nmt_config(model={"init_from": str(source / "best.pt"), "d_model": 32})))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        build_model(validate(nmt_config(model={"init_from": str(tmp_path / "junk.pt")})))


def test_a_local_marian_checkpoint_loads_unchanged(tmp_path):
    cfg = validate(nmt_config())
    model, tok = build_model(cfg)
    model.save_pretrained(tmp_path / "marian")
    tok.save_pretrained(tmp_path / "marian")
    loaded, tok2 = build_model(validate(nmt_config(model={"name": str(tmp_path / "marian")})))
    assert type(loaded).__name__ == "MarianMTModel" and tok2.get_vocab() == tok.get_vocab()
    ours, theirs = model.state_dict(), loaded.state_dict()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    task = build_task(cfg, tok2)
    assert task.evaluate(loaded, "ted", "test")[0]["stats"]["n"] == 6


def test_dp_l_on_flower_simulation_matches_in_process(tmp_path):
    """Selections are made on the silo from its previous-round tensors kept in its own store."""
    from tests.parity import local_and_simulation
    cfg = validate(nmt_config(task={"matrix": []}))
    local_and_simulation(cfg, tmp_path)
    a, b = rounds_of(tmp_path / "local"), rounds_of(tmp_path / "sim")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        for c in DOMAINS3:
            assert y["clients"][c]["params_up"] == x["clients"][c]["params_up"]
            assert y["clients"][c]["bytes_down"] == x["clients"][c]["bytes_down"]
            assert y["clients"][c]["weight"] == pytest.approx(x["clients"][c]["weight"], rel=1e-6)
    assert all(r["params_up"] < r["params_down"] for r in b)  # a part only, on Flower too
    pa = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)["server"]["params"]
    pb = torch.load(tmp_path / "sim" / "checkpoint.pt", weights_only=True)["server"]["params"]
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-6, atol=1e-7)
    ra = json.loads((tmp_path / "local" / "results.json").read_text())["test"]["rows"]
    rb = json.loads((tmp_path / "sim" / "results.json").read_text())["test"]["rows"]
    for x, y in zip(ra, rb):
        assert y["stats"]["bleu_stats"] == x["stats"]["bleu_stats"]
        assert y["stats"]["loss_sum"] == pytest.approx(x["stats"]["loss_sum"], rel=1e-5)


def test_deployment_reads_each_silos_files_where_they_are(tmp_path, monkeypatch, capsys):
    """`fedsilo deploy` with real SuperNodes: nothing is copied; each silo checks and fingerprints
    its own domain's files on its own disk (the public news corpus only fits its tokenizer)."""
    import os

    from fedsilo.cli import main
    from fedsilo.config import to_toml
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    monkeypatch.chdir(tmp_path)
    raw = nmt_config(task={"silos": ["ted", "docs"], "matrix": []}, federation={"rounds": 1})
    Path("exp.toml").write_text(to_toml(validate(raw)))
    code = main(["deploy", "exp.toml", "--out", "runs/dep", "--workdir", "work", "--no-progress"])
    assert code == 0, capsys.readouterr().err[-3000:]
    test = json.loads((tmp_path / "runs" / "dep" / "results.json").read_text())["test"]
    assert [r["client"] for r in test["rows"]] == ["ted", "docs"] and all(r["stats"]["n"] == 6 for r in test["rows"])
    data = Path(validate(raw).task.data_dir) if validate(raw).task.data_dir else None
    for silo, own in (("ted", "ted"), ("docs", "salesforce_docs")):
        # what each silo read, as it recorded on its own disk (nothing is copied): its own domain only
        records = list((tmp_path / "work" / "processes" / "state" / silo).glob("*/data.json"))
        assert len(records) == 1, records
        read = json.loads(records[0].read_text())["started"]
        assert set(read) == {silo}
        folders = {Path(f).relative_to(data).parts[0] if data else Path(f).parts[-3] for f in read[silo]}
        assert folders == {own}
    assert not (tmp_path / "work" / "silo-data").exists()
