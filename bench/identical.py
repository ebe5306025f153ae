"""Behaviour identity of two source trees of fedsilo (issue 39): the same study docs, the same runs.

    git worktree add /tmp/before 5d60571          # the code before the change
    python bench/identical.py /tmp/before . --quick           # 8-12 min on 2 shared cores
    python bench/identical.py /tmp/before .                   # + real-data runs and `make study`'s job

Both trees run with this Python environment (its installed packages) and PYTHONPATH set to the tree,
as bench/ab_trees.py does, and take the same inputs: the records, study files, configs and toy
plugins are copied from TREE_A, so that the two sides differ only in fedsilo's code (and each tree's
own bench/*_study.py scripts, which render the docs). The data comes from the same mirror
($FEDSILO_DATA_MIRROR, default ../shared/data beside TREE_A's parent if there, else /work/shared/data).
Prints one line per compared item, IDENTICAL or DIFFERENT with the first differing key or line
(or FAILED with the command's last error line), and exits 1 if anything is not identical.

What is compared:

1. Study docs, re-rendered from the committed records (bench/results/, copied to a scratch folder
   at the same path for both trees): docs/qa-study.md (bench/qa_study.py), docs/multitask-study.md
   (bench/multitask_study.py, seeded with TREE_A's doc, whose hand-written `## Reading` part it keeps),
   docs/lorar-study.md (bench/study.py), docs/nmt-study.md (bench/nmt_study.py, seeded likewise), and
   the `fedsilo study` reports behind docs/adapters.md and docs/privacy.md (experiments/adapters/
   qa_lora.toml, experiments/privacy/qa_dp.toml over bench/results/{adapters,privacy}-qa/runs): every
   .md file and study.json the render writes, byte for byte, plus the printed comparison table of
   the two `fedsilo study` renders. The only normalisation: the render's own date (the docs stamp
   date.today()) reads <today>. Renders go through bench/identical_render.py, which refuses any
   training (a missing record) and lets a resume accept a recorded config.toml that lacks fields
   added since with empty defaults (the records predate e.g. `exchange.upload_transforms`).
   --quick renders from the records alone (a finished run's results.json is returned without
   building its model and data, as the bench scripts already do for their own runs, and plots are
   saved as empty files: PNGs are not compared); the full mode
   renders as the scripts do (`fedsilo study` builds each run's model and data, checks its config,
   then returns the recorded results: ~10 min for qa-study alone).
2. Runs, each tree into its own folder (A/ITEM and B/ITEM under the scratch root; a path in a file
   is compared with that folder read as <RUN>): every results.json, rounds.jsonl, report.md (per run
   and per silo sub-run), a study's report.md and study.json and its printed comparison table.
   Ignored, as wall-clock time:
     results.json      wall_seconds
     rounds.jsonl      seconds, phase_seconds, eval_seconds (at any depth: a round's and each client's)
     study.json        wall_seconds (at any depth: costs.*, per_seed.*.*.cost)
     report.md         the duration in "Wall time: …" and "wall time …"; the cells of any table
                       column headed "Train s", "Eval s", "seconds" or "wall time…" (the cost table)
   Everything else counts, to the last digit. Runs:
     toy-study (quick)   one `fedsilo study` on the tests' toy ranking task (tests/toytask.py,
                         tiny-bert, 3 silos, 2 rounds): fedavg, finetune, centralized, fedprox,
                         fedopt_lorar (sgdm + Lorar), fedadam_equal, sampled (2 of 3 silos), median,
                         ditto, fedmatch (patches), pulling_dp_g (Dynamic Pulling), dpsgd, silo_dp
                         central and distributed, secagg, secagg_dpsgd, clip_int8 (upload transforms),
                         lora fedit / ffa / exact and lora_fedit_int8; every DP noise `seeded`
     toy-policy (quick)  `fedsilo run` of the toy config with `--policy gamma=…` (require_dp): gamma
                         refuses every round
     qa-small            (full) experiments/qa/small.toml --only fedavg,fedmatch --seeds 0, shrunk
                         (8 train questions x 1 pair, 6 dev/test questions per silo, 2 rounds)
     privacy-dp          (full) experiments/privacy/qa_dp.toml --only eps8 --seeds 0, seeded noise, shrunk
     adapters-lora       (full) experiments/adapters/qa_lora.toml --only fedavg_int8,lora_fedit,
                         lora_ffa,lora_exact --seeds 0, shrunk
     lorar-fedopt        (full) experiments/lorar/small.toml (FedOPT + Lorar, tiny-t5, 8 silos), shrunk
                         (its dev and test evaluation executes SQL: ~6 min per tree on a loaded machine)
     make-study          (full) `make study`'s job: experiments/qa/small.toml, every variant, seeds 0,1
                         (about 10 min per tree on 2 cores)
   Dynamic Pulling runs on the toy task only: the NMT chain (generic.toml, then dp_g.toml from it)
   took over 10 min per tree even shrunk (tokenizer fit and BLEU decoding).

Every command runs with PYTHONHASHSEED=0: the order of a set of strings otherwise changes from one
process to the next, and some results depend on it (found with this script on 5d60571: silo-level
DP's central `noise = "seeded"` draws its noise tensor by tensor in the order of the aggregate's keys,
a set in fedsilo.core.aggregate.combined_mean, so two runs of one config differ completely unless the
hash seed is fixed).

Options: --quick (the items marked quick, and the fast renders); --jobs N (runs at once, default 2:
an item's two trees side by side; renders always one after another, as they share a folder; torch's
thread counts come from the configs' `engine.threads = "auto"`, which depends on the machine, not the
load); --only NAMES (comma-separated items, e.g. toy-study,qa-study); --work DIR (the scratch root,
kept; default: a temporary folder, removed when everything is identical).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
RENDER = HERE / "identical_render.py"
TIME_KEYS = {"results.json": {"wall_seconds"}, "rounds.jsonl": {"seconds", "phase_seconds", "eval_seconds"},
             "study.json": {"wall_seconds"}}
TIME_COLUMN = re.compile(r"^(train s|eval s|seconds|wall time.*)$", re.I)
WALL = re.compile(r"((?i:wall time):? )\d+m \d+s")
RUNNING: set[subprocess.Popen] = set()  # the commands now running, ended with this script
SHRINK_QA = ["task.max_train=8", "task.pairs_per_question=1", "task.max_eval=6", "federation.rounds=2",
             "federation.eval_every=2"]

TOY_BASE = """plugins = ["tests.toytask", "tests.toyplugins"]
plugin_dir = "{plug}"
seed = 5
paradigm = "federated"
[task]
name = "toyrank"
n_train = 8
n_eval = 4
[model]
d_model = 32
d_ff = 64
num_layers = 1
num_heads = 2
[client]
epochs = 1
lr = 1e-3
batch_size = 4
optimizer = "adamw"
logging_steps = 1
[federation]
rounds = 2
weighting = "size"
"""
TOY_VARIANTS = """
[variants.fedavg]
[variants.finetune]
paradigm = "finetune"
[variants.centralized]
paradigm = "centralized"
[variants.fedprox]
client = {regularizers = {prox = 0.01}}
[variants.fedopt_lorar]
federation = {weighting = "lorar"}
server = {optimizer = "sgdm", lr = 1.0, momentum = 0.9}
[variants.fedadam_equal]
federation = {weighting = "equal"}
server = {optimizer = "adam", lr = 0.01}
[variants.sampled]
federation = {sample_count = 2}
[variants.median]
federation = {aggregation = "median"}
[variants.ditto]
client = {regularizers = {personal = 0.5}}
exchange = {overwrite = "none"}
[variants.fedmatch]
federation = {weighting = "equal"}
exchange = {private = ["*patch*"]}
model = {surgery = {name = "patches", options = {kind = "lowrank", insertion = "horizontal", size = 8}}}
[variants.pulling_dp_g]
exchange = {upload = "dp_g", overwrite = "uploaded"}
[variants.dpsgd]
client = {dp = {target_epsilon = 4.0, noise = "seeded"}}
[variants.silo_dp_central]
federation = {silo_dp = {clip = 1.0, noise_multiplier = 2.0, noise = "seeded"}}
[variants.silo_dp_distributed]
[variants.silo_dp_distributed.federation]
weighting = "equal"
silo_dp = {mode = "distributed", clip = 1.0, noise_multiplier = 2.0, noise = "seeded"}
[variants.secagg]
federation = {secure_aggregation = {}}
[variants.secagg_dpsgd]
federation = {secure_aggregation = {}}
client = {dp = {target_epsilon = 4.0, noise = "seeded"}}
[variants.clip_int8]
exchange = {upload_transforms = [{name = "clip", max_norm = 1.0}, {name = "int8"}]}
[variants.lora_fedit]
model = {surgery = {name = "lora", options = {rank = 4, aggregation = "fedit"}}}
[variants.lora_ffa]
model = {surgery = {name = "lora", options = {rank = 4, aggregation = "ffa"}}}
[variants.lora_exact]
model = {surgery = {name = "lora", options = {rank = 4, aggregation = "exact"}}}
[variants.lora_fedit_int8]
model = {surgery = {name = "lora", options = {rank = 4, aggregation = "fedit"}}}
exchange = {upload_transforms = [{name = "int8"}]}
"""


def toy_study(plug: Path) -> str:
    """The toy study file: [base] is TOY_BASE with every table prefixed by `base.`."""
    base = re.sub(r"^\[(\w+)\]$", r"[base.\1]", TOY_BASE.format(plug=plug), flags=re.M)
    return '[study]\nname = "toy"\nmetrics = ["map"]\n\n[base]\n' + base + TOY_VARIANTS


@dataclass
class Item:
    """One compared item: per tree, commands run one after another in the item's folder."""
    name: str
    kind: str                                  # "render" or "run"
    commands: list[list[str]]                  # {tree} and {dir} are filled in per side
    quick: bool = False
    seed_files: dict[str, Path] = field(default_factory=dict)  # copied into the folder first (render)
    copy_records: str | None = None            # bench/results/NAME copied into the folder first (render)
    table: bool = False                        # compare the first printed grid (a `fedsilo study`)
    timeout: int = 3600


def items(a: Path, inputs: Path, quick: bool) -> list[Item]:
    ex = inputs / "experiments"
    fs = ["{python}", "-m", "fedsilo"]
    render_fs = ["{python}", str(RENDER)] + (["--records-only"] if quick else []) + ["-m", "fedsilo"]
    script = ["{python}", str(RENDER)] + (["--records-only"] if quick else [])
    docs = a / "docs"
    out = [
        Item("render qa-study", "render", [script + ["{tree}/bench/qa_study.py", "--out", "bench/results/qa-study",
                                                    "--doc", "docs/qa-study.md", "--seeds", "0,1,2"]],
             quick=True, copy_records="qa-study", timeout=5400),
        Item("render multitask-study", "render",
             [script + ["{tree}/bench/multitask_study.py", "--jobs", "2", "--seeds", "0,1,2", "--out",
                        "bench/results/multitask-study", "--doc", "docs/multitask-study.md"]],
             quick=True, copy_records="multitask-study",
             seed_files={"docs/multitask-study.md": docs / "multitask-study.md"}),
        Item("render lorar-study", "render",
             [script + ["{tree}/bench/study.py", "--seeds", "0,1,2", "--out", "bench/results/lorar-study", "--doc",
                        "docs/lorar-study.md"]], quick=True, copy_records="lorar-study"),
        Item("render nmt-study", "render",
             [script + ["{tree}/bench/nmt_study.py", "--out", "bench/results/nmt-study", "--doc", "docs/nmt-study.md",
                        "--scale", "cpu", "--seeds", "0,1,2"]], quick=True, copy_records="nmt-study",
             seed_files={"docs/nmt-study.md": docs / "nmt-study.md"}),
        Item("render adapters-qa", "render",
             [render_fs + ["study", "experiments/adapters/qa_lora.toml", "--out", "bench/results/adapters-qa/runs",
                           "--no-progress"]], quick=True, copy_records="adapters-qa", table=True, timeout=5400),
        Item("render privacy-qa", "render",
             [render_fs + ["study", "experiments/privacy/qa_dp.toml", "--out", "bench/results/privacy-qa/runs",
                           "--no-progress"]], quick=True, copy_records="privacy-qa", table=True, timeout=5400),
        Item("toy-study", "run", [fs + ["study", str(inputs / "toy_study.toml"), "--out", "toy", "--no-progress"]],
             quick=True, table=True),
        Item("toy-policy", "run", [fs + ["run", str(inputs / "toy.toml"), "--out", "policy", "--no-progress",
                                         "--policy", f"gamma={inputs / 'gamma-policy.toml'}"]], quick=True),
        Item("qa-small", "run", [fs + ["study", str(ex / "qa/small.toml"), "--out", "qa", "--only", "fedavg,fedmatch",
                                       "--seeds", "0", "--no-progress"] + sets(SHRINK_QA)], table=True),
        Item("privacy-dp", "run", [fs + ["study", str(ex / "privacy/qa_dp.toml"), "--out", "privacy", "--only", "eps8",
                                         "--seeds", "0", "--no-progress"]
                                   + sets(SHRINK_QA + ["client.dp.noise=seeded"])], table=True),
        Item("adapters-lora", "run",
             [fs + ["study", str(ex / "adapters/qa_lora.toml"), "--out", "adapters", "--only",
                    "fedavg_int8,lora_fedit,lora_ffa,lora_exact", "--seeds", "0", "--no-progress"]
              + sets(SHRINK_QA)], table=True),
        Item("lorar-fedopt", "run",
             [fs + ["run", str(ex / "lorar/small.toml"), "--out", "lorar", "--no-progress"]
              + sets(["federation.rounds=2", "federation.eval_every=2", "task.max_train=8", "task.max_eval=2",
                      "task.max_source_length=64", "task.max_target_length=48", "client.epochs=1"])]),
        Item("make-study", "run", [fs + ["study", str(ex / "qa/small.toml"), "--out", "qa-small", "--seeds", "0,1",
                                         "--no-progress"]], table=True, timeout=7200),
    ]
    return [i for i in out if i.quick or not quick]


def sets(assignments: list[str]) -> list[str]:
    return [x for a in assignments for x in ("--set", a)]


# ---------------------------------------------------------------------- preparing the inputs


def prepare_inputs(a: Path, inputs: Path) -> None:
    """TREE_A's toy plugins, configs and study files, at one path both trees read."""
    plug = inputs / "plug" / "tests"
    plug.mkdir(parents=True)
    (plug / "__init__.py").write_text("")
    for name in ("toytask.py", "toyplugins.py"):
        shutil.copy(a / "tests" / name, plug / name)
    (inputs / "toy_study.toml").write_text(toy_study(plug.parent))
    (inputs / "toy.toml").write_text('name = "toy"\n' + TOY_BASE.format(plug=plug.parent))
    (inputs / "gamma-policy.toml").write_text("require_dp = true\n")
    shutil.copytree(a / "experiments", inputs / "experiments")


# ---------------------------------------------------------------------- running one side


def run_side(item: Item, tree: Path, folder: Path, a: Path, inputs: Path, env: dict) -> tuple[str | None, str]:
    """Run an item's commands for one tree in `folder`; (error or None, stdout of the last command)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if item.copy_records:
        shutil.copytree(a / "bench" / "results" / item.copy_records, folder / "bench" / "results" / item.copy_records)
        shutil.copytree(inputs / "experiments", folder / "experiments")
    for rel, src in item.seed_files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, folder / rel)
    (folder / "docs").mkdir(exist_ok=True)
    side_env = {**env, "PYTHONPATH": str(tree), "FLWR_TELEMETRY_ENABLED": "0", "PYTHONHASHSEED": "0"}
    stdout = ""
    for command in item.commands:
        argv = [c.format(python=sys.executable, tree=tree, dir=folder) for c in command]
        proc = subprocess.Popen(argv, cwd=folder, env=side_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        RUNNING.add(proc)
        try:
            out, err = proc.communicate(timeout=item.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return f"timed out after {item.timeout} s: {' '.join(argv[1:])}", stdout
        finally:
            RUNNING.discard(proc)
        with (folder.parent / f"{folder.name}.log").open("a") as log:
            log.write(f"$ {' '.join(argv)}\n{out}\n{err}\n")
        stdout = out
        if proc.returncode:
            last = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "") or \
                next((ln for ln in reversed(out.splitlines()) if ln.strip()), "")
            return f"exit {proc.returncode}: {last[-300:]}", stdout
    return None, stdout


def stop_running(signum, frame) -> None:
    """SIGTERM or Ctrl-C: end the fedsilo commands this script started (each by its pid), then exit."""
    for proc in list(RUNNING):
        proc.kill()
    os._exit(128 + signum)


# ---------------------------------------------------------------------- comparing


def strip_keys(value, keys: set[str]):
    if isinstance(value, dict):
        return {k: strip_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [strip_keys(v, keys) for v in value]
    return value


def first_json_difference(x, y, where: str = "") -> str | None:
    """The path of the first difference between two JSON values (dict keys in x's order), or None."""
    if isinstance(x, dict) and isinstance(y, dict):
        for key in list(x) + [k for k in y if k not in x]:
            if key not in y:
                return f"{where}.{key}: only in A"
            if key not in x:
                return f"{where}.{key}: only in B"
            found = first_json_difference(x[key], y[key], f"{where}.{key}")
            if found:
                return found
        if list(x) != list(y):
            return f"{where}: keys in another order"
        return None
    if isinstance(x, list) and isinstance(y, list):
        for i, (p, q) in enumerate(zip(x, y)):
            found = first_json_difference(p, q, f"{where}[{i}]")
            if found:
                return found
        return None if len(x) == len(y) else f"{where}: {len(x)} vs {len(y)} items"
    if type(x) is not type(y) or x != y:
        return f"{where or '(top)'}: {short(x)} vs {short(y)}"
    return None


def short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def mask_tables(text: str) -> str:
    """Wall-clock durations in a report.md: "Wall time: 0m 07s" and the cells of time columns."""
    text = WALL.sub(r"\1<time>", text)
    out, masked = [], []
    for line in text.split("\n"):
        if line.startswith("|"):
            cells = line.split("|")
            if not masked and not set(line) <= set("|-: "):  # a header row
                masked = [i for i, c in enumerate(cells) if TIME_COLUMN.match(c.strip())]
                masked = masked or [-1]
            elif not set(line) <= set("|-: "):
                for i in masked:
                    if 0 <= i < len(cells) - 1:
                        cells[i] = " <time> "
                line = "|".join(cells)
        else:
            masked = []
        out.append(line)
    return "\n".join(out)


def normalise(text: str, roots: list[Path], today: list[str]) -> str:
    for root in roots:
        text = text.replace(str(root), "<RUN>")
    for day in today:
        text = text.replace(day, "<today>")
    return text


def compare_text(x: str, y: str) -> str | None:
    lx, ly = x.split("\n"), y.split("\n")
    for n, (p, q) in enumerate(zip(lx, ly), 1):
        if p != q:
            i = next((j for j, (c, d) in enumerate(zip(p, q)) if c != d), min(len(p), len(q)))
            start = max(0, i - 30)
            cut = "…" if start else ""
            return f"line {n}, column {i + 1}: {cut}{p[start:i + 50]!r} vs {cut}{q[start:i + 50]!r}"
    return None if len(lx) == len(ly) else f"{len(lx)} vs {len(ly)} lines"


def compare_file(name: str, pa: Path, pb: Path, roots: list[Path], today: list[str], kind: str) -> str | None:
    ta, tb = (normalise(p.read_text(errors="replace"), roots, today) for p in (pa, pb))
    if kind == "render":  # byte for byte, but for the date and the scratch paths
        return compare_text(ta, tb)
    if name in ("results.json", "study.json"):
        keys = TIME_KEYS[name]
        return first_json_difference(strip_keys(json.loads(ta), keys), strip_keys(json.loads(tb), keys))
    if name == "rounds.jsonl":
        ra, rb = ([strip_keys(json.loads(ln), TIME_KEYS[name]) for ln in t.splitlines() if ln.strip()]
                  for t in (ta, tb))
        return first_json_difference(ra, rb, "rounds")
    if name.endswith(".md"):
        return compare_text(mask_tables(ta), mask_tables(tb))
    return compare_text(ta, tb)


def compared_files(folder: Path, kind: str) -> list[Path]:
    names = {"results.json", "rounds.jsonl", "study.json"}
    wanted = names if kind == "run" else {"study.json"}
    return sorted(p.relative_to(folder) for p in folder.rglob("*")
                  if p.is_file() and (p.suffix == ".md" or p.name in wanted))


def first_grid(stdout: str) -> str:
    """The first table a `fedsilo study` prints (rich's box: title, ┏ … └): the comparison."""
    lines = stdout.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("┏")), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("└")), len(lines) - 1)
    return "\n".join(lines[max(0, start - 1):end + 1])


def compare_item(item: Item, fa: Path, fb: Path, outs: tuple[str, str], roots: list[Path],
                 today: list[str]) -> list[tuple[str, str | None]]:
    """(what, None if identical else the first difference) for the compared files of an item: one line
    per run folder (its results.json, rounds.jsonl, report.md), per other file, and for a render one
    line for all the per-run report.md files; a difference names its file."""
    files_a, files_b = compared_files(fa, item.kind), compared_files(fb, item.kind)
    groups: dict[str, list[Path]] = {}
    for rel in sorted(set(files_a) | set(files_b)):
        run = (fa / rel.parent / "results.json").is_file() or (fb / rel.parent / "results.json").is_file()
        key = ("report.md of every recorded run" if item.kind == "render" and run else
               f"{rel.parent}/" if run else str(rel))
        groups.setdefault(key, []).append(rel)
    lines = []
    for key, rels in groups.items():
        diffs = []
        for rel in rels:
            if rel not in files_b:
                diffs.append(f"{rel}: only in A")
            elif rel not in files_a:
                diffs.append(f"{rel}: only in B")
            else:
                try:
                    found = compare_file(rel.name, fa / rel, fb / rel, roots, today, item.kind)
                except (ValueError, UnicodeDecodeError) as err:
                    found = f"unreadable: {err}"
                if found:
                    diffs.append(found if str(rel) == key else f"{rel}: {found}")
        names = sorted({r.name for r in rels})
        what = f"{item.name}: {key}" + (f" ({len(rels)} files)" if len(rels) > len(names) else
                                        f" ({', '.join(names)})" if key.endswith("/") else "")
        lines.append((what, "; ".join(diffs[:2]) + (f"; and {len(diffs) - 2} more" if len(diffs) > 2 else "")
                      if diffs else None))
    if item.table:
        grids = [normalise(first_grid(o), roots, today) for o in outs]
        lines.append((f"{item.name}: printed table", compare_text(*grids) if all(grids) else
                      "no table printed" if grids[0] == grids[1] else "printed by one side only"))
    if not lines:
        lines.append((f"{item.name}: (no output files)", "nothing to compare"))
    return lines


def default_mirror(a: Path) -> str | None:
    for candidate in (os.environ.get("FEDSILO_DATA_MIRROR"), a.parent / "shared" / "data", HERE.parents[1] / "shared"
                      / "data", Path("/work/shared/data")):
        if candidate and Path(candidate).is_dir():
            return str(candidate)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="the tree before (A)")
    ap.add_argument("b", type=Path, help="the tree after (B)")
    ap.add_argument("--quick", action="store_true", help="the quick items only (tiny runs, renders from the records)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: an item's two trees side by side)")
    ap.add_argument("--only", help="comma-separated item names (e.g. toy-study,'render qa-study')")
    ap.add_argument("--work", type=Path, help="scratch root, kept (default: a temporary folder, removed)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, stop_running)
    signal.signal(signal.SIGINT, stop_running)
    a, b = args.a.resolve(), args.b.resolve()
    root = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="identical-"))
    if root.exists() and args.work:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    inputs = root / "in"
    prepare_inputs(a, inputs)
    env = dict(os.environ)
    mirror = default_mirror(a)
    if mirror:
        env["FEDSILO_DATA_MIRROR"] = mirror
    chosen = items(a, inputs, args.quick)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [i for i in chosen if i.name in wanted or i.name.removeprefix("render ") in wanted]
    t0 = time.perf_counter()
    print(f"A = {a}\nB = {b}\nscratch: {root}; {len(chosen)} item(s){' (--quick)' if args.quick else ''}", flush=True)
    slug = {i.name: re.sub(r"\W+", "-", i.name) for i in chosen}
    # a render runs in the same folder for both trees (paths in the docs), one side after the other
    sides = [(i, label, tree) for i in chosen for label, tree in (("A", a), ("B", b))]

    def folder(item: Item, label: str) -> Path:
        return root / ("render" if item.kind == "render" else label) / slug[item.name]

    def one(side):
        item, label, tree = side
        start = time.perf_counter()
        got = run_side(item, tree, folder(item, label), a, inputs, env)
        if item.kind == "render":  # keep A's output apart: B renders into the same path
            kept = root / "rendered" / label / slug[item.name]
            if kept.exists():
                shutil.rmtree(kept)
            shutil.copytree(folder(item, label), kept, symlinks=True)
        return got, time.perf_counter() - start

    results: dict[tuple[str, str], tuple] = {}
    renders = [s for s in sides if s[0].kind == "render"]
    runs = [s for s in sides if s[0].kind == "run"]
    for side in renders:  # one after another: they share a folder
        results[(side[0].name, side[1])] = one(side)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for side, got in zip(runs, pool.map(one, runs)):
            results[(side[0].name, side[1])] = got
    today = sorted({date.today().isoformat(), *(time.strftime("%Y-%m-%d", time.localtime(time.time() - 60 * s))
                                                for s in (0, 30, 60, 120, 240))})
    bad = 0
    for item in chosen:
        (err_a, out_a), sec_a = results[(item.name, "A")]
        (err_b, out_b), sec_b = results[(item.name, "B")]
        timing = f"({sec_a:.0f} s / {sec_b:.0f} s)"
        if err_a or err_b:
            if err_a == err_b:
                print(f"FAILED     {item.name}: both trees: {err_a} {timing}", flush=True)
            else:
                print(f"DIFFERENT  {item.name}: A {err_a or 'ok'}; B {err_b or 'ok'} {timing}", flush=True)
            bad += 1
            continue
        if item.kind == "render":
            fa, fb = root / "rendered" / "A" / slug[item.name], root / "rendered" / "B" / slug[item.name]
            roots = [root / "render" / slug[item.name]]
        else:
            fa, fb = folder(item, "A"), folder(item, "B")
            roots = [fa, fb]
        for what, diff in compare_item(item, fa, fb, (out_a, out_b), roots, today if item.kind == "render" else []):
            print(f"{'IDENTICAL ' if diff is None else 'DIFFERENT '} {what}" + (f": {diff}" if diff else ""),
                  flush=True)
            bad += diff is not None
        print(f"           {item.name}: ran {timing}", flush=True)
    print(f"{'all identical' if not bad else f'{bad} item(s) not identical'} "
          f"({(time.perf_counter() - t0) / 60:.1f} min); logs: {root}/*/*.log", flush=True)
    if not args.work and not bad:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
