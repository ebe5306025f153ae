"""The real multitask sources beside the project (../shared/data/multitask) and the invariants every
converter's output must keep; converter tests skip without the data."""
from pathlib import Path

import pytest

from fedsilo.tasks.multitask.catalog import CATALOG, Pools
from fedsilo.tasks.multitask.converters import load_all

MT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multitask"
needs_mt = pytest.mark.skipif(not MT.is_dir(), reason=f"real multitask data not found at {MT}")

load_all()


def pools(name: str) -> Pools:
    """Task `name` converted from the real files, after checking the catalogue's invariants."""
    info = CATALOG.get(name)
    for rel in info.files:
        assert (MT / rel).exists(), f"{name}: listed file {rel} is not in the data folder"
    out = info.convert(MT)
    assert out.train and out.test, f"{name}: an empty pool"
    for r in (*out.train, *out.test):
        assert r.input and r.outputs and all(o.strip() for o in r.outputs), (name, r)
        for text in (r.input, *r.outputs):
            assert "\t" not in text and "\n" not in text, (name, text)
        assert not any("[SEP]" in o for o in r.outputs), (name, r)
        assert not r.input.startswith(f"{name}:"), f"{name}: the task prefix is the task's job, not the converter's"
    return out


def labels(records) -> set[str]:
    return {r.outputs[0] for r in records}
