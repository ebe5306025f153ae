"""Issue 50, a newcomer's traps with `fedsilo study`: a one-seed study judged as the docs say, more seeds
reusing the finished one-seed run, `[study] metrics` checked against the task, the output folder documented."""
import random
import re
from pathlib import Path

import pytest

import fedsilo.runs.runner as runner
from fedsilo.cli import parser
from fedsilo.config import ConfigError
from fedsilo.errors import RunDirError
from fedsilo.runs.study import run_study
from fedsilo.runs.studyfile import load_study
from fedsilo.tasks import TASKS
from tests.test_significance import write_items
from tests.test_study import STUDY, fake

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def _study_section() -> str:
    text = USAGE.read_text()
    return text.split("## Studies and seeds")[1].split("\n## ")[0]


def _faked(monkeypatch, items: bool) -> None:
    """Runs faked: each writes results (and, with `items`, per-item records), alone's MAP below fedavg's."""
    rnd = random.Random(0)
    aps = {name: {silo: [min(1.0, max(0.0, rnd.gauss(level, 0.2))) for _ in range(30)]
                  for silo in ("alpha", "beta", "gamma")} for name, level in (("alone", 0.4), ("fedavg", 0.6))}

    def run(cfg, out, **_):
        values = aps[cfg.name.split("/")[1]]
        if items:
            write_items(out, {(silo, "toyrank"): [{"ap_sum": a, "rr_sum": a, "p1_sum": 0.0, "questions": 1.0}
                                                  for a in v] for silo, v in values.items()})
        return fake({silo: 100 * sum(v) / len(v) for silo, v in values.items()})

    monkeypatch.setattr(runner, "run_experiment", run)


def _one_seed_study(tmp_path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map"]\nbaseline = "fedavg"'))
    return path


# ---------------------------------------------------------------- 1. a one-seed study is judged


def test_a_one_seed_study_judges_each_variant_over_the_runs_item_records(tmp_path, monkeypatch, capsys):
    """seeds = [0] with per-item records: the paired test the docs name, over the items of the one seed
    (no spread phrase: one value a side has none)."""
    _faked(monkeypatch, items=True)
    study = run_study(_one_seed_study(tmp_path), tmp_path / "study", only=["alone", "fedavg"],
                      show_progress=False, seeds=[0])
    printed = capsys.readouterr().out
    line = study["checks"][0]
    assert line.startswith("alone > fedavg (Overall MAP): ") and "spread" not in line
    assert line.endswith("paired randomisation (10000 trials) over 90 test items × 1 seed)") and ": reversed (p" in line
    assert study["baseline"] == "fedavg" and "spread" not in study  # cells are single values, not mean ± sd
    assert "Against fedavg (" in printed and line in printed
    assert "## Against fedavg" in (tmp_path / "study" / "report.md").read_text()


def test_a_one_seed_study_without_item_records_says_why_and_how_to_get_a_comparison(tmp_path, monkeypatch,
                                                                                    capsys):
    _faked(monkeypatch, items=False)
    study = run_study(_one_seed_study(tmp_path), tmp_path / "study", only=["alone", "fedavg"], show_progress=False)
    printed = capsys.readouterr().out
    line = study["checks"][0]
    assert line.endswith(": needs 2 seeds (no per-item records; a test over the seeds needs 2 or more a side: "
                         "run more, e.g. --seeds 0,1)")
    assert line in printed


# ---------------------------------------------------------------- 2. more seeds reuse the one-seed run


def test_more_seeds_reuse_the_finished_one_seed_run_and_back(tmp_path, capsys):
    """seeds = [0], then --seeds 0,1: seed 0 is the run in OUT/NAME (not trained again, not moved), only
    seed 1 runs; then one seed again at 1 finds OUT/NAME/seed-1. A changed config is never reused."""
    path = tmp_path / "s.toml"
    path.write_text(STUDY)
    out, fast = tmp_path / "study", ["federation.rounds=1"]
    one = run_study(path, out, fast, only=["fedavg"], show_progress=False, seeds=[0])
    kept = (out / "fedavg" / "checkpoint.pt").stat().st_mtime_ns
    capsys.readouterr()
    two = run_study(path, out, fast, only=["fedavg"], show_progress=False, seeds=[0, 1])
    printed = capsys.readouterr().out
    assert (out / "fedavg" / "checkpoint.pt").stat().st_mtime_ns == kept and not (out / "fedavg" / "seed-0").exists()
    assert f"toy-study: fedavg seed 0 → {out / 'fedavg'} (its one-seed run, reused)" in printed
    assert two["runs"]["fedavg"] == {"0": str(out / "fedavg"), "1": str(out / "fedavg" / "seed-1")}
    assert two["per_seed"]["fedavg"]["0"]["overall"] == one["per_seed"]["fedavg"]["0"]["overall"]
    assert "[seed 0](fedavg/report.md), [seed 1](fedavg/seed-1/report.md)" in (out / "report.md").read_text()
    kept = (out / "fedavg" / "seed-1" / "checkpoint.pt").stat().st_mtime_ns
    back = run_study(path, out, fast, only=["fedavg"], show_progress=False, seeds=[1])
    assert (out / "fedavg" / "seed-1" / "checkpoint.pt").stat().st_mtime_ns == kept
    assert back["runs"]["fedavg"] == {"1": str(out / "fedavg" / "seed-1")}
    with pytest.raises(RunDirError, match="config differs"):  # another lr: not seed 0's run, refused as before
        run_study(path, out, [*fast, "client.lr=2e-3"], only=["fedavg"], show_progress=False, seeds=[0])


# ---------------------------------------------------------------- 3. metric names


def test_a_study_metric_the_task_lacks_is_refused_listing_the_tasks_metrics(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(STUDY.replace('metrics = ["map", "mrr"]', 'metrics = ["map", "ppl"]'))
    with pytest.raises(ConfigError, match=re.escape(
            "[study] metrics: 'ppl' is not a metric of the toyrank task (its metrics: map, mrr, p1)")):
        load_study(path)


@pytest.mark.parametrize("task", ["text2sql", "translation", "matching", "multitask", "instruct"])
def test_usage_lists_each_tasks_study_metrics_as_its_spec_has_them(task):
    spec = TASKS.get(task).spec()
    keys = ", ".join(f"`{c.key}`" for c in spec.columns)
    assert f"- {task}: {keys}" in _study_section()


# ---------------------------------------------------------------- 4. the output folder


def test_usage_and_help_say_a_study_writes_to_runs_stem_not_its_name():
    section = _study_section()
    assert "`runs/STEM`" in section and "not `[study] name`" in section
    help_text = parser()._subparsers._group_actions[0].choices["study"].format_help()
    assert "not [study] name" in " ".join(help_text.split())


def test_a_claim_about_a_lower_is_better_metric_points_down_whichever_metric_comes_first():
    """Found while fixing the study's metric names: a study whose first metric was a loss other than the
    task's primary one (instruct's ppl; translation's or text2sql's loss) was judged as if higher were
    better, so a variant with a worse perplexity "beat" its baseline. Each column now says its direction;
    results.json written before (no direction on its columns) keep the old reading of the primary."""
    import fedsilo.builtins  # noqa: F401  (the tasks' registry)
    from fedsilo.rundir.records import higher_is_better
    from fedsilo.tasks import TASKS

    spec = {name: TASKS.get(name).spec().describe() for name in ("instruct", "translation", "text2sql", "matching")}
    assert not higher_is_better(spec["instruct"], "ppl") and not higher_is_better(spec["instruct"], "loss")
    assert higher_is_better(spec["instruct"], "em") and higher_is_better(spec["instruct"], "acc")
    assert not higher_is_better(spec["translation"], "loss") and higher_is_better(spec["translation"], "chrf")
    assert not higher_is_better(spec["text2sql"], "loss") and higher_is_better(spec["text2sql"], "exec")
    assert not higher_is_better(spec["matching"], "loss") and higher_is_better(spec["matching"], "mrr")
    old = {"primary": "loss", "higher_is_better": False, "columns": [{"key": "loss", "label": "loss"}]}
    assert not higher_is_better(old, "loss") and higher_is_better(old, "em")
