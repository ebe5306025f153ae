"""The shape issue 39 asks for, checked on the package's source: a run is assembled in one build step
(fedsilo.recipe.build_recipe), after which nothing is looked up by name, and a policy is never
recognised by comparing its name — an entry declares what it can do.

Both checks parse the package (ast); each is shown to fail on a planted offence.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedsilo"

# Config fields whose value is a registered policy's (or a mode's) name.
POLICY_FIELDS = {"name", "download", "overwrite", "upload", "mode", "weighting", "aggregation", "optimizer",
                 "objective", "lr_schedule", "batching", "before_training", "after_training", "pseudo_source",
                 "paradigm", "kind", "bias_correction", "noise", "backend"}

# The modules that run after the build: a round's loop, its stages and the engines moving it.
RUN_TIME = ("server.py", "client/silo.py", "client/trainers.py", "client/recipe.py", "client/train.py",
            "client/private.py", "client/objective.py", "client/schedule.py", "client/ditto.py", "client/pseudo.py",
            "core/rounds.py", "core/aggregate.py", "core/masking.py", "privacy/silo_dp.py",
            "privacy/secure_stages.py", "privacy/secagg.py", "engines")

LOOKUPS = {"get", "entry", "resolve", "resolve_chain"}


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _declared(tree: ast.AST) -> set[str]:
    """Names an entry's own module declares: registered (`X.add("n", …)`, `register("n")`), a Literal's
    choices, or a module-level constant."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("add", "register", "register_selector") and node.args:
            out.update(_strings(node.args[0]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
                node.func.id.startswith("register"):
            out.update(_strings(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            out.update(_strings(node.slice))
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for sub in ast.walk(node.value):
                out.update(_strings(sub))
    return out


def name_comparisons(root: Path = PACKAGE) -> list[str]:
    """Every `x.<policy field> == "literal"` (or !=, in, not in) whose literal the module does not itself
    declare, as 'file:line: source'."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        declared = _declared(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not all(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                continue
            sides = [node.left, *node.comparators]
            fields = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in POLICY_FIELDS]
            literals = [v for s in sides for v in _strings(s)]
            if fields and literals and not set(literals) <= declared:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def registries(root: Path = PACKAGE) -> set[str]:
    """The names the package binds to a Registry(...) at module level."""
    out = set()
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            value = getattr(node, "value", None)
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _validation(tree: ast.AST) -> set[int]:
    """ids of the nodes inside pydantic validation (a validator, model_post_init): part of the build."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (node.name == "model_post_init" or any(
                "validator" in ast.unparse(d) for d in node.decorator_list)):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def run_time_lookups(root: Path = PACKAGE) -> list[str]:
    """Every `REGISTRY.get/entry/resolve(…)` in the modules that run after the build (outside the
    validation of their settings, which the build runs)."""
    names = registries(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not any(rel == m or rel.startswith(m + "/") for m in RUN_TIME):
            continue
        tree = ast.parse(path.read_text(), str(path))
        validation = _validation(tree)
        for node in ast.walk(tree):
            if id(node) in validation:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOOKUPS \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_no_policy_is_recognised_by_its_name_outside_its_own_module():
    found = name_comparisons()
    assert not found, "policy names compared (declare an ability on the entry instead):\n" + "\n".join(found)


def test_nothing_is_looked_up_by_name_after_the_build():
    found = run_time_lookups()
    assert not found, "registry look-ups after build_recipe:\n" + "\n".join(found)


def test_every_run_time_module_named_exists():
    for module in RUN_TIME:
        assert (PACKAGE / module).exists(), module


@pytest.mark.parametrize("planted, check", [
    ("\n\ndef _sneaky(cfg):\n    return cfg.federation.weighting == \"lorar\"\n", name_comparisons),
    ("\n\ndef _sneaky(name):\n    from fedsilo.core.weighting import WEIGHTINGS\n    return WEIGHTINGS.get(name)\n",
     run_time_lookups),
])
def test_each_check_catches_a_planted_offence(tmp_path, planted, check):
    copy = tmp_path / "fedsilo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    server = copy / "server.py"
    server.write_text(server.read_text() + planted)
    found = check(copy)
    assert len(found) == 1 and found[0].startswith("fedsilo/server.py:")
