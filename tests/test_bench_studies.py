"""bench/nmt_study.py and bench/multitask_study.py over several seeds: the configs each builds (per-seed
init_from chains, both scales), the share of FedAvg's parameters per round, and the doc-writing code on
constructed results (nothing is trained here)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fedsilo.config import validate

ROOT = Path(__file__).resolve().parents[1]


def bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


nmt = bench("nmt_study")
mt = bench("multitask_study")


def write_rounds(run: Path, records: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# ---------------------------------------------------------------- nmt: configs


def expected_init(name: str, out: Path, seed: int) -> str | None:
    if name in ("generic", "alone"):
        return None
    if name == "chained-1":
        return str(out / "generic" / f"seed-{seed}")
    if name.startswith("chained-"):
        return str(out / f"chained-{int(name.split('-')[1]) - 1}" / f"seed-{seed}")
    if name == "finetune-after-fl":
        return str(out / "fedavg" / f"seed-{seed}")
    return str(out / "generic" / f"seed-{seed}")


@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_nmt_configs_are_valid_and_each_seed_is_its_own_chain(tmp_path, scale):
    assert "fedavg-seed1" not in nmt.ORDER and "controllers-8e8d" in nmt.ORDER and "dp_l-count" in nmt.ORDER
    for seed in (0, 1):
        for name in nmt.ORDER:
            cfg = nmt.config(name, tmp_path, scale, seed, True)
            assert cfg.seed == seed, name
            assert cfg.name.endswith(f"/seed-{seed}"), name
            assert cfg.model.init_from == expected_init(name, tmp_path, seed), name
            validate(cfg.model_dump(exclude_none=True), name)  # still a valid config after seeding
            layers = cfg.model.num_layers
            if name.startswith("chained-"):
                assert cfg.task.silos == [nmt.CHAIN[int(name.split("-")[1]) - 1]]
            if cfg.model.surgery is not None:
                assert max(cfg.model.surgery.options["after"]) < layers, (scale, name)
            for pattern in cfg.exchange.shared or []:
                if ".layers." in pattern:
                    assert int(pattern.split(".layers.")[1].split(".")[0]) < layers, (scale, name, pattern)
            if scale == "paper":
                assert (cfg.model.d_model, layers, cfg.task.max_eval) == (512, 6, 2000)
                assert cfg.client.steps == {"generic": 20000, "alone": 50000, "fedavg-r10": 5000,
                                            "fedavg-r25": 2000}.get(name, 10000)
    paper8 = nmt.config("controllers-8e8d", tmp_path, "paper", 0, True)
    assert paper8.model.surgery.options["after"] == [0, 5]


def test_nmt_one_seed_keeps_the_old_layout(tmp_path):
    cfg = nmt.config("fedavg", tmp_path, "cpu", 0, False)
    assert cfg.model.init_from == str(tmp_path / "generic") and cfg.name == "nmt-fedavg" and cfg.seed == 0
    assert nmt.config("finetune-after-fl", tmp_path, "cpu", 3, False).model.init_from == str(tmp_path / "fedavg")


# ---------------------------------------------------------------- nmt: share of FedAvg's parameters


def test_share_of_fedavg_per_round(tmp_path):
    write_rounds(tmp_path / "fedavg", [{"round": r, "params_up": 1000, "params_down": 1000, "bytes_up": 4000,
                                        "bytes_down": 4000, "seconds": 2.0} for r in range(1, 6)])
    dp = [{"round": r, "params_up": 500 if r == 1 else 400, "params_down": 1000, "bytes_up": 0, "bytes_down": 0,
           "seconds": 1.0} for r in range(1, 7)]  # round 6: FedAvg has none, so it is left out of the shares
    write_rounds(tmp_path / "dp", dp)
    x = nmt.exchange(tmp_path / "dp", tmp_path / "fedavg")
    assert x["up_1"] == pytest.approx(0.5)
    assert x["up_mean"] == pytest.approx((0.5 + 4 * 0.4) / 5)
    assert x["down_1"] == x["down_mean"] == pytest.approx(1.0)
    assert x["params_up"] == 500 + 5 * 400 and x["seconds"] == 1.0  # totals: every round it ran


# ---------------------------------------------------------------- nmt: the doc on constructed results


def grid(models: dict[str, dict[str, float]]) -> dict:
    return {"matrix": {"models": {m: {"rows": [{"client": d, "metrics": {"bleu": v}} for d, v in row.items()]}
                                  for m, row in models.items()}},
            "test": {"rows": [{"client": d, "metrics": {"bleu": v}} for d, v in next(iter(models.values())).items()]}}


def fake_nmt(tmp_path: Path, seeds: list[int]) -> dict[str, dict[int, dict]]:
    """name → seed → results: every client's own model at `own`, the global model at `glob`, + a seed wobble;
    and rounds.jsonl for the FL methods."""
    own = {"dp_l": 5.0, "dp_g": 2.0, "random": 5.0, "dp_l-33": 3.0, "dp_g-33": 2.0, "controllers": 3.0,
           "controllers-8e8d": 1.0, "dp_l-count": 4.0}
    up = {"fedavg": 1.0, "fedavg-r10": 1.0, "fedavg-r25": 1.0, "dp_l": 0.5, "dp_g": 0.5, "random": 0.5,
          "dp_l-33": 0.33, "dp_g-33": 0.33, "controllers": 0.3, "controllers-8e8d": 0.1, "dp_l-count": 0.01}
    rounds = {"fedavg-r10": 10, "fedavg-r25": 25}
    res: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        wobble = 0.1 * seed
        flat = {d: 1.0 + wobble for d in nmt.DOMAINS}
        for name in nmt.ORDER:
            if name in ("alone", "finetune-after-fl"):
                models = {d: {x: (2.0 if x == d else 0.5) + wobble for x in nmt.DOMAINS} for d in nmt.DOMAINS}
            elif name in own:
                models = {"global": flat, **{d: {x: own[name] + wobble for x in nmt.DOMAINS} for d in nmt.DOMAINS}}
            else:
                models = {"global": {d: (3.0 if name.startswith("fedavg") else 1.0) + wobble for d in nmt.DOMAINS}}
            res.setdefault(name, {})[seed] = grid(models)
            if name in up:
                full, bump = 1000, not name.startswith("fedavg")  # round 1: a method's share moves with the seed
                write_rounds(nmt.run_dir(tmp_path, name, seed, len(seeds) > 1), [
                    {"round": r, "params_up": full * up[name] * (1 + 0.02 * seed if r == 1 and bump else 1),
                     "params_down": full * (up[name] if name.endswith("33") or "controllers" in name else 1),
                     "bytes_up": 4 * full * up[name], "bytes_down": 4 * full, "seconds": 1.0 + seed}
                    for r in range(1, rounds.get(name, 5) + 1)])
    return res


def test_nmt_doc_shows_spread_shares_and_claims(tmp_path):
    seeds = [0, 1]
    res = fake_nmt(tmp_path, seeds)
    doc = tmp_path / "nmt.md"
    nmt.write_doc(tmp_path, res, doc, "cpu", "python bench/nmt_study.py", seeds)
    text = doc.read_text()
    assert "fedavg-seed1" not in text and "seed 1)" not in text  # no special noise run any more
    assert "after the first" not in text and "sends everything" not in text
    table7 = text.split("## Table 7")[1].split("##")[0]
    assert "controllers-8e8d (clients, own domain)" in table7 and "controllers-8e8d (global)" in table7
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    # dp_l: round 1 up 50% (seed 0) and 51% (seed 1), the other rounds 50%: mean over rounds 50.0 / 50.2
    assert rows["dp_l"][5] == "50.5% ± 0.7" and rows["dp_l"][6] == "50.1% ± 0.1"
    assert rows["dp_l"][7] == rows["dp_l"][8] == "100.0% ± 0.0"
    assert rows["controllers-8e8d"][6].startswith("10.0% ±") and rows["controllers-8e8d"][8].startswith("10.0% ±")
    assert rows["fedavg-r25"][5] == "100.0% ± 0.0"
    assert rows["News alone"][1] == "2.05 ± 0.07"  # own domain 2.0 / 2.1 over the two seeds
    claims = text.split("## The paper's claims")[1]
    line = {c[:2]: c for c in claims.splitlines() if c[:2] in ("1.", "2.", "3.", "4.", "5.")}
    # FedAvg's global 3.0 / 3.1 vs (2.0 + 4 · 0.5) / 5 + wobble: the significance rule, its test and p
    assert "News alone 0.85 ± 0.07: holds (p = 0.001, Welch's t-test over 2 vs 2 seeds" in line["1."]
    assert "— holds (p < 0.001, Welch's t-test" in line["3."]
    # equal means: no difference above BLEU's shown precision, whatever the seeds
    assert "DP_l > random: undecidable: difference 0.000 not above the metric's resolution 0.010" in line["4."]
    assert "DP_l-33 > Controllers 6E6D: undecidable" in line["5."]
    assert "DP_l-33 > Controllers 8E8D: holds (p = 0.001" in line["5."] and "Controllers 8E8D 10.0%" in line["5."]
    assert "**Verdicts under the significance rule:** none differs" in claims
    assert "DP_l uploads 50.1% ± 0.1 of FedAvg's parameters" in line["2."]
    assert "dp_l-count (clients, own domain)" in text


def test_nmt_doc_with_one_seed_judges_nothing(tmp_path):
    res = fake_nmt(tmp_path, [0])
    doc = tmp_path / "nmt.md"
    nmt.write_doc(tmp_path, res, doc, "cpu", "cmd", [0])
    text = doc.read_text()
    assert "±" not in text.split("## The paper's claims")[0]
    claims = text.split("## The paper's claims")[1].splitlines()
    numbered = [c for c in claims if c[:2] in ("1.", "2.", "3.", "4.", "5.")]
    assert len(numbered) == 5 and all("needs 2 seeds" in c for c in numbered)
    assert not any("holds" in c or "within spread" in c for c in numbered)


# ---------------------------------------------------------------- multitask


TASKS = [(c, t) for c in ("client_1", "client_2") for t in ("glue-sst2", "superglue-cb")]


def fake_run(run: Path, acc: float, loss: float = 1.0, gen: float = 0.0) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"client": c, "task": t, "metrics": {"acc": acc, "loss": loss}} for c, t in TASKS]
    (run / "results.json").write_text(json.dumps({"metric_spec": {"primary": "acc", "higher_is_better": True},
                                                  "test": {"rows": rows}, "wall_seconds": 120.0}))
    write_rounds(run, [{"round": 1, "clients": {"client_1": {"phase_seconds": {"training": 10.0,
                                                                               "before_training": gen}}}}])
    (run / "peak_rss.json").write_text(json.dumps({"peak_rss_gib": 1.5 + acc / 100, "threads": 1}))


def test_multitask_compares_each_seed_with_its_own_data_silo(tmp_path):
    mt.load_all()
    seeds = [0, 1]
    base = {0: 50.0, 1: 40.0}
    ratio = {"fewfedweight": (1.1, 1.1), "fedavg": (1.0, 0.9)}  # per seed, against that seed's Data Silo
    study = tmp_path / "study.toml"
    study.write_text("[study]\nname = 's'\n[base.client]\nepochs = 2\n[variants.data_silo]\n")
    variants = ["data_silo", *dict.fromkeys([*mt.TABLE1, *mt.TABLE2])]
    for seed in seeds:
        for v in variants:
            acc = base[seed] * ratio.get(v, (1.0, 1.0))[seed] if v != "data_silo" else base[seed]
            fake_run(mt.run_dir(tmp_path, v, seed, True), acc, gen=4.0 if v == "fewfedweight" else 0.0)
    text = mt.tables(tmp_path, study, seeds, variants)
    table1 = text.split("## Table 1")[1].split("##")[0]
    rows = {row.split(" | ")[0].strip("| "): row.split(" | ") for row in table1.splitlines() if row.startswith("| ")}
    assert rows["FewFedWeight"][1] == "+10.0% ± 0.0"  # seed 1 against seed 0's Data Silo would be −12%
    assert rows["FedAvg"][1] == "-5.0% ± 7.1" and rows["FedAvg"][3] == "2.0 ± 2.8"  # Lose: 0 then 4
    # +10% on both seeds vs −5% ± 7.1 with 2 seeds: beyond the spread, but Welch's t-test over 2 seeds
    # cannot tell it from chance; the doc marks what the spread rule said
    assert ("FewFedWeight beats FedAvg (FewFedWeight vs FedAvg): task metrics: not significant (p = 0.205, Welch's "
            "t-test over 2 vs 2 seeds; no per-item records) [the spread rule said: holds]") in text
    assert "**Verdicts under the significance rule:** 1 verdict(s) differ" in text
    assert "FewFedWeight beats Data Silo (APIR > 0): task metrics: holds (p < 0.001" in text
    assert "FewFedWeight beats Ditto (FewFedWeight vs Ditto): task metrics: holds (p < 0.001" in text
    # the same loss everywhere: APIR 0 on both sides, no difference above the shown 0.1 point
    assert "test loss: undecidable: difference 0.0000 not above the metric's resolution 0.0010" in text
    # Table 4: seconds per epoch (2 epochs): 10 s training → 5.0, generation 4 s → 2.0; peak RSS the largest
    table4 = text.split("## Table 4")[1].split("##")[0]
    assert "| FewFedWeight | 2.0 | 5.0 | 0.0 | 7.0 | 2.0 min | 2.05 GiB |" in table4
    assert "| glue-sst2 | acc | 45.0 ± 7.1 |" in text.split("## Every task")[1]


def test_multitask_doc_keeps_the_reading(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# old\n\nold tables\n\n## Reading\n\nwritten by hand.\n")
    mt.write_doc(doc, "## Table 1: new", "Scale: tiny.")
    text = doc.read_text()
    assert "old tables" not in text and "## Table 1: new" in text and text.endswith("## Reading\n\nwritten by hand.\n")


def test_multitask_runs_per_seed(tmp_path, monkeypatch):
    variants = mt.variants_of(mt.STUDY)
    assert "data_silo" in variants and not any("seed" in v for v in variants)  # the seeds are the yardstick
    from fedsilo.runs.studyfile import load_study
    cfg = load_study(mt.STUDY, only=["fewfedweight"], seed=2, multi_seed=True)[1]["fewfedweight"]
    assert cfg.seed == 2 and cfg.task.sample_seeds == [102]  # a seed draws another few-shot sample too
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "PEAK_RSS_KB 2097152\n", ""

    def fake(args, **kw):
        calls.append((args[3:], kw["env"]["OMP_NUM_THREADS"]))
        mt.run_dir(tmp_path, "fedavg", 1, True).mkdir(parents=True)
        return Done()

    monkeypatch.setattr(mt.subprocess, "run", fake)
    assert mt.run_variant("fedavg", tmp_path, mt.STUDY, 1, 1, True) is None
    assert calls == [([str(mt.STUDY), "fedavg", str(tmp_path), "1", "1"], "1")]
    assert json.loads((tmp_path / "fedavg" / "seed-1" / "peak_rss.json").read_text())["peak_rss_gib"] == 2.0
    (tmp_path / "fedavg" / "seed-1" / "results.json").write_text("{}")
    assert mt.run_variant("fedavg", tmp_path, mt.STUDY, 1, 1, True) is None and len(calls) == 1  # finished: skipped


def test_nmt_runs_each_seed_as_a_whole_chain(tmp_path, monkeypatch):
    import fedsilo.runs.runner as runner
    calls = []

    def fake(cfg, target, resume, show_progress):
        calls.append((cfg.name, cfg.seed, cfg.model.init_from, target))
        return {"seed": cfg.seed}

    monkeypatch.setattr(runner, "run_experiment", fake)
    res = nmt.run_all(tmp_path, "cpu", None, [0, 1])
    assert [c[1] for c in calls] == [0] * len(nmt.ORDER) + [1] * len(nmt.ORDER)  # seed 0 whole, then seed 1
    assert [c[3] for c in calls[len(nmt.ORDER):]] == [tmp_path / n / "seed-1" for n in nmt.ORDER]
    ran = [c[3] for c in calls]
    for name, seed, init, target in calls:  # each run starts from a run of its own seed, done before it
        if init is not None:
            assert init.endswith(f"/seed-{seed}") and ran.index(Path(init)) < ran.index(target), name
    assert res["fedavg"] == {0: {"seed": 0}, 1: {"seed": 1}}


def test_multitask_measure_runs_one_variant_and_seed(tmp_path, monkeypatch):
    """The subprocess script itself, on the toy study of tests/test_study.py (seconds)."""
    from tests.test_study import STUDY
    study = tmp_path / "toy.toml"
    study.write_text(STUDY)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert mt.run_variant("fedavg", tmp_path / "out", study, 1, 1, True) is None
    run = tmp_path / "out" / "fedavg" / "seed-1"
    assert json.loads((run / "results.json").read_text())["test"]["rows"]
    assert "seed = 1" in (run / "config.toml").read_text() and (run / "peak_rss.json").is_file()


def test_nmt_jobs_run_each_seed_chain_in_its_own_process_then_read_back(tmp_path, monkeypatch):
    calls = []

    class Done:
        returncode = 0

    def fake(command, env):
        calls.append((command[command.index("--seeds") + 1], command[command.index("--chain-threads") + 1],
                      env["OMP_NUM_THREADS"]))
        return Done()

    monkeypatch.setattr(nmt.subprocess, "run", fake)
    monkeypatch.setattr(nmt.os, "cpu_count", lambda: 4)
    nmt.run_chains(tmp_path, "cpu", "", [0, 1, 2], jobs=2)
    assert sorted(calls) == [("0", "2", "2"), ("1", "2", "2"), ("2", "2", "2")]

    import fedsilo.runs.runner as runner
    ran = []

    def fake_run(cfg, target, resume, show_progress):
        ran.append((cfg.engine.threads, cfg.engine.workers, target))
        return {"seed": cfg.seed}

    monkeypatch.setattr(runner, "run_experiment", fake_run)
    nmt.run_all(tmp_path, "cpu", None, [1], multi=True, threads=2)  # what one chain process does
    assert {r[:2] for r in ran} == {(2, 1)} and all(r[2].name == "seed-1" for r in ran)
    for name in nmt.ORDER:  # finished runs are read back from results.json, never resumed
        (tmp_path / name / "seed-0").mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "seed-0" / "results.json").write_text(json.dumps({"name": name}))
    ran.clear()
    res = nmt.run_all(tmp_path, "cpu", None, [0, 1])
    assert ran and all(r[2].name == "seed-1" for r in ran)  # seed 0: nothing re-run
    assert res["fedavg"] == {0: {"name": "fedavg"}, 1: {"seed": 1}}
