"""Imports run one way: every module of fedsilo imports only from its own layer or the layers below.

The layers, bottom to top (docs/design.md): what the whole package shares (errors, file writing, the
registry, settings, paradigms, progress display), the federated-learning math (core), the privacy
mechanisms (privacy: they use the math, never the reverse), models, tasks,
the client, the server, the config that composes their settings, the run directory's files, the
recipe that turns a config into objects, the engines that move tensors (in-process, Flower), runs
and studies, and the command line. Every import counts, also one inside a function or under
TYPE_CHECKING: a hidden upward import is still a cycle a reader has to untangle. Every module is
placed by name (a package places its submodules): a new top-level module is in no layer until it is
given one here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedsilo"

# (layer, modules and packages); a module belongs to the layer of its longest listed prefix, and
# "fedsilo" (fedsilo/__init__.py) places only itself: every top-level module is listed by name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("fedsilo", "fedsilo.errors", "fedsilo.fileio", "fedsilo.registry", "fedsilo.settings",
              "fedsilo.paradigms", "fedsilo.progress")),
    ("core", ("fedsilo.core",)),
    ("privacy", ("fedsilo.privacy",)),
    ("models", ("fedsilo.models",)),
    ("tasks", ("fedsilo.datafetch", "fedsilo.sources", "fedsilo.tasks")),
    ("client", ("fedsilo.client",)),
    ("server", ("fedsilo.server",)),
    ("tracking", ("fedsilo.tracking",)),
    ("config", ("fedsilo.config", "fedsilo.federation_settings", "fedsilo.builtins")),
    ("rundir", ("fedsilo.rundir",)),
    ("recipe", ("fedsilo.recipe", "fedsilo.features")),
    ("engines", ("fedsilo.engines",)),
    ("runs", ("fedsilo.runs",)),
    ("cli", ("fedsilo.cli", "fedsilo.commands", "fedsilo.__main__")),
]
RANK = {prefix: i for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}
ROOT = "fedsilo"


def layer_of(module: str) -> int:
    if module == ROOT:
        return RANK[ROOT]
    parts = module.split(".")
    for n in range(len(parts), 1, -1):  # never the bare root: a module it does not name is in no layer
        prefix = ".".join(parts[:n])
        if prefix in RANK:
            return RANK[prefix]
    raise KeyError(f"{module}: in no layer of tests/test_layers.py")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every fedsilo import in the file, relative ones resolved, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fedsilo"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fedsilo":
                continue
            # `from fedsilo.x import y`: y may be a module (fedsilo.x.y) or a name in fedsilo.x
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                    (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_module else target))
    return sorted(set(out))


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """Every import from a module to a module of a higher layer, as 'file:line: a (layer) -> b (layer)'."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        own = layer_of(module)
        for line, target in imported(path, module):
            if layer_of(target) > own:
                found.append(f"{path.relative_to(root.parent)}:{line}: {module} ({LAYERS[own][0]}) imports "
                             f"{target} ({LAYERS[layer_of(target)][0]})")
    return found


def every_module_has_a_layer(root: Path = PACKAGE) -> None:
    for path in sorted(root.rglob("*.py")):
        layer_of(module_name(path, root))


def test_every_module_has_a_layer():
    every_module_has_a_layer()


def test_a_module_in_no_layer_is_caught(tmp_path):
    """The check itself: a copy of the package with one new top-level module that no layer names
    fails it, naming the module (no catch-all `fedsilo` prefix places it silently)."""
    import shutil

    copy = tmp_path / "fedsilo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "newthing.py").write_text('"""A module nobody placed yet."""\n')
    with pytest.raises(KeyError, match=r"fedsilo\.newthing: in no layer"):
        every_module_has_a_layer(copy)
    assert layer_of("fedsilo") == RANK["fedsilo"]  # the package itself stays placed


def test_no_module_imports_from_a_higher_layer():
    found = upward_imports()
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a copy of the package with one deliberate upward import (the server importing
    the command line, inside a function) fails it, naming the file and line."""
    import shutil

    copy = tmp_path / "fedsilo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    server = copy / "server.py"
    server.write_text(server.read_text() + "\n\ndef _sneaky():\n    from fedsilo.cli import main\n    return main\n")
    lines = len(server.read_text().splitlines())
    found = upward_imports(copy)
    assert found == [f"fedsilo/server.py:{lines - 1}: fedsilo.server (server) imports fedsilo.cli (cli)"]


@pytest.mark.parametrize("source, expected", [
    ("from . import pulling", ["fedsilo.core.pulling"]),
    ("from .tensors import Tensors", ["fedsilo.core.tensors"]),
    ("from .. import registry", ["fedsilo.registry"]),
    ("from ..registry import Registry", ["fedsilo.registry"]),
    ("import fedsilo.cli as c", ["fedsilo.cli"]),
    ("from fedsilo.config import RunConfig", ["fedsilo.config"]),
])
def test_relative_and_absolute_imports_resolve(tmp_path, source, expected):
    f = tmp_path / "x.py"
    f.write_text(source + "\n")
    # resolved as if the file were fedsilo/core/exchange.py
    got = [m for _, m in imported(f, "fedsilo.core.exchange")]
    assert got == expected
