"""A silo reads only its own folder. On a SuperNode the coordinator's config names the files (its
`files`, a `lines` suffix, a schema file), so each such name is resolved, symlinks included, and
refused unless it lies inside the silo's folder, before any file is opened: the coordinator names a
silo and a format, never a path of the silo's machine (issue 40). Nothing here opens a file.
"""
from __future__ import annotations

from pathlib import Path

from fedsilo.errors import ConfigError

from .settings import PATH_KEYS, SPLITS, SourceSettings, real_path


def silo_folder(path: str | Path) -> Path:
    """The folder a silo's path stands for: the path itself when it is a folder, else the folder
    holding it (a one-file source, or the common prefix of `lines` files)."""
    path = real_path(Path(path), "the silo's path")
    return path if path.is_dir() else path.parent


def named_files(source: SourceSettings) -> list[tuple[str, str, Path]]:
    """(config key, value as written, the path it names) for every file the source could read,
    without asking the disk which of them exist."""
    base = Path(source.path)
    out = [(key, str(getattr(source, key)), Path(getattr(source, key)))
           for key in PATH_KEYS if isinstance(getattr(source, key, None), str) and getattr(source, key)]
    stems = [(f"files.{s}", source.files[s], base / source.files[s]) for s in SPLITS if s in source.files]
    out += stems
    if source.format_name == "lines":
        roles = [r for r in source.ROLES.all if r in source.ROLES.required or r in source.fields]
        for _, _, stem in stems or [("path", source.path, base)]:  # a role's file, or its gzip-compressed one
            out += [(f"fields.{r}", str(source.column(r)), Path(f"{stem}.{source.column(r)}{gz}")) for r in roles
                    for gz in ("", ".gz")]
    return out


def confine(name: str, source: SourceSettings, folder: Path, folder_is: str) -> None:
    """A ConfigError naming the first of the source's entries whose file lies outside `folder`
    (`folder_is` says which folder that is, e.g. "its silo-path")."""
    for key, value, path in named_files(source):
        if not real_path(path, f"silo {name}: task.sources.{name}.{key} = {value!r}").is_relative_to(folder):
            raise ConfigError(f"silo {name}: task.sources.{name}.{key} = {value!r} names a file outside the silo's "
                              f"folder ({folder_is}); a silo reads only its own files: refused before opening any")
