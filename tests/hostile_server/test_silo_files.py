"""A silo's files are the silo's (issue 40): a coordinator names a silo and a format, never a path
outside the silo's own folder (its SuperNode's `silo-path`), and no error that travels back to it
carries the silo's data. Each attack goes through the real ClientApp (tests/hostile_server/driver.py)
with an own matching silo; the file outside the silo's folder holds a marker that must appear nowhere
in what the coordinator receives."""
import builtins
import csv
import io
from pathlib import Path

import pytest

from tests.hostile_server.driver import ScriptedServer

MARKER = "MARKER-3f9c-not-for-the-server"
TOPICS = ["password", "invoice", "refund", "parcel", "account", "warranty"]


def write_csv(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    return path


def ranking_rows(label_of_last: str = "0"):
    rows = [("question", "candidate", "label")]
    rows += [(f"How do I sort out my {t}?", f"Open the {t} page.", "1") for t in TOPICS]
    rows += [(f"How do I sort out my {t}?", f"Ask about the {t}.", "0") for t in TOPICS]
    rows[-1] = (*rows[-1][:2], label_of_last)
    return rows


@pytest.fixture
def layout(tmp_path):
    """tmp/silo: the silo's own folder (train, dev, test CSV); tmp/outside/secret.csv: a file of the
    same machine that is not the silo's, its header and a row holding MARKER."""
    silo = tmp_path / "silo"
    for split in ("train", "dev", "test"):
        write_csv(silo / f"{split}.csv", ranking_rows())
    secret = write_csv(tmp_path / "outside" / "secret.csv", [(MARKER, "x"), (MARKER + "-row", "y")])
    return silo, secret


def own_raw(folder: Path, files: dict | None = None, **source) -> dict:
    """The coordinator's config: one own matching silo `alpha` whose files it names."""
    return {
        "name": "files", "seed": 3,
        "task": {"name": "matching", "max_length": 32, "eval_batch_size": 16,
                 "sources": {"alpha": {"path": str(folder), **({"files": files} if files else {}), **source}}},
        "model": {"kind": "encoder", "name": "tiny-bert", "d_model": 32, "d_ff": 64, "num_layers": 1,
                  "num_heads": 4, "dropout": 0.0},
        "client": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 4, "logging_steps": 1},
        "federation": {"rounds": 2, "weighting": "equal"},
    }


def splits(train: str) -> dict:
    return {"train": train, "dev": "dev.csv", "test": "test.csv"}


@pytest.fixture
def opened(monkeypatch):
    """Every path the process opens from now on (builtins.open and io.open, which Path uses)."""
    seen: list[str] = []
    real = io.open

    def spy(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            seen.append(str(Path(file).resolve()))
        return real(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return seen


def attack(tmp_path, silo: Path, entry: str, node_path: Path | None = None) -> str:
    server = ScriptedServer(own_raw(silo, splits(entry)), "alpha", tmp_path / "state",
                            **{"silo-path": str(node_path or silo)})
    return server.seen_by_server("query.describe")


@pytest.mark.parametrize("how", ["absolute", "climbing", "symlink"])
def test_a_file_outside_the_silos_folder_is_refused_before_it_is_opened(tmp_path, layout, opened, how):
    """Today the silo opened the named file and its data check failed with `… the header has
    'MARKER…'`, which the Flower engine put into the coordinator's error."""
    silo, secret = layout
    if how == "absolute":
        entry = str(secret)
    elif how == "climbing":
        entry = "../outside/secret.csv"
    else:
        (silo / "link.csv").symlink_to(secret)
        entry = "link.csv"
    seen = attack(tmp_path, silo, entry)
    assert MARKER not in seen
    assert "files.train" in seen and "outside" in seen and "silo-path" in seen, seen  # one line naming the entry
    assert "\n" not in seen.split(":<'", 1)[-1]
    assert str(secret.resolve()) not in opened  # refused before any file is opened


def test_the_coordinator_cannot_climb_out_of_a_silo_path_that_is_one_file(tmp_path, layout, opened):
    """silo-path naming one file: the silo's folder is the folder holding it; a `lines` suffix or any
    other name the coordinator sends stays inside it."""
    silo, secret = layout
    one = silo / "train.csv"
    server = ScriptedServer(own_raw(one, split={"dev": 0.2, "test": 0.2}), "alpha", tmp_path / "state",
                            **{"silo-path": str(one)})
    seen = server.seen_by_server("query.describe")
    assert "n_examples" in seen and MARKER not in seen  # the honest case still runs
    raw = own_raw(one, format="lines", fields={"question": "x/../../outside/secret.csv", "candidate": "c"},
                  split={"dev": 0.2, "test": 0.2})
    seen = ScriptedServer(raw, "alpha", tmp_path / "state2",
                          **{"silo-path": str(silo / "train.csv")}).seen_by_server("query.describe")
    assert MARKER not in seen and "outside" in seen, seen
    assert str(secret.resolve()) not in opened


def test_an_own_silo_without_a_silo_path_reads_nothing_the_coordinator_names(tmp_path, layout, opened):
    """Without silo-path the silo used the coordinator's `path` as its folder: the coordinator could
    point it at any folder of the machine."""
    _, secret = layout
    server = ScriptedServer(own_raw(secret.parent, splits("secret.csv")), "alpha", tmp_path / "state")
    seen = server.seen_by_server("query.describe")
    assert MARKER not in seen and "silo-path" in seen, seen
    assert str(secret.resolve()) not in opened


def test_errors_about_the_silos_own_data_travel_without_its_content(tmp_path, layout, capfd):
    """Inside its own folder, a malformed file's content (a header cell, a bad label) stays on the
    silo: the coordinator learns the file:line and the count; the silo's own log has the full reason."""
    silo, _ = layout
    write_csv(silo / "header.csv", [(MARKER, "candidate", "label"), ("q", "a", "1")])
    write_csv(silo / "label.csv", ranking_rows(label_of_last=MARKER))
    for train, where in (("header.csv", "header.csv"), ("label.csv", "label.csv:13")):
        state = tmp_path / f"state-{train}"
        seen = ScriptedServer(own_raw(silo, splits(train)), "alpha", state,
                              **{"silo-path": str(silo)}).seen_by_server("query.describe")
        assert MARKER not in seen and where in seen, seen
        assert MARKER in capfd.readouterr().err  # the silo's operator reads the whole reason
