"""Synthetic text-to-SQL silos in the real file format (folds 0–9), for engine tests."""
import json
from pathlib import Path

import pytest

# The real benchmark data beside the project (CI has it too); tests that need it skip without it.
REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text2sql"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"real text2sql data not found at {REAL}")

SCHEMA = """Table Name, Field Name, Is Primary Key, Is Foreign Key, Type
CITY, CITY_NAME, y, n, varchar(255)
CITY, POPULATION, n, n, int(11)
-, -, -, -, -
"""
NAMES = ["austin", "boston", "dallas", "denver", "fresno", "miami", "omaha", "reno", "tampa", "tulsa"]


def write_silos(root: Path, silos=("restaurants", "academic", "yelp"), per_fold: int = 2) -> Path:
    """Each silo: 10 folds × `per_fold` sentences (so 6·per_fold train, 2·per_fold dev/test)."""
    root.mkdir(parents=True, exist_ok=True)
    for s_idx, silo in enumerate(silos):
        records = []
        for fold in range(10):
            for k in range(per_fold):
                city = NAMES[(fold + k + s_idx) % len(NAMES)]
                records.append({
                    "query-split": str(fold),
                    "sentences": [{"question-split": str(fold), "text": f"population of city_name0 in {silo}",
                                   "variables": {"city_name0": city}}],
                    "sql": ['SELECT CITYalias0.POPULATION FROM CITY AS CITYalias0 '
                            'WHERE CITYalias0.CITY_NAME = "city_name0" ;'],
                    "variables": [{"name": "city_name0", "example": "austin", "location": "both",
                                   "type": "city_name"}],
                })
        (root / f"{silo}.json").write_text(json.dumps(records))
        (root / f"{silo}-schema.csv").write_text(SCHEMA)
    return root


def tiny_config(data_dir: Path, **sections) -> dict:
    """A raw config for a 3-silo federation with a very small T5."""
    cfg = {
        "name": "t", "seed": 3,
        "task": {"data_dir": str(data_dir), "silos": ["restaurants", "academic", "yelp"],
                 "max_source_length": 48, "max_target_length": 24, "eval_batch_size": 16},
        "model": {"d_model": 16, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2},
        "client": {"epochs": 1, "lr": 1e-2, "batch_size": 4, "logging_steps": 1},
        "clients": {"yelp": {"epochs": 2}},
        "federation": {"rounds": 2, "weighting": "lorar"},
        "server": {"optimizer": "sgdm"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg
