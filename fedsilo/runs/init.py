"""`fedsilo init DATA_DIR --task NAME`: a commented config for a folder holding one sub-folder (or
file) per silo, or one silo's own folder of split files. What can be told from the files is filled
in (format from the suffix, .gz read through, files per split from their names, fields from the
header or the first JSON object, a schema or database beside text-to-SQL rows); what cannot is
written as a `DECIDE` line for the user, never guessed silently; every file left unused is named,
with why. The config is validated as the run would load it before it is written, atomically: init
never leaves a file a run cannot parse (fedsilo.runs.init_text renders and writes it).
"""
from __future__ import annotations

import os
from pathlib import Path

from fedsilo.errors import DataError, UserError
from fedsilo.runs.init_names import (SPLIT_NAMES, FileName, clean_name, distinct_names, keep_display, own_name, shown,
                                     split_of, unnamable)
from fedsilo.runs.init_peek import columns, head, messages_key, one_array
from fedsilo.runs.init_text import Draft, Guess, render
from fedsilo.sources.load import groups, splittable
from fedsilo.sources.read import not_readable, read_rows
from fedsilo.tasks import TASKS

DECIDE = "??"  # a column nobody has: `fedsilo data check` names it until the user decides
READS = ("init reads .csv, .tsv, .jsonl and .json (one JSON array of rows) files and line-aligned files "
         "(train.de + train.en: format \"lines\"), each also gzip-compressed (.gz)")
NO_ARRAY = "a .json file holds no JSON array of rows ([{...}, {...}])"
FEW_GROUPS = 10  # a split's key with fewer values: init groups by a role that differs (Roles.regroup)


def init_config(data_dir: Path, task: str, out: Path) -> Draft:
    """The config for `data_dir`'s silos (paths relative to `out`'s folder), what was guessed, and
    what was left out."""
    if task not in TASKS:
        raise UserError(f"--task {task!r} is not a task: {', '.join(TASKS)}")
    settings = TASKS.entry(task).settings
    if settings.SOURCE is None:
        raise UserError(f"task {task!r} takes no own silos (it has no [task.sources])")
    data_dir = Path(data_dir)
    why = not_readable(data_dir)
    if why != "a folder, not a file":
        raise UserError(f"{data_dir} is {why or 'a file'}; expected a folder with one sub-folder or file per silo")
    base, roles = out.parent.resolve(), settings.SOURCE.ROLES
    entries, unused = _top_entries(data_dir)
    if not entries and not unused:
        raise UserError(f"{data_dir} is empty: put one sub-folder (or file) per silo in it")
    if _one_silos_folder(entries):
        guess = guess_silo(data_dir, roles, task, base)
        guess.decide.insert(0, f"{data_dir} holds one silo's own files ({', '.join(p.name for p in entries)}): "
                               f"read as one silo, {guess.name}; to federate several silos, give init the folder "
                               "holding one sub-folder (or file) per silo")
        guesses, silos = [guess], [data_dir]
    else:
        silos = _silo_entries(entries, unused)
        guesses = [guess_silo(p, roles, task, base) for p in silos]
    if not guesses:
        raise UserError(f"{data_dir}: no silo in it ({'; '.join(f'{n}: {w}' for n, w in unused)})")
    distinct_names(guesses, silos)
    for g, p in zip(guesses, silos):
        keep_display(g, p)
    taken = [g.name for g in guesses if g.name in settings.BENCHMARK]
    if taken:
        raise UserError(f"{', '.join(taken)}: the name of a benchmark silo; rename the folder or file")
    return Draft(render(task, data_dir, guesses, unused, out.stem), guesses, unused)


def _top_entries(data_dir: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """DATA_DIR's folders and regular files, and the other entries with why they are no silo."""
    entries, unused = [], []
    for p in sorted(data_dir.iterdir()):
        why = unnamable(p) or ("a hidden entry" if p.name.startswith(".") else not_readable(p))
        if why == "a folder, not a file":
            why = None
        elif why is None and p.suffix.lower() == ".toml":
            why = "a config, not a silo"
        if why:
            unused.append((shown(p), why))
        else:
            entries.append(p)
    return entries, unused


def _silo_entries(entries: list[Path], unused: list[tuple[str, str]]) -> list[Path]:
    """The entries that are silos: each folder, and each data file; another file is named unused."""
    out = []
    for p in entries:
        name = FileName.of(p)
        if p.is_dir() or name.rows:
            out.append(p)
        elif name.table:
            unused.append((p.name, f"not a silo: {NO_ARRAY}"))
        else:
            unused.append((p.name, "not a silo: a silo is a sub-folder, or one .csv, .tsv, .jsonl or .json file (also "
                                   ".gz); line-aligned files (train.de + train.en) go in a silo's sub-folder"))
    return out


def _one_silos_folder(entries: list[Path]) -> bool:
    """Whether DATA_DIR is itself one silo's folder: no sub-folder, and files named by split
    (train.csv) or line-aligned (train.de + train.en), which cannot each be a silo."""
    if not entries or any(p.is_dir() for p in entries):
        return False
    names = [FileName.of(p) for p in entries]
    tables = [n for n in names if n.rows]
    return bool(any(n.stem.lower() in SPLIT_NAMES for n in tables) or (not tables and _aligned(names)))


def _by_split(g: Guess, stems: list[str], shown) -> dict[str, str]:
    """split → stem, when a train file is found: a stem named exactly as a split first, else one
    holding a split's word (a DECIDE line says which); a second candidate for a split is named unused."""
    out: dict[str, str] = {}
    guessed, extra = [], []
    for stem in sorted(stems, key=lambda s: (not split_of(s)[1], s)):
        split, exact = split_of(stem)
        if split is None:
            continue
        if split in out:
            extra.append((shown(stem), f"another {split} file: {shown(out[split])} is the {split} split"))
            continue
        out[split] = stem
        if not exact:
            guessed.append(f"{shown(stem)} is taken as the {split} split (its name says {split}); if it is not, "
                           f"change files.{split}")
    if "train" not in out:
        return {}
    g.decide += guessed
    g.unused += extra
    return out


def guess_silo(path: Path, roles, task: str, base: Path) -> Guess:
    g = Guess(clean_name(own_name(path)))
    rel = lambda p: os.path.relpath(Path(p).resolve(), base)  # noqa: E731
    files = [path] if path.is_file() else _silo_files(g, path)
    if task == "text2sql":
        files = _sql_extras(files, g, rel)
    names = [FileName.of(p) for p in files]
    tables = [n for n in names if n.rows]
    lines = _aligned(names) if not tables else {}
    if lines:
        _lines_guess(g, path, lines, roles, rel)
        used = {n.path for ns in lines.values() for n in ns if n.lines_name in _used_lines(g)}
        return _name_unused(g, names, used, path, set(lines))
    if tables:
        source = TASKS.entry(task).settings.SOURCE
        used = _tables_guess(g, path, tables, roles, rel, "chat" in source.model_fields)  # rows may be chats
        _regroup(g, source, base)
        return _name_unused(g, names, used, path)
    g.entry["path"] = rel(path)
    g.decide.append(f"no .csv, .tsv or .jsonl file, nor line-aligned files (train.de + train.en: format \"lines\"), "
                    f"found in {path} (each may be gzip-compressed, .gz): set path, format and fields")
    g.entry["format"] = DECIDE
    return _name_unused(g, names, set(), path)


def _regroup(g: Guess, source, base: Path) -> None:
    """A split of rows that share their key (one instruction, the text in each row's input) grouped
    by a role whose values differ instead (`Roles.regroup`), with a DECIDE line saying why: grouped
    by a key of fewer than FEW_GROUPS values, dev and test would be whole instructions, or nothing."""
    roles, split = source.ROLES, g.entry.get("split")
    if split is None or g.entry.get("chat") or DECIDE in g.entry.get("fields", {}).values() or not roles.regroup:
        return
    train = Path(base, g.entry["path"], g.entry.get("files", {}).get("train", ""))
    try:
        settings = source.model_validate({k: v for k, v in g.entry.items() if k != "files"} | {"path": str(train)})
        rows, _ = read_rows(settings, train)
    except (DataError, ValueError):  # unreadable here: `fedsilo data check` names why
        return
    cut = [s for s in ("dev", "test") if s in split]
    few = len(groups(rows, roles.key))
    for role in roles.regroup:
        n = len(groups(rows, role))
        if few < FEW_GROUPS <= n and splittable(n, settings.split, cut):
            g.entry["split"] = split | {"by": role}
            g.comments["split"] = g.comments["split"].replace(roles.key, role)
            g.decide.append(f"{few} distinct {roles.key} value(s) and {n} distinct {role} values in {train.name}: "
                            f"split by {role} (split.by), so that dev and test hold {role}s unseen in training; "
                            f"by {roles.key} (the default), dev and test would each be whole {roles.key}s"
                            + ("" if splittable(few, settings.split, cut) else f", and {few} is too few to cut"))
            return


def _silo_files(g: Guess, folder: Path) -> list[Path]:
    """A silo folder's regular files; the rest (hidden, sub-folders, FIFOs, symlink loops) named unused."""
    out = []
    for p in sorted(folder.iterdir()):
        why = unnamable(p) or ("a hidden file" if p.name.startswith(".") else not_readable(p))
        if why == "a folder, not a file":
            why = "a folder inside a silo's folder (not read)"
        if why:
            g.unused.append((shown(p), why))
        else:
            out.append(p)
    return out


def _tables_guess(g: Guess, path: Path, tables: list[FileName], roles, rel, chat: bool = False) -> set[Path]:
    """`chat`: the family reads chat conversations (a JSONL key holding a list of {role, content}
    messages), which a source says with `chat = true`."""
    stems = {}
    for n in tables:
        stems.setdefault(n.stem, n)  # train.csv before train.csv.gz, by name
    shown = lambda stem: stems[stem].path.name  # noqa: E731
    by_split = _by_split(g, list(stems), shown)
    if "train" in by_split:
        fmt = stems[by_split["train"]].table
        other = {s: st for s, st in by_split.items() if stems[st].table != fmt}
        for s, st in other.items():
            g.unused.append((shown(st), f"a {stems[st].table} file; the silo's format is {fmt} (from its train file)"))
            del by_split[s]
        g.entry["path"] = rel(path)
        g.entry["format"] = fmt
        g.entry["files"] = {s: stems[by_split[s]].path.name for s in ("train", "dev", "test") if s in by_split}
        cut = [s for s in ("dev", "test") if s not in by_split]
        if cut:
            g.entry["split"] = {s: 0.1 for s in cut} | {"seed": 0}
            g.comments["split"] = f"{' and '.join(cut)} cut from train, grouped by {roles.key}"
        sample = stems[by_split["train"]].path
        used = {stems[st].path for st in by_split.values()}
    else:
        sample = tables[0].path
        if len(tables) > 1:
            g.decide.append(f"{len(tables)} data files and none named train/dev/test: {sample.name} is used; "
                            "name them train/dev/test to use each as a split")
        g.entry["path"] = rel(sample)
        g.entry["format"] = tables[0].table
        g.entry["split"] = {"dev": 0.1, "test": 0.1, "seed": 0}
        g.comments["split"] = f"one file: 10% dev, 10% test, grouped by {roles.key} (no {roles.key} in two splits)"
        used = {sample}
    if g.entry["format"] == "jsonl" and one_array(head(sample)):
        g.entry["format"] = "json"
        g.comments["format"] = f"{sample.name} holds one JSON array of rows, not JSON lines (one object per line)"
    messages = messages_key(sample, g.entry["format"]) if chat and g.entry["format"] in ("jsonl", "json") else None
    if messages is None:
        _map_fields(g, roles, columns(g, sample, g.entry["format"]), sample)
        return used
    g.entry["chat"] = True
    g.comments["chat"] = (f"rows are chat conversations ({messages!r}: a list of {{role, content}} messages); the "
                          "last message is the assistant's response, the loss covers it")
    if messages != "messages":
        g.entry["fields"] = {"messages": messages}
    if "split" in g.comments:  # absent when every split has its file
        g.comments["split"] = g.comments["split"].replace(roles.key, "conversation")
    return used


def _name_unused(g: Guess, names: list[FileName], used: set[Path], folder: Path, corpora: set[str] = frozenset()
                 ) -> Guess:
    """Every file of the silo the config does not read, with why (unless said already); `corpora`:
    the stems of line-aligned files."""
    said = {n for n, _ in g.unused}
    fields = g.entry.get("fields", {}) if g.entry.get("format") == "lines" else {}
    for n in names:
        if n.path in used or n.path.name in said or n.path == folder or _is_extra(g, n.path):
            continue
        if n.table and not n.rows:
            why = f"not read: {NO_ARRAY}"
        elif n.table:
            why = "no split name (train, dev, test) and another file is read" if "files" not in g.entry else \
                  "its name is no split's (train, dev/valid/val, test)"
        elif n.stem in corpora and n.suffix not in fields.values():
            mapped = ", ".join(f"{r} = {s}" for r, s in fields.items())
            why = f"its suffix .{n.suffix} is no role's file (fields: {mapped})"
        elif n.stem in corpora:
            why = "its name is no split's (train, dev/valid/val, test) and another corpus is read"
        else:
            why = f"not a data file ({'.' + n.suffix if n.suffix else 'no suffix'}): {READS}"
        g.unused.append((n.path.name, why))
    return g


def _is_extra(g: Guess, path: Path) -> bool:
    """A text-to-SQL schema or database the entry names."""
    return any(isinstance(v, str) and v != DECIDE and Path(v).name == path.name
               for k, v in g.entry.items() if k in ("schema_file", "database"))


def _sql_extras(files: list[Path], g: Guess, rel) -> list[Path]:
    """A text-to-SQL silo's database (.sqlite/.db) and schema (.sql, or a CSV named *schema*)."""
    rest = []
    for p in files:
        low = p.name.lower()
        if p.suffix.lower() in (".sqlite", ".sqlite3", ".db"):
            g.entry.setdefault("database", rel(p))
        elif p.suffix.lower() == ".sql" or (low.endswith(".csv") and "schema" in low):
            g.entry.setdefault("schema_file", rel(p))
        else:
            rest.append(p)
    if "database" not in g.entry and "schema_file" not in g.entry:
        g.entry["schema_file"] = DECIDE
        g.decide.append("no schema found: set schema_file (CREATE TABLE statements, .sql) or database (SQLite)")
    return rest


def _aligned(names: list[FileName]) -> dict[str, list[FileName]]:
    """stem → files sharing it with other suffixes (train.de, train.en, either may be .gz): line-aligned files."""
    stems: dict[str, list[FileName]] = {}
    for n in names:
        if n.suffix and not n.table:
            stems.setdefault(n.stem, []).append(n)
    return {s: ns for s, ns in stems.items() if len({n.suffix for n in ns}) >= 2}


def _used_lines(g: Guess) -> set[str]:
    """PREFIX.SUFFIX of every file the lines entry reads."""
    stems = list(g.entry.get("files", {}).values()) or [Path(g.entry["path"]).name]
    return {f"{stem}.{suffix}" for stem in stems for suffix in g.entry["fields"].values() if suffix != DECIDE}


def _lines_guess(g: Guess, path: Path, stems: dict[str, list[FileName]], roles, rel) -> Guess:
    g.entry["format"] = "lines"
    suffixes = sorted({n.suffix for ns in stems.values() for n in ns})
    fields = {}
    for role in roles.required:
        match = next((s for s in suffixes if s.lower() in roles.names_for(role)), None)
        fields[role] = match or DECIDE
        if match is None:
            g.decide.append(f"fields.{role}: which file suffix holds the {role} ({', '.join(suffixes)})")
    g.entry["fields"] = fields
    by_split = _by_split(g, list(stems), lambda stem: f"{stem}.*")
    if "train" in by_split:
        g.entry["path"] = rel(path)
        g.entry["files"] = {s: by_split[s] for s in ("train", "dev", "test") if s in by_split}
        cut = [s for s in ("dev", "test") if s not in by_split]
        if cut:
            g.entry["split"] = {s: 0.1 for s in cut} | {"seed": 0}
            g.comments["split"] = f"{' and '.join(cut)} cut from train, grouped by {roles.key}"
    else:
        stem = sorted(stems)[0]
        if len(stems) > 1:
            g.decide.append(f"{len(stems)} line-aligned corpora and none named train/dev/test: {stem}.* is used; "
                            "name them train/dev/test to use each as a split")
        g.entry["path"] = rel(path / stem)
        g.entry["split"] = {"dev": 0.1, "test": 0.1, "seed": 0}
        g.comments["split"] = f"one corpus: 10% dev, 10% test, grouped by {roles.key}"
    g.comments["fields"] = "role = file suffix (PREFIX.SUFFIX, or PREFIX.SUFFIX.gz; line i of each is one example)"
    return g


def _map_fields(g: Guess, roles, columns: list[str], sample: Path) -> None:
    fields, lowered = {}, {c.lower(): c for c in columns}
    for role in roles.all:
        match = next((lowered[n] for n in roles.names_for(role) if n in lowered), None)
        if match is None:
            if role in roles.required:
                fields[role] = DECIDE
                g.decide.append(f"fields.{role}: which column of {sample.name} holds the {role} "
                                f"(columns: {', '.join(columns) or 'none found'})")
            elif role == "label":
                g.comments["fields"] = ("no label column found: every candidate is a correct answer, and "
                                        "task.negatives BM25-mined answers are the wrong ones")
        elif match != role:
            fields[role] = match
    if fields:
        g.entry["fields"] = fields
