"""Claims are judged by the field's significance tests (issue 41), never below the metric's resolution.

The per-item records are built here in tmp_path, in the shared format (`<run>/items/test.jsonl`: one
line per evaluation row with `client`, `task`, `split`, `ids`, `stats`)."""
from __future__ import annotations

import hashlib
import json
import math
import random
from fractions import Fraction
from itertools import product

import numpy as np
import pytest

from fedsilo.runs import significance as sig
from fedsilo.runs.spread import claim, claim_lines
from fedsilo.tasks.matching.metrics import compute as matching_compute
from fedsilo.tasks.translation.metrics import bleu_stats, compute_metrics as translation_compute


def map_of(stats):
    return matching_compute(stats)["map"]


def bleu_of(stats):
    return translation_compute(stats)["bleu"]


def chrf_of(stats):
    return translation_compute(stats)["chrf"]


def item_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_items(run, rows):
    """rows: {(client, task): [item stats]} → run/items/test.jsonl (ids from the item's position)."""
    (run / "items").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"client": c, "task": t, "split": "test", "ids": [item_id(f"{c}:{i}") for i in range(len(s))],
                         "stats": s}) for (c, t), s in rows.items()]
    (run / "items" / "test.jsonl").write_text("\n".join(lines) + "\n")


def translations(seed: int, n: int = 40):
    """Fixed hypotheses of a baseline and a system against references (the system a little closer)."""
    rnd = random.Random(seed)
    words = "the cat sat on a mat dog ran to house big small red blue tree under over with".split()
    refs = [" ".join(rnd.choice(words) for _ in range(rnd.randint(5, 12))) for _ in range(n)]

    def noisy(ref: str, keep: float) -> str:
        return " ".join(w if rnd.random() < keep else rnd.choice(words) for w in ref.split())

    return refs, [noisy(r, 0.55) for r in refs], [noisy(r, 0.65) for r in refs]


def sentence_items(hyps, refs):
    return [bleu_stats([h], [r]) for h, r in zip(hyps, refs)]


# ---------------------------------------------------------------- sacreBLEU's own paired bootstrap

class Float64:
    """numpy as sacreBLEU's significance module sees it, its float32 arrays made float64."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def array(values, dtype=None):
        return np.array(values, dtype=float)


def sacrebleu_paired_bs(name, refs, base, system):
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    metric = BLEU() if name == "BLEU" else CHRF()
    _, scores = PairedTest([("base", base), ("system", system)], {name: metric}, [refs], test_type="bs",
                           n_samples=1000)()
    return next(v for k, v in scores.items() if k != "System")  # (baseline, system) Results


@pytest.mark.parametrize("name,score", [("BLEU", bleu_of), ("chrF", chrf_of)])
def test_paired_bootstrap_equals_sacrebleus_paired_bs(name, score, monkeypatch):
    """sacreBLEU's own paired_bs on the same hypotheses: same seed (12345), 1000 resamples."""
    import sacrebleu.significance

    monkeypatch.delenv("SACREBLEU_SEED", raising=False)  # its default seed, 12345
    refs, base, system = translations(7)
    xs, xb = sentence_items(system, refs), sentence_items(base, refs)
    mats, layout, _ = sig.stack([{("d", None): (["i"] * len(xs), xs)}, {("d", None): (["i"] * len(xb), xb)}],
                                [("d", None)])
    ours = sig.paired_bootstrap([mats[0]], [mats[1]], score, layout)
    theirs_base, theirs = sacrebleu_paired_bs(name, refs, base, system)
    assert ours.p == pytest.approx(theirs.p_value, abs=1e-9) and 0 < ours.p < 1
    assert ours.difference == pytest.approx(theirs.score - theirs_base.score, abs=1e-9)
    # as shipped, sacreBLEU scores each resample from float32 arrays (its BLEU and chrF then divide in
    # float32); the task's metric divides in float64, so the intervals agree to float32's precision ...
    assert ours.a == pytest.approx((theirs.mean, theirs.ci), rel=1e-5)
    assert ours.b == pytest.approx((theirs_base.mean, theirs_base.ci), rel=1e-5)
    # ... and to 1e-9 when sacreBLEU's same code runs on float64 arrays
    monkeypatch.setattr(sacrebleu.significance, "np", Float64())
    theirs_base, theirs = sacrebleu_paired_bs(name, refs, base, system)
    assert ours.p == pytest.approx(theirs.p_value, abs=1e-9)
    assert ours.a == pytest.approx((theirs.mean, theirs.ci), abs=1e-9)
    assert ours.b == pytest.approx((theirs_base.mean, theirs_base.ci), abs=1e-9)


# ---------------------------------------------------------------- paired randomisation

def test_exact_randomisation_equals_an_enumeration_in_exact_arithmetic():
    """Two silos (3 and 4 questions, one of them dropped), two seeds: every one of the 2^7 swaps,
    MAP computed here with fractions, p = share of swaps at least as extreme."""
    aps = {  # side → seed → unit → item APs (None: a dropped question)
        "a": [[[1, Fraction(1, 2), 1], [1, Fraction(1, 3), None, 1]], [[1, 1, Fraction(1, 2)], [1, 1, None, 1]]],
        "b": [[[Fraction(1, 2), Fraction(1, 2), 1], [Fraction(1, 3), Fraction(1, 3), None, 1]],
              [[1, Fraction(1, 3), Fraction(1, 2)], [Fraction(1, 2), 1, None, Fraction(1, 4)]]]}

    def stats(ap):
        return {"dropped": 1.0} if ap is None else {"ap": float(ap), "questions": 1.0, "rr": 1.0}

    def overall(side):  # mean over seeds of the mean over silos of MAP
        return sum(sum(sum(x for x in u if x is not None) / sum(x is not None for x in u) for u in seed) / 2
                   for seed in side) / len(side)

    real = overall(aps["a"]) - overall(aps["b"])
    sizes, extreme = [3, 4], 0
    for pattern in product((False, True), repeat=7):
        swaps = [pattern[:3], pattern[3:]]
        sa = [[[y if s else x for x, y, s in zip(ua, ub, sw)] for ua, ub, sw in zip(seed_a, seed_b, swaps)]
              for seed_a, seed_b in zip(aps["a"], aps["b"])]
        sb = [[[x if s else y for x, y, s in zip(ua, ub, sw)] for ua, ub, sw in zip(seed_a, seed_b, swaps)]
              for seed_a, seed_b in zip(aps["a"], aps["b"])]
        extreme += abs(overall(sa) - overall(sb)) >= abs(real)
    expected = extreme / 2 ** 7

    units = [("s1", None), ("s2", None)]
    runs = [{u: ([f"{u[0]}{i}" for i in range(n)], [stats(ap) for ap in seed[k]])
             for k, (u, n) in enumerate(zip(units, sizes))} for side in ("a", "b") for seed in aps[side]]
    mats, layout, _ = sig.stack(runs, units)
    diff, p, exact = sig.paired_randomisation(mats[:2], mats[2:], map_of, layout)
    assert exact and diff == pytest.approx(float(real), abs=1e-12)
    assert p == pytest.approx(float(expected), abs=1e-9) and 0 < p < 1


def test_randomisation_equals_a_plain_numpy_computation_with_the_same_draws():
    """40 questions, three seeds, sacreBLEU's draws (default_rng(12345).integers(2, (10000, 40), bool))."""
    rnd = np.random.default_rng(3)
    a = rnd.uniform(0.3, 1.0, size=(3, 40))
    b = np.clip(a - rnd.uniform(-0.1, 0.2, size=(3, 40)), 0.05, 1.0)
    masks = np.random.default_rng(12345).integers(2, size=(10000, 40), dtype=bool)
    real = a.mean() - b.mean()
    ta = np.where(masks[None], b[:, None, :], a[:, None, :]).mean(axis=2).mean(axis=0)
    tb = np.where(masks[None], a[:, None, :], b[:, None, :]).mean(axis=2).mean(axis=0)
    expected = (np.sum(np.abs(ta - tb) >= abs(real) - 1e-12) + 1) / 10001

    unit = ("q", None)
    runs = [{unit: ([str(i) for i in range(40)], [{"ap": float(v), "questions": 1.0} for v in seed])}
            for side in (a, b) for seed in side]
    mats, layout, _ = sig.stack(runs, [unit])
    diff, p, exact = sig.paired_randomisation(mats[:3], mats[3:], map_of, layout)
    assert not exact and diff == pytest.approx(real, abs=1e-12)
    assert p == pytest.approx(expected, abs=1e-9) and p < 0.05


# ---------------------------------------------------------------- resolution

def test_seeds_that_agree_at_the_floor_are_undecidable_not_holds():
    """The issue's case: 0.03 ± 0.00 vs 0.02 ± 0.00 BLEU with 2 seeds was declared "holds"."""
    verdict = claim([0.03, 0.03], [0.02, 0.02], ".2f")
    assert verdict.startswith("undecidable: difference 0.010 not above the metric's resolution 0.010")
    assert "holds" not in verdict
    # above the shown precision, the same agreement is a finding, with its test and p
    assert claim([0.05, 0.05], [0.02, 0.02], ".2f").startswith("holds (p < 0.001, Welch's t-test over 2 vs 2 seeds")


def test_an_item_mean_difference_below_one_items_worth_is_undecidable_even_when_seeds_agree(tmp_path):
    """Both seeds: the same 40 questions (APs 0.5 or 1.0), one question's AP 0.5 → 0.75: MAP +0.25/40,
    below one item's worth, (1.0 − 0.5)/40."""
    unit = ("s", None)
    base = [{"ap": 1.0 if i % 2 else 0.0 + 0.5, "questions": 1.0} for i in range(40)]
    better = [dict(s) for s in base]
    better[0]["ap"] = 0.75
    runs = {}
    for side, items in (("better", better), ("base", base)):
        for seed in (0, 1):
            write_items(tmp_path / side / f"seed-{seed}", {unit: items})
            runs.setdefault(side, {})[str(seed)] = str(tmp_path / side / f"seed-{seed}")
    a = [sig.read_items(tmp_path / "better" / f"seed-{s}") for s in (0, 1)]
    b = [sig.read_items(tmp_path / "base" / f"seed-{s}") for s in (0, 1)]
    verdict = sig.judge_items(a, b, [unit], map_of, ".4f")
    assert verdict.outcome == sig.UNDECIDABLE and verdict.resolution == pytest.approx(0.5 / 40)
    assert verdict.difference == pytest.approx(0.25 / 40)
    # the old rule called it a finding: both seeds agree exactly, so the gap is "beyond" zero spread
    per_seed = {name: {s: {"overall": {"map": map_of({"ap": sum(x["ap"] for x in items), "questions": 40.0})}}
                       for s in ("0", "1")} for name, items in (("base", base), ("better", better))}
    line = claim_lines(per_seed, "base", "map", "MAP", ".4f", runs=runs, units=[unit], score=map_of)[0]
    assert "beyond spread: undecidable: difference" in line and "randomisation" in line


# ---------------------------------------------------------------- the verdict from per-item records

def test_claim_lines_judge_over_test_items_when_records_exist_and_fall_back_otherwise(tmp_path):
    refs, base, system = translations(11, 60)
    unit = ("news", None)
    runs: dict = {}
    for side, hyps in (("fedavg", system), ("alone", base)):
        for seed in (0, 1):
            write_items(tmp_path / side / f"seed-{seed}", {unit: sentence_items(hyps, refs)})
            runs.setdefault(side, {})[str(seed)] = str(tmp_path / side / f"seed-{seed}")
    pooled = {side: bleu_of(bleu_stats(hyps, refs)) for side, hyps in (("fedavg", system), ("alone", base))}
    per_seed = {name: {s: {"overall": {"bleu": v}} for s in ("0", "1")} for name, v in pooled.items()}
    line = claim_lines(per_seed, "alone", "bleu", "BLEU", ".2f", runs=runs, units=[unit], score=bleu_of)[0]
    assert "paired bootstrap (1000 resamples, sacreBLEU's) over 60 test items × 2 seeds" in line
    assert line.split(": ", 1)[1].split(", gap")[0] == f"{pooled['fedavg']:.2f} ± 0.00 vs {pooled['alone']:.2f} ± 0.00"
    # one run without records: the seeds' test, saying why
    (tmp_path / "alone" / "seed-1" / "items" / "test.jsonl").unlink()
    line = claim_lines(per_seed, "alone", "bleu", "BLEU", ".2f", runs=runs, units=[unit], score=bleu_of)[0]
    assert "Welch's t-test over 2 vs 2 seeds; no per-item records" in line


def test_records_of_different_test_items_are_refused_for_pairing(tmp_path):
    unit = ("s", None)
    write_items(tmp_path / "a", {unit: [{"ap": 1.0, "questions": 1.0}] * 3})
    write_items(tmp_path / "b", {unit: [{"ap": 0.5, "questions": 1.0}] * 3})
    b = sig.read_items(tmp_path / "b")
    b[unit] = (["x", "y", "z"], b[unit][1])
    with pytest.raises(sig.ItemsError, match="test items differ"):
        sig.judge_items([sig.read_items(tmp_path / "a")], [b], [unit], map_of, ".4f")
    (tmp_path / "b" / "items" / "test.jsonl").write_text('{"client": "s", "ids": [1]}\n')
    with pytest.raises(sig.ItemsError, match="line 1: not a per-item record"):
        sig.read_items(tmp_path / "b")
    assert sig.read_items(tmp_path / "none") is None


def test_welch_p_is_the_textbook_formula_and_a_side_needs_two_seeds():
    from scipy.stats import t as student

    a, b = [0.61, 0.64, 0.66], [0.55, 0.60, 0.57]
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 3
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    verdict = sig.judge_seeds(a, b, ".4f")
    assert verdict.p == pytest.approx(2 * student.sf(abs(t), df), abs=1e-9) and verdict.outcome == sig.HOLDS
    assert sig.judge_seeds(b, a, ".4f").outcome == sig.REVERSED
    assert sig.judge_seeds([0.61, 0.58], [0.60, 0.57], ".4f").outcome == sig.NOT_SIGNIFICANT
    assert claim([1.0], [0.0, 0.1]) == "needs 2 seeds"


def test_item_mean_is_told_from_a_corpus_metric_by_the_data():
    refs, base, _ = translations(5, 20)
    items = sentence_items(base, refs)
    mats, layout, _ = sig.stack([{("d", None): (["i"] * 20, items)}], [("d", None)])
    assert not sig.is_item_mean(bleu_of, layout, mats[0])
    aps = [{"ap": x, "questions": 1.0} for x in (1.0, 0.5, 1 / 3)] + [{"dropped": 1.0}]
    mats, layout, _ = sig.stack([{("q", None): (["i"] * 4, aps)}], [("q", None)])
    assert sig.is_item_mean(map_of, layout, mats[0])


def test_a_study_judges_its_claims_over_the_runs_item_records(tmp_path, monkeypatch):
    """Through `run_study` (runs faked, each writing its results and per-item records): the check names
    the randomisation test over every silo's items and both seeds, at `[study] alpha`."""
    import fedsilo.runs.runner as runner
    from fedsilo.runs.study import run_study
    from tests.test_study import STUDY, fake

    rnd = random.Random(0)
    aps = {name: {seed: {silo: [min(1.0, max(0.0, rnd.gauss(level, 0.2))) for _ in range(30)]
                         for silo in ("alpha", "beta", "gamma")} for seed in (0, 1)}
           for name, level in (("alone", 0.4), ("fedavg", 0.6))}

    def run(cfg, out, **_):
        items = aps[cfg.name.split("/")[1]][cfg.seed]
        write_items(out, {(silo, "toyrank"): [{"ap_sum": a, "rr_sum": a, "p1_sum": 0.0, "questions": 1.0}
                                              for a in values] for silo, values in items.items()})
        return fake({silo: 100 * sum(v) / len(v) for silo, v in items.items()})

    monkeypatch.setattr(runner, "run_experiment", run)
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map"]\nbaseline = "fedavg"\nalpha = 0.01'))
    study = run_study(path, tmp_path / "study", only=["alone", "fedavg"], show_progress=False, seeds=[0, 1])
    assert study["alpha"] == 0.01 and "p < 0.01" in study["rule"]
    line = study["checks"][0]
    assert line.startswith("alone > fedavg (Overall MAP): ")
    assert line.endswith("paired randomisation (10000 trials) over 90 test items × 2 seeds)") and ": reversed (p" in line


@pytest.mark.parametrize("alpha", ["1.5", "0", "true", '"0.05"', "nan"])
def test_a_study_alpha_outside_0_1_is_refused_naming_it(tmp_path, alpha):
    from fedsilo.config import ConfigError
    from fedsilo.runs.studyfile import load_study
    from tests.test_study import STUDY

    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', f'metrics = ["map"]\nalpha = {alpha}'))
    with pytest.raises(ConfigError, match=r"s\.toml: \[study\]: alpha: .* \(got .*\)$") as err:
        load_study(path)
    assert "\n" not in str(err.value)


def test_a_lower_loss_holds_and_a_higher_one_is_reversed():
    """Where lower is better (a loss), the claim reads "variant < baseline" and "holds" still means the
    variant is better: a study of losses once reported every worse variant as holding."""
    per_seed = {"alone": {s: {"overall": {"loss": v}} for s, v in zip("012", (5.00, 5.02, 4.98))},
                "better": {s: {"overall": {"loss": v}} for s, v in zip("012", (4.00, 4.03, 3.98))},
                "worse": {s: {"overall": {"loss": v}} for s, v in zip("012", (6.00, 6.01, 5.97))}}
    better, worse = claim_lines(per_seed, "alone", "loss", "loss", ".4f", higher_is_better=False)
    assert better.startswith("better < alone (Overall loss)") and ": holds (" in better
    assert worse.startswith("worse < alone (Overall loss)") and ": reversed (" in worse
    upward = claim_lines(per_seed, "alone", "loss", "loss", ".4f")  # read as a score: the other way round
    assert ": reversed (" in upward[0] and ": holds (" in upward[1]
