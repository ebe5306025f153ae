"""bench/gpu_suite.py (`make gpu-check`) on a CPU machine, and bench/instruct_throughput.py's adaptive stop rule.

The suite itself needs a CUDA GPU, so these tests check what can go wrong before one is lent: the one-line
refusal, that every command it would run names a file that exists and passes flags its target's own parser
accepts (a misspelled flag is caught), that part 4's config and overrides pass fedsilo's validation, and that
the markdown table has one row per part whatever the parts' fates.
"""
import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SUITE = BENCH / "gpu_suite.py"


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def suite(bench_path):
    import gpu_suite
    return gpu_suite


@pytest.fixture(scope="module")
def throughput(bench_path):
    import instruct_throughput
    return instruct_throughput


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, stdin=subprocess.DEVNULL)


# --- the suite -------------------------------------------------------------------------------------------------

def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the suite would run")
    done = _run()
    said = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(said) == 1, said
    assert "CUDA" in said[0] and "Traceback" not in done.stdout + done.stderr
    assert "--dry-run" in said[0] and "test_aggregate.py" in said[0]


def test_dry_run_lists_the_four_parts_each_checked(tmp_path):
    done = _run("--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    parts = [ln for ln in lines if ln.startswith("part ")]
    assert [ln.split()[2] for ln in parts] == ["tests", "engine", "instruct", "smollm2"], parts
    assert sum(ln.strip() == "check: flags accepted" for ln in lines) == 4, done.stdout
    for line in parts:
        argv = shlex.split(line.split(": ", 1)[1])
        assert argv[0] == "python"
        if argv[1] == "-m":
            assert argv[2] in ("pytest", "fedsilo")
            for test_file in (a for a in argv if a.startswith("tests/")):
                assert (REPO / test_file).is_file(), test_file
        else:
            assert (REPO / argv[1]).is_file(), argv[1]


def test_the_cuda_tests_are_found_by_their_skip(suite, tmp_path):
    found = suite.cuda_test_files()
    assert {"tests/test_aggregate.py", "tests/test_server_opt.py"} <= set(found)
    assert "tests/test_gpu_suite.py" not in found  # mentions the marker only in a regex
    (tmp_path / "test_gpu_only.py").write_text(
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')\ndef test_x(): pass\n")
    (tmp_path / "test_cpu_only.py").write_text("def test_y():\n    if torch.cuda.is_available(): pytest.skip('x')\n")
    assert suite.cuda_test_files(tmp_path) == ["tests/test_gpu_only.py"]


@pytest.mark.parametrize("bnb", [True, False], ids=["bitsandbytes", "no-bitsandbytes"])
def test_every_command_passes_its_targets_parser(suite, tmp_path, bnb):
    parts = suite.plan(tmp_path, bnb=bnb)
    assert [p.name for p in parts] == ["tests", "engine", "instruct", "smollm2"]
    suite.write_smollm2_config(parts[3].outputs["config"])
    for part in parts:
        assert suite.check_part(part) is None, (part.name, suite.check_part(part))
    configs = parts[2].argv[parts[2].argv.index("--configs") + 1]
    assert configs == ("bf16-lora,qlora" if bnb else "bf16-lora")
    assert any("pip install fedsilo[gpu]" in n for n in parts[2].notes) != bnb
    assert "--precisions" in parts[1].argv and "bf16" in parts[1].argv[parts[1].argv.index("--precisions") + 1]


def test_the_check_refuses_what_a_target_would(suite, tmp_path):
    parts = suite.plan(tmp_path, bnb=True)
    suite.write_smollm2_config(parts[3].outputs["config"])

    def broken(index, old, new):
        part = copy.deepcopy(parts[index])
        part.argv[part.argv.index(old)] = new
        return suite.check_part(part)

    assert "--warm-up" in broken(1, "--warmup", "--warm-up")            # a misspelled flag
    assert "invalid int" in broken(2, "10", "ten")                      # a bad value (--steps 10)
    assert "qlora4" in broken(2, "bf16-lora,qlora", "bf16-lora,qlora4")  # a config the script does not know
    assert "precison" in broken(3, "model.precision=bf16", "model.precison=bf16")  # a config key fedsilo refuses
    assert "missing" in broken(0, "tests/test_aggregate.py", "tests/test_no_such_module.py")


def test_the_test_part_collects_with_its_exact_flags(suite, tmp_path):
    part = suite.plan(tmp_path, bnb=False)[0]
    done = subprocess.run([sys.executable, *part.argv, "--collect-only"], capture_output=True, text=True,
                          timeout=300, cwd=REPO, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_sums_live_on_the_global_tensors_device" in done.stdout  # the CUDA-only case is among them


def test_markdown_has_one_row_per_part_whatever_befell_it(suite):
    record = {
        "command": "python bench/gpu_suite.py", "date": "2026-12-01T10:00:00+00:00", "seconds": 431.0, "budget_s": 480,
        "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.6, "torch": "2.13.0", "cuda": "12.8"},
        "parts": [
            {"name": "tests", "title": "CUDA tests", "command": "python -m pytest tests/test_aggregate.py", "budget_s": 60,
             "seconds": 21.0, "status": "ok", "returncode": 0, "notes": [],
             "numbers": {"passed": 83, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": [],
                         "files": ["tests/test_aggregate.py", "tests/test_server_opt.py"]}},
            {"name": "engine", "title": "client loop vs bare loop", "command": "python bench/gpu_throughput.py",
             "budget_s": 100, "seconds": 12.0, "status": "failed", "returncode": 1, "notes": [], "numbers": None,
             "output_tail": "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory | x"},
            {"name": "instruct", "title": "instruction tuning at 0.95B", "command": "python bench/instruct_gpu.py",
             "budget_s": 170, "seconds": 140.0, "status": "ok", "returncode": 0,
             "notes": ["qlora skipped: pip install fedsilo[gpu]"],
             "numbers": {"params": 953_000_000, "notes": [], "qlora": "skipped: pip install fedsilo[gpu]",
                         "configs": {"bf16-lora": {"ratio": 0.9731, "tokens_per_s": {"fedsilo": 20100.0, "bare": 20655.0},
                                                   "peak_gib": {"fedsilo": 11.2, "bare": 10.9}}}}},
            {"name": "smollm2", "title": "SmolLM2 federated LoRA", "command": "python -m fedsilo run x.toml",
             "budget_s": 130, "seconds": 130.4, "limit_s": 130, "status": "timed out", "returncode": None, "notes": [],
             "numbers": None, "output_tail": "round 2/3"},
        ]}
    for part in record["parts"]:
        part["summary"] = suite.summarize(part)
    table = suite.markdown(record)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| #")]
    assert len(rows) == 4, table
    header = next(ln for ln in table.splitlines() if ln.startswith("| #"))
    cells = lambda ln: len(ln.replace("\\|", "").split("|"))  # noqa: E731 - an escaped pipe stays in its cell
    assert all(cells(r) == cells(header) for r in rows), table
    assert "83 passed, 0 failed, 0 skipped" in rows[0]
    assert "failed (exit 1)" in rows[1] and "CUDA out of memory" in rows[1]
    assert "0.973" in rows[2] and "20,100 vs 20,655 tokens/s" in rows[2] and rows[2].count("pip install fedsilo[gpu]") == 1
    assert "timed out after 130 s" in rows[3] and "round 2/3" in rows[3]
    assert "NVIDIA H100 80GB HBM3" in table and "CUDA 12.8" in table
    json.dumps(record)  # the record the suite writes is plain JSON


# --- bench/instruct_throughput.py: the adaptive stop rule ------------------------------------------------------

def test_ratios_all_above_the_goal_stop_and_hold(throughput):
    t = throughput
    wall, cpu = [1.02, 0.97, 1.10], [0.99, 1.01, 0.96]
    assert not t.should_stop(wall[:2], cpu[:2], 0.95, min_pairs=3, max_pairs=6)  # too few pairs yet
    assert t.should_stop(wall, cpu, 0.95, min_pairs=3, max_pairs=6)
    assert t.judge(wall) == "holds" and t.verdict(wall) == ">= 0.95 holds"
    assert t.judge([0.95, 0.96, 0.97]) == "holds"  # the goal itself is met (>=)


def test_ratios_all_below_the_goal_stop_and_say_below(throughput):
    t = throughput
    wall, cpu = [0.80, 0.91, 0.94], [0.70, 0.90, 0.949]
    assert t.should_stop(wall, cpu, 0.95, 3, 6)
    assert t.verdict(wall) == "below 0.95" and t.judge(cpu) == "below"


def test_an_overlapping_spread_continues_to_the_maximum(throughput):
    t = throughput
    ratios = [1.01, 0.93, 1.05, 0.99, 1.00]
    stopped_at = next(n for n in range(1, len(ratios) + 1)
                      if t.should_stop(ratios[:n], [1.1] * n, 0.95, min_pairs=3, max_pairs=5))
    assert stopped_at == 5
    assert t.verdict(ratios) == "spread overlaps 0.95 after 5 repeats"


def test_one_metric_undecided_keeps_going(throughput):
    t = throughput
    assert not t.should_stop([1.1, 1.2, 1.15], [0.9, 1.0, 0.97], 0.95, 3, 6)  # wall holds, CPU overlaps
    assert t.should_stop([1.1, 1.2, 1.15], [0.9, 1.0, 0.97], 0.95, 3, 3)      # ... until the maximum


def test_the_interval_and_its_coverage(throughput):
    t = throughput
    assert t.interval([1.0, 0.9, 1.2]) == (0.9, 1.2)
    assert t.coverage(1) == 0.0 and t.coverage(3) == 0.75 and t.coverage(6) == pytest.approx(31 / 32)


def test_defaults_depend_on_the_model(throughput, tmp_path):
    _, tiny = throughput.parse_args([])
    assert (tiny.batch_size, tiny.steps, tiny.warmup, tiny.model) == (8, 8, 1, None)
    assert "--model" not in throughput.passthrough(tiny)
    _, ckpt = throughput.parse_args(["--model", str(tmp_path), "--steps", "2"])
    assert (ckpt.batch_size, ckpt.steps) == (4, 2)
    assert throughput.passthrough(ckpt)[:2] == ["--model", str(tmp_path)]
    cfg = throughput.run_config(ckpt, lora=True)
    assert cfg.model.kind == "causal" and cfg.model.name == str(tmp_path)
    assert cfg.client.steps == 2 and throughput.run_config(ckpt, lora=False, steps=1).client.steps == 1
    with pytest.raises(SystemExit):
        throughput.parse_args(["--repeats", "4", "--max-repeats", "3"])
