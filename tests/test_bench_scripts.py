"""Every bench/ script still fits the package: its fedsilo imports resolve and its --help runs.

The benchmarks take minutes on real data, so no test runs them; without this check a refactor that
moves a module breaks a benchmark silently (issue 41: two scripts imported a module the redesign had
removed). Imports are found with `ast`, anywhere in a script: inside functions (scripts import
lazily), and inside string constants that are themselves programs (a child process's script).
"""
import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
IDS = [p.name for p in SCRIPTS]


def _programs(tree: ast.Module) -> list[tuple[ast.Module, int]]:
    """(program, its first line's offset in the file): the script itself and every string constant in
    it that parses as a program mentioning fedsilo."""
    found = [(tree, 0)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "fedsilo" in node.value:
            try:
                found.append((ast.parse(node.value), node.lineno - 1))
            except SyntaxError:
                continue  # prose (a docstring, a message), not a program
    return found


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every absolute import in the script."""
    out = []
    for program, offset in _programs(ast.parse(path.read_text(), filename=str(path))):
        for node in ast.walk(program):
            if isinstance(node, ast.Import):
                out += [(alias.name, None, offset + node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out += [(node.module, alias.name, offset + node.lineno) for alias in node.names]
    return out


def top_level_names(path: Path) -> set[str]:
    """Names a sibling bench script defines at module level (what `from sibling import x` can get)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved(module: str, name: str | None) -> str | None:
    """Why `from module import name` (or `import module`) fails now; None when it works."""
    sibling = BENCH / f"{module}.py"
    if sibling.exists():
        return None if name is None or name in top_level_names(sibling) else f"bench/{sibling.name} has no {name!r}"
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        return str(err)
    if name is None or name == "*" or hasattr(mod, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")  # a submodule not yet imported by its package
    except ImportError:
        return f"{module} has no {name!r}"
    return None


def test_every_script_is_found():
    assert len(SCRIPTS) > 10 and BENCH / "flower_engines.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_fedsilo_imports_resolve(script):
    checked = [(m, n, line) for m, n, line in imports(script)
               if m.split(".")[0] == "fedsilo" or (BENCH / f"{m}.py").exists()]
    broken = [f"bench/{script.name}:{line}: from {m} import {n}: {why}" for m, n, line in checked
              if (why := unresolved(m, n))]
    assert not broken, "\n".join(broken)


# Scripts run as commands that read sys.argv themselves (no argparse, so no --help to ask for).
OWN_ARGV = {"identical_render.py": "runs another bench command line under patches",
            "tree_peak.py": "runs the command line it is given", "rouge_compare.py": "takes a bare record count"}


def is_command(path: Path) -> bool:
    """A script with an `if __name__ == "__main__":` block (the rest are libraries or plain scripts)."""
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in ast.parse(path.read_text()).body)


CLI_SCRIPTS = [p for p in SCRIPTS if is_command(p) and p.name not in OWN_ARGV]


def test_scripts_without_help_are_still_there():
    assert set(OWN_ARGV) <= set(IDS), "OWN_ARGV names a script that is gone: drop it from the list"

# One child process runs every script's --help in turn, as `python bench/X.py --help` would (run as
# __main__, bench/ first on sys.path): torch and fedsilo are imported once, not once per script
# (a few seconds against a minute). Each script gets fresh globals; the report is its exit code.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
bench, scripts, report = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
sys.path.insert(0, bench)
results = {}
for script in scripts:
    sys.argv = [script, "--help"]
    shown = io.StringIO()
    try:
        with contextlib.redirect_stdout(shown):
            runpy.run_path(script, run_name="__main__")
        code = "returned without exiting: --help was not parsed"
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    results[script] = {"code": code, "usage": "usage:" in shown.getvalue()}
with open(report, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    report = tmp_path_factory.mktemp("help") / "report.json"
    subprocess.run([sys.executable, "-c", HELP_RUNNER, str(BENCH), *map(str, CLI_SCRIPTS), str(report)],
                   check=True, timeout=600, stdin=subprocess.DEVNULL)
    return json.loads(report.read_text())


@pytest.mark.parametrize("script", CLI_SCRIPTS, ids=[p.name for p in CLI_SCRIPTS])
def test_help_runs(helps, script):
    result = helps[str(script)]
    assert result["code"] == 0, f"bench/{script.name} --help: {result['code']}"
    assert result["usage"], f"bench/{script.name} --help printed no usage"


def test_gpu_bench_refuses_a_cpu_in_one_line():
    """bench/instruct_gpu.py on a machine without CUDA: one line saying so and naming --cpu-smoke."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the bench would run")
    done = subprocess.run([sys.executable, str(BENCH / "instruct_gpu.py")], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no CUDA GPU" in done.stderr and "--cpu-smoke" in done.stderr
