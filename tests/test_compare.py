"""PIR / APIR / Win-Lose-Tie (the FewFedWeight paper's Eq. 6 and Table 1 columns) on a hand-made table."""
import json

import pytest

from fedsilo.cli import main
from fedsilo.runs.compare import CompareError, compare


def _results(table, higher=True):
    return {"metric_spec": {"primary": "score", "higher_is_better": higher},
            "test": {"rows": [{"client": c, "task": t, "metrics": {"score": v}} for (c, t), v in table.items()]}}


BASE = {("c1", "a"): 50.0, ("c1", "b"): 20.0, ("c1", "c"): 10.0,
        ("c2", "d"): 40.0, ("c2", "e"): 0.0, ("c2", "f"): -20.0}
NEW = {("c1", "a"): 60.0, ("c1", "b"): 10.0, ("c1", "c"): 10.0,
       ("c2", "d"): 50.0, ("c2", "e"): 5.0, ("c2", "f"): -10.0}


def test_pir_apir_and_counts_by_hand():
    s = compare(_results(NEW), _results(BASE))
    pirs = {(r["client"], r["task"]): r["pir"] for r in s["rows"]}
    # c1: +10/50 = 0.2, -10/20 = -0.5, 0 → APIR_c1 = -0.1
    assert pirs[("c1", "a")] == pytest.approx(0.2) and pirs[("c1", "b")] == pytest.approx(-0.5)
    assert pirs[("c1", "c")] == 0.0
    # c2: 10/40 = 0.25; base 0 → undefined; MCC-like negative base: +10/|-20| = +0.5 → APIR_c2 = 0.375
    assert pirs[("c2", "e")] is None and pirs[("c2", "f")] == pytest.approx(0.5)
    assert s["clients"] == {"c1": pytest.approx(-0.1), "c2": pytest.approx(0.375)}
    assert s["apir"] == pytest.approx((-0.1 + 0.375) / 2)  # mean over clients, not over tasks
    assert (s["win"], s["lose"], s["tie"], s["undefined"]) == (4, 1, 1, 1)


def test_tie_tolerance_and_lower_is_better():
    s = compare(_results(NEW), _results(BASE), tie=10.0)
    assert (s["win"], s["lose"], s["tie"]) == (0, 0, 6)
    low = compare(_results({("c", "t"): 1.0}, higher=False), _results({("c", "t"): 2.0}, higher=False))
    assert low["rows"][0]["outcome"] == "win" and low["apir"] == pytest.approx(0.5)


def test_different_tasks_or_metrics_are_refused():
    with pytest.raises(CompareError, match="task 'b'"):
        compare(_results({("c1", "a"): 1.0}), _results({("c1", "a"): 1.0, ("c1", "b"): 2.0}))
    other = _results(BASE)
    other["metric_spec"]["primary"] = "em"
    with pytest.raises(CompareError, match="scored by"):
        compare(_results(NEW), other)
    with pytest.raises(CompareError, match="no test results"):
        compare({"test": {}}, _results(BASE))


def test_cli_prints_and_writes(tmp_path, capsys):
    for name, table in (("new", NEW), ("silo", BASE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_results(table)))
    assert main(["compare", str(tmp_path / "new"), "--baseline", str(tmp_path / "silo")]) == 0
    out = capsys.readouterr().out
    assert "APIR +13.8%" in out and "Win 4 / Lose 1 / Tie 1" in out and "| c2 | e | 0.00 | 5.00 | — | win |" in out
    saved = json.loads((tmp_path / "new" / "compare-silo.json").read_text())
    assert saved["apir"] == pytest.approx(0.1375) and (tmp_path / "new" / "compare-silo.md").is_file()


def test_cli_error_is_one_line(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    assert main(["compare", str(tmp_path / "a"), "--baseline", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error:") and "no results.json" in err and "Traceback" not in err
