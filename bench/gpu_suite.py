"""One GPU check (`make gpu-check`): fedsilo's CUDA paths and its GPU benchmarks in one command, at most 8 minutes.

On a CUDA GPU it runs four parts, each a subprocess with its own time budget (killed, with its process
group, when it runs past it; a part that fails or times out is recorded as such and the next one runs):
1. tests: `python -m pytest -q -o addopts="" -p no:cacheprovider` on every test module with a CUDA-only case
   (a `skipif(not torch.cuda.is_available())`: found by reading tests/), counting passed / failed / skipped;
2. engine: bench/gpu_throughput.py at fp32 and bf16 (the 59.7M T5, ATIS, batch 32; 20 timed steps after 3,
   2 repeats): fedsilo's client loop against a tuned bare loop, examples/s and their ratio;
3. instruct: bench/instruct_gpu.py at a 0.95B random-init Llama (hidden 2048, 16 layers): bf16 + LoRA and 4-bit
   QLoRA (QLoRA only where bitsandbytes is installed, else recorded "skipped: pip install fedsilo[gpu]"),
   fedsilo's client round against a bare transformers + peft loop, tokens/s, peak GPU memory;
4. smollm2: `python -m fedsilo run` of SmolLM2-135M-Instruct (the built-in smollm2-135m-instruct) federated
   LoRA: experiments/instruct/smollm2.toml's [base] with its [variants.fedavg] (3 silos, LoRA rank 8 on every
   projection), 3 rounds, on the GPU in bf16, 8 dev/test records a silo: wall time, rounds, the test table.
Every subprocess runs with FLWR_TELEMETRY_ENABLED=0. It writes one JSON (`--json`) with each part's
command, budget, seconds, status and numbers, the GPU's name and memory, torch and CUDA versions and the
date (rewritten after each part, so an interrupted suite leaves what it did), and prints a markdown table
for docs/benchmarks.md (also written with `--markdown FILE`).

Without CUDA it prints one line saying so and exits 2. `--dry-run` (any machine) prints the commands and
checks each one's flags against its target's own argument parser (and part 4's config and overrides
against fedsilo's validation), running nothing.

    python bench/gpu_suite.py                                   # on a CUDA GPU; make gpu-check
    python bench/gpu_suite.py --markdown /tmp/gpu.md --json bench/results/gpu_suite.json
    python bench/gpu_suite.py --dry-run                         # the commands, checked; no GPU needed
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TESTS = REPO / "tests"
SMOLLM2_STUDY = REPO / "experiments" / "instruct" / "smollm2.toml"
SMOLLM2_VARIANT = "fedavg"  # LoRA rank 8 / alpha 16 on every projection, FedAvg
SMOLLM2_SET = ("federation.rounds=3", "federation.eval_every=1", "task.max_eval=8", "model.device=cuda",
               "model.precision=bf16")
TOTAL_BUDGET = 480  # seconds, all parts together
CUDA_ONLY = re.compile(r"^\s*(@pytest\.mark\.skipif|pytestmark\s*=\s*pytest\.mark\.skipif)\(\s*not\s+torch\.cuda\."
                       r"is_available\(\)", re.M)  # a test (or a module) marked to run only on CUDA
QLORA_SKIP = "skipped: pip install fedsilo[gpu]"
ENV = {"FLWR_TELEMETRY_ENABLED": "0"}


@dataclass
class Part:
    name: str
    title: str
    argv: list[str]            # after the Python interpreter
    budget: int                # seconds
    target: str                # what parses argv: "pytest", "fedsilo", or a bench script's path
    outputs: dict = field(default_factory=dict)  # files the part writes, read back for its numbers
    notes: list[str] = field(default_factory=list)


def cuda_test_files(tests: Path = TESTS) -> list[str]:
    """tests/ modules with a case that runs only on CUDA (`skipif(not torch.cuda.is_available())`)."""
    return [f"tests/{p.name}" for p in sorted(tests.glob("test_*.py")) if CUDA_ONLY.search(p.read_text())]


def has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def plan(work: Path, bnb: bool | None = None) -> list[Part]:
    """The four parts, their commands writing under `work`."""
    bnb = has_bitsandbytes() if bnb is None else bnb
    junit, throughput, instruct = work / "tests.xml", work / "gpu_throughput.json", work / "instruct_gpu.json"
    config, run = work / "smollm2-fedavg.toml", work / "smollm2-run"
    parts = [
        Part("tests", "CUDA tests", ["-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                                     f"--junitxml={junit}", *cuda_test_files()], 60, "pytest", {"junit": junit}),
        Part("engine", "client loop vs tuned bare loop, fp32 and bf16 (T5 59.7M)",
             ["bench/gpu_throughput.py", "--precisions", "fp32,bf16", "--steps", "20", "--warmup", "3", "--repeats", "2",
              "--json", str(throughput)], 100, "bench/gpu_throughput.py", {"json": throughput}),
        Part("instruct", "instruction tuning at 0.95B: bf16 + LoRA and 4-bit QLoRA vs transformers + peft",
             ["bench/instruct_gpu.py", "--configs", "bf16-lora,qlora" if bnb else "bf16-lora", "--hidden", "2048",
              "--intermediate", "5632", "--layers", "16", "--heads", "16", "--kv-heads", "16", "--max-train", "128",
              "--max-length", "512", "--batch-size", "8", "--steps", "10", "--warmup", "2", "--repeats", "2",
              "--json", str(instruct)], 170, "bench/instruct_gpu.py", {"json": instruct},
             [] if bnb else [f"qlora {QLORA_SKIP}"]),
        Part("smollm2", "SmolLM2-135M-Instruct federated LoRA, 3 silos, 3 rounds, bf16",
             ["-m", "fedsilo", "run", str(config), "--out", str(run), "--no-progress",
              *[a for s in SMOLLM2_SET for a in ("--set", s)]], 130, "fedsilo", {"config": config, "run": run}),
    ]
    return parts


def write_smollm2_config(path: Path) -> Path:
    """experiments/instruct/smollm2.toml's [base] with its fedavg variant, as one run config (the suite's
    overrides go on the command line)."""
    from fedsilo.config import to_toml
    from fedsilo.runs.studyfile import load_study

    _, configs = load_study(SMOLLM2_STUDY, only=[SMOLLM2_VARIANT])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(configs[SMOLLM2_VARIANT]))
    return path


def command_line(part: Part) -> str:
    return shlex.join(["python", *part.argv])


# --- checking a command against its target's parser (--dry-run, tests/test_gpu_suite.py) ------------------

class _Caught(Exception):
    pass


def script_parser(script: Path) -> argparse.ArgumentParser:
    """The ArgumentParser `script`'s main() builds, caught at its parse_args: nothing after it runs."""
    caught: dict = {}
    original = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        caught["parser"] = self
        raise _Caught

    saved_argv, saved_path = sys.argv, list(sys.path)
    argparse.ArgumentParser.parse_args = grab
    sys.argv, sys.path[:0] = [str(script)], [str(script.parent)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    if "parser" not in caught:
        raise RuntimeError(f"{script} built no ArgumentParser")
    return caught["parser"]


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    """(namespace, None), or (None, argparse's error) when the parser refuses argv."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return parser.parse_args(argv), None
    except SystemExit:
        return None, said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else "refused"


def check_part(part: Part) -> str | None:
    """Why the part's command would be refused before it starts (a missing script or test file, a flag its
    parser does not know, a bad value, a config key fedsilo refuses), or None."""
    if part.target == "pytest":
        files = [a for a in part.argv if a.startswith("tests/")]
        if not files:
            return "no test module has a CUDA-only case"
        missing = [f for f in files if not (REPO / f).is_file()]
        return f"missing {missing}" if missing else None
    if part.target == "fedsilo":
        from fedsilo.cli import parser
        from fedsilo.config import load_config
        from fedsilo.errors import ConfigError

        ns, err = _parse(parser(), part.argv[2:])
        if err:
            return err
        try:
            load_config(ns.config, ns.set or [])
        except ConfigError as exc:
            return str(exc)
        return None
    script = REPO / part.target
    if not script.is_file():
        return f"{part.target} does not exist"
    if part.argv[0] != part.target:
        return f"the command runs {part.argv[0]}, not {part.target}"
    _, err = _parse(script_parser(script), part.argv[1:])
    if err:
        return err
    lists = {"--precisions": "AMP", "--configs": "CONFIGS"}  # comma lists each script checks only after parsing
    for flag, table in lists.items():
        if flag in part.argv:
            values = part.argv[part.argv.index(flag) + 1].split(",")
            known = _module_table(script, table)
            if known is None:
                return f"{flag}: {part.target} has no {table} table to check {values} against"
            if bad := [v for v in values if v not in known]:
                return f"{flag}: {bad} not among {sorted(known)}"
    return None


def _module_table(script: Path, name: str):
    """A module-level table of a bench script (its precisions, its configs), read without running main()."""
    import ast
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


# --- running ----------------------------------------------------------------------------------------------

def run_part(part: Part, seconds_left: float, work: Path) -> dict:
    """Run one part under min(its budget, what the suite has left); its record."""
    record = {"name": part.name, "title": part.title, "command": command_line(part), "budget_s": part.budget,
              "notes": list(part.notes)}
    limit = min(part.budget, seconds_left)
    if limit < 10:
        return {**record, "status": "skipped", "seconds": 0.0, "reason": "no time left of the suite's budget"}
    log = work / f"{part.name}.log"
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *part.argv], cwd=REPO, env={**os.environ, **ENV}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    record.update(seconds=round(seconds, 1), returncode=code, limit_s=round(limit, 1),
                  status="timed out" if code is None else ("ok" if code == 0 else "failed"))
    try:
        record["numbers"] = READERS[part.name](part, text)
    except Exception as err:  # noqa: BLE001 - a part that wrote nothing readable is recorded, not fatal
        record["numbers"] = None
        if record["status"] == "ok":  # it said it finished, yet left no results: a failure too
            record["status"] = "failed"
            record["notes"].append(f"its results could not be read: {type(err).__name__}: {err}")
    if record["status"] != "ok":
        record["output_tail"] = "\n".join(text.strip().splitlines()[-40:])
    record["summary"] = summarize(record)
    return record


def _stop(proc: subprocess.Popen) -> None:
    """The part's process group: TERM, then KILL after 10 s (only what this suite started)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_tests(part: Part, text: str) -> dict:
    root = ET.parse(part.outputs["junit"]).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "failed": count["failures"], "errors": count["errors"], "skipped": count["skipped"],
            "failed_tests": failed[:20], "files": [a for a in part.argv if a.startswith("tests/")]}


def read_engine(part: Part, text: str) -> dict:
    data = json.loads(Path(part.outputs["json"]).read_text())
    return {"params": data.get("params"), "timed_examples": data.get("timed_examples"), "notes": data.get("notes", []),
            "precisions": {p: {"engine_ex_s": r["engine"]["median"], "bare_ex_s": r["bare"]["median"],
                               "ratio": r["ratio"], "engine_vs_fp32": r["engine"].get("vs_fp32"),
                               "bare_vs_fp32": r["bare"].get("vs_fp32")} for p, r in data["results"].items()}}


def read_instruct(part: Part, text: str) -> dict:
    data = json.loads(Path(part.outputs["json"]).read_text())
    configs = {}
    for config, r in data["results"].items():
        sides = {s: v for s, v in r.items() if isinstance(v, dict) and "median_tokens_per_s" in v}
        configs[config] = {"ratio": r["ratio"], "tokens_per_s": {s: v["median_tokens_per_s"] for s, v in sides.items()},
                           "peak_gib": {s: v.get("peak_gib") for s, v in sides.items()}}
    out = {"params": data.get("params"), "configs": configs, "notes": data.get("notes", [])}
    if "qlora" not in configs:
        asked = "qlora" in part.argv[part.argv.index("--configs") + 1]
        said = "; ".join(n.removeprefix("qlora ") for n in out["notes"] if "qlora" in n)
        out["qlora"] = (said or "not run") if asked else QLORA_SKIP
    return out


def read_smollm2(part: Part, text: str) -> dict:
    run = Path(part.outputs["run"])
    results = json.loads((run / "results.json").read_text())
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]
    test = results.get("test") or {}
    return {"rounds": results.get("rounds"), "wall_seconds": results.get("wall_seconds"),
            "best_round": results.get("best_round"), "best_dev": results.get("best_dev"),
            "round_seconds": [r.get("seconds") for r in rounds], "eval_seconds": [r.get("eval_seconds") for r in rounds],
            "dev_loss": [((r.get("dev") or {}).get("macro") or {}).get("loss") for r in rounds],
            "test_macro": test.get("macro"), "test_rows": {row["client"]: row["metrics"] for row in test.get("rows", [])}}


READERS = {"tests": read_tests, "engine": read_engine, "instruct": read_instruct, "smollm2": read_smollm2}


# --- reporting ----------------------------------------------------------------------------------------------

def _num(v, fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def summarize(record: dict) -> str:
    """One cell of the table: the part's numbers in words, or why there are none."""
    n, name = record.get("numbers"), record.get("name")
    if record.get("status") == "skipped":
        return record.get("reason", "skipped")
    if not n:
        lines = [ln for ln in (record.get("output_tail") or "").splitlines() if ln.strip()]
        return (lines[-1].strip() if lines else "no output")[:200]
    if name == "tests":
        text = f"{n['passed']} passed, {n['failed'] + n.get('errors', 0)} failed, {n['skipped']} skipped " \
               f"({', '.join(Path(f).name for f in n['files'])})"
        return text + (f"; failed: {', '.join(n['failed_tests'][:3])}" if n.get("failed_tests") else "")
    if name == "engine":
        cells = [f"{p} {_num(r['ratio'])} ({_num(r['engine_ex_s'], '.1f')} vs {_num(r['bare_ex_s'], '.1f')} ex/s)"
                 for p, r in n["precisions"].items()]
        speed = n["precisions"].get("bf16", {}).get("engine_vs_fp32")
        size = f"T5 {_params(n['params'])}, " if n.get("params") else ""
        return f"{size}engine/bare: " + "; ".join(cells) + (f"; bf16 {speed:.2f}x fp32 (engine)" if speed else "")
    if name == "instruct":
        cells = []
        for config, r in n["configs"].items():
            tps, peak = r["tokens_per_s"], r["peak_gib"]
            cells.append(f"{config} fedsilo/bare {_num(r['ratio'])} ({_num(tps.get('fedsilo'), ',.0f')} vs "
                         f"{_num(tps.get('bare'), ',.0f')} tokens/s, peak {_num(peak.get('fedsilo'), '.1f')} GiB)")
        if n.get("qlora"):
            cells.append(f"qlora {n['qlora']}")
        size = f"Llama {_params(n['params'])}: " if n.get("params") else ""
        return size + "; ".join(cells)
    if name == "smollm2":
        macro = n.get("test_macro") or {}
        rounds = "/".join(_num(s, ".1f") for s in n.get("round_seconds", []))
        return (f"{n.get('rounds')} rounds, run {_num(n.get('wall_seconds'), '.0f')} s (rounds {rounds} s); test macro "
                f"loss {_num(macro.get('loss'))}, GSM8K EM {_num(macro.get('em'), '.2f')} %, "
                f"MC acc {_num(macro.get('acc'), '.2f')} %")
    return json.dumps(n)[:200]


def _params(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(record: dict) -> str:
    """The suite's record as markdown for docs/benchmarks.md: a heading line and one table row per part."""
    m = record.get("machine", {})
    head = (f"GPU suite ({record.get('date', '?')}): {m.get('gpu', '?')} ({_num(m.get('gpu_memory_gib'), '.0f')} GiB), "
            f"torch {m.get('torch', '?')}, CUDA {m.get('cuda', '?')}; {_num(record.get('seconds'), '.0f')} s of a "
            f"{record.get('budget_s', TOTAL_BUDGET)} s budget; `{record.get('command', 'python bench/gpu_suite.py')}`")
    rows = ["| # | part | command | status | seconds (budget) | result |", "|---|---|---|---|---:|---|"]
    for i, part in enumerate(record.get("parts", []), 1):
        status = part.get("status", "?")
        if status == "failed" and part.get("returncode") not in (None, 0):
            status = f"failed (exit {part['returncode']})"
        elif status == "timed out":
            status = f"timed out after {_num(part.get('limit_s'), '.0f')} s"
        result = part.get("summary") or summarize(part)
        result = "; ".join([result, *[n for n in part.get("notes", []) if n not in result]])
        rows.append(f"| {i} | {_cell(part.get('title', part.get('name')))} | `{_cell(part.get('command', ''))}` | "
                    f"{_cell(status)} | {_num(part.get('seconds'), '.0f')} ({part.get('budget_s', '?')}) | "
                    f"{_cell(result)} |")
    return head + "\n\n" + "\n".join(rows) + "\n"


def machine() -> dict:
    import torch
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}", "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(), "bitsandbytes": has_bitsandbytes()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def refusal_line() -> str:
    return ("bench/gpu_suite.py needs a CUDA GPU (torch sees none here); on one it runs, in at most "
            f"{TOTAL_BUDGET // 60} minutes: the CUDA-only tests ({', '.join(cuda_test_files()) or 'none found'}), "
            "bench/gpu_throughput.py at fp32 and bf16, bench/instruct_gpu.py at 0.95B with bf16 + LoRA and 4-bit QLoRA, "
            "and 3 rounds of SmolLM2 federated LoRA (python -m fedsilo run); --dry-run prints the commands")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "gpu_suite.json",
                    help="the record (default bench/results/gpu_suite.json)")
    ap.add_argument("--markdown", type=Path, help="also write the markdown table here")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, check their flags, run nothing")
    ap.add_argument("--only", help="comma-separated parts to run: tests, engine, instruct, smollm2 (default all)")
    ap.add_argument("--work", type=Path, help="keep the parts' files and logs here (default: a temporary folder)")
    args = ap.parse_args()
    only = [p.strip() for p in args.only.split(",")] if args.only else list(READERS)
    if unknown := [p for p in only if p not in READERS]:
        ap.error(f"--only: unknown {unknown}; choose from {list(READERS)}")

    if args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            parts = [p for p in plan(work) if p.name in only]
            problems = 0
            for i, part in enumerate(parts, 1):
                if part.name == "smollm2":
                    write_smollm2_config(part.outputs["config"])
                why = check_part(part)
                problems += why is not None
                print(f"part {i} {part.name} ({part.budget} s): {command_line(part)}")
                for note in part.notes:
                    print(f"  note: {note}")
                if part.name == "smollm2":
                    print(f"  config: {SMOLLM2_STUDY.relative_to(REPO)} [base] + [variants.{SMOLLM2_VARIANT}], "
                          "written to the work folder")
                print(f"  check: {'flags accepted' if why is None else 'REFUSED: ' + why}")
        sys.exit(1 if problems else 0)

    import torch
    if not torch.cuda.is_available():
        print(refusal_line(), file=sys.stderr)
        sys.exit(2)

    command = shlex.join(["python", *[str(a) for a in sys.argv]])
    record = {"command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine(), "budget_s": TOTAL_BUDGET, "parts": []}
    print(f"GPU: {record['machine']['gpu']} ({record['machine']['gpu_memory_gib']:.0f} GiB), torch "
          f"{record['machine']['torch']}, CUDA {record['machine']['cuda']}", flush=True)
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-suite-")))
        work.mkdir(parents=True, exist_ok=True)
        parts = [p for p in plan(work) if p.name in only]
        for i, part in enumerate(parts, 1):
            print(f"[{i}/{len(parts)}] {part.title} (budget {part.budget} s): {command_line(part)}", flush=True)
            if part.name == "smollm2":
                try:
                    write_smollm2_config(part.outputs["config"])
                except Exception as err:  # noqa: BLE001
                    rec = {"name": part.name, "title": part.title, "command": command_line(part),
                           "budget_s": part.budget, "status": "failed", "seconds": 0.0, "numbers": None, "notes": [],
                           "output_tail": f"its config could not be built: {type(err).__name__}: {err}"}
                    rec["summary"] = summarize(rec)
                    record["parts"].append(rec)
                    continue
            rec = run_part(part, TOTAL_BUDGET - (time.monotonic() - began), work)
            record["parts"].append(rec)
            print(f"      {rec['status']} in {rec['seconds']:.0f} s: {rec['summary']}", flush=True)
            record["seconds"] = round(time.monotonic() - began, 1)
            _write(args.json, record)
    record["seconds"] = round(time.monotonic() - began, 1)
    _write(args.json, record)
    table = markdown(record)
    print("\n" + table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    sys.exit(0 if all(p["status"] == "ok" for p in record["parts"]) else 1)


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
