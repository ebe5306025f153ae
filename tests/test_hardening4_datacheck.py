"""`fedsilo data check` after issue 50 (docs/reliability.md): a study file is checked as it will run
(each data setup among its variants and seeds, with those runs' own tokenizer and lengths), and each
silo's counts are the ones a run uses (after max_train, max_eval), beside the files' where they differ.
Every file is written here (tmp_path): no benchmark data is read. And the docs cite only files that exist."""
import csv
import importlib.util
import json
import random
import re
import subprocess
from pathlib import Path

from fedsilo.cli import main

WORDS = [("der", "the"), ("vertrag", "contract"), ("gilt", "applies"), ("ab", "from"), ("heute", "today"),
         ("und", "and"), ("endet", "ends"), ("morgen", "tomorrow"), ("das", "the"), ("gericht", "court")]

BASE = """\
seed = 0
[task]
name = "translation"
tokenizer_domain = "north"
matrix = []
vocab_size = 120
max_source_length = 24
max_target_length = 24
[task.sources.north]
path = "north.csv"
split = {dev = 0.1, test = 0.1}
[task.sources.south]
path = "south.csv"
split = {dev = 0.1, test = 0.1}
[model]
d_model = 16
d_ff = 32
num_layers = 1
num_decoder_layers = 1
num_heads = 2
[client]
batch_size = 8
[federation]
rounds = 1
"""

# variant → what it changes, as a study's [variants.NAME] table and as `--set` on the base config
VARIANTS = {
    "plain": {},
    "slow": {"client.lr": "1e-4"},                                                   # same data as plain
    "short": {"task.max_train": "10", "task.max_eval": "2", "task.max_source_length": "8"},
    "bpe": {"task.tokenizer_model": '"bpe"'},                                       # another tokenizer
}


def write_pairs(path: Path, seed: int, n: int = 40) -> None:
    rnd = random.Random(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "target"])
        for i in range(n):
            idx = [rnd.randrange(len(WORDS)) for _ in range(rnd.randint(3, 12))]
            w.writerow([" ".join(WORDS[j][0] for j in idx) + f" {seed}{i}", " ".join(WORDS[j][1] for j in idx) + f" {seed}{i}"])


def project(root: Path) -> Path:
    """Two silos of 40 pairs each, a run config over them, and a study of four variants on it."""
    root.mkdir(parents=True, exist_ok=True)
    write_pairs(root / "north.csv", 1)
    write_pairs(root / "south.csv", 2)
    (root / "base.toml").write_text(BASE)
    tables = []
    for name, change in VARIANTS.items():
        sections: dict[str, list[str]] = {}
        for key, value in change.items():
            section, _, field = key.partition(".")
            sections.setdefault(section, []).append(f"{field} = {value}")
        tables.append(f"[variants.{name}]\n" + "".join(f"{s} = {{{', '.join(v)}}}\n" for s, v in sections.items()))
    (root / "study.toml").write_text('[study]\nname = "own"\nseeds = [0, 1]\nconfig = "base.toml"\n\n'
                                     + "\n".join(tables))
    return root


def sets(change: dict) -> list[str]:
    return [arg for key, value in change.items() for arg in ("--set", f"{key}={value}")]


def test_a_study_file_is_checked_per_data_setup_with_its_runs_own_tokenizer_and_lengths(tmp_path, capsys):
    root = project(tmp_path / "p")
    assert main(["data", "check", str(root / "study.toml"), "--json", str(tmp_path / "study.json")]) == 0
    out = capsys.readouterr().out
    assert "study own: 8 runs (4 variants × 2 seeds) in 3 data setups" in out
    assert "data setup 1 of 3: variants plain, slow; seeds 0, 1" in out  # one block for the two
    assert "data setup 2 of 3: variant short; seeds 0, 1" in out and "data setup 3 of 3: variant bpe" in out
    setups = json.loads((tmp_path / "study.json").read_text())["setups"]
    assert [s["runs"] for s in setups] == [{"plain": [0, 1], "slow": [0, 1]}, {"short": [0, 1]}, {"bpe": [0, 1]}]
    for name, change in VARIANTS.items():  # each block is what the variant's own config checks to
        assert main(["data", "check", str(root / "base.toml"), *sets(change), "--json", str(tmp_path / "one.json")]) == 0
        alone = json.loads((tmp_path / "one.json").read_text())
        (block,) = [s["silos"] for s in setups if name in s["runs"]]
        assert block == alone
    capsys.readouterr()
    lengths = {name: s["silos"][0]["lengths"] for s in setups for name in s["runs"]}
    assert {x["limit"] for x in lengths["short"]} == {8, 24} and {x["limit"] for x in lengths["plain"]} == {24}
    assert lengths["bpe"] != lengths["plain"]  # counted with the BPE tokenizer its runs fit, not the base's


def test_a_study_file_that_is_malformed_is_one_error_naming_it(tmp_path, capsys):
    root = project(tmp_path / "p")
    (root / "study.toml").write_text('[study]\nname = "own"\nconfig = "base.toml"\n[variants.x]\ntask = {max_trian = 3}\n')
    assert main(["data", "check", str(root / "study.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsilo: error: ") and "[variants.x]" in err and "max_trian" in err


def test_a_study_whose_variant_reads_a_malformed_file_fails_that_setup_by_name(tmp_path, capsys):
    root = project(tmp_path / "p")
    (root / "bad.csv").write_text((root / "north.csv").read_text() + '"unclosed,quote\n')
    with open(root / "study.toml", "a") as f:
        f.write('\n[variants.bad]\ntask = {sources = {north = {path = "bad.csv"}}}\n')
    assert main(["data", "check", str(root / "study.toml"), "--no-lengths"]) == 1
    out = capsys.readouterr().out
    assert "data setup 4 of 4: variant bad; seeds 0, 1" in out
    assert "study own: data setup 4 cannot be run" in out and f"{root / 'bad.csv'}:42" in out
    assert out.count("2 silo(s) checked: ready to run") == 3  # the other three setups, files' counts only
    assert "after max_train and max_eval, is counted with the task built, which --no-lengths skips" in out


def test_each_silo_says_what_a_run_uses_after_max_train_and_max_eval(tmp_path, capsys):
    root = project(tmp_path / "p")
    argv = ["data", "check", str(root / "base.toml"), "--json", str(tmp_path / "check.json")]
    assert main([*argv, "--set", "task.max_train=10", "--set", "task.max_eval=2"]) == 0
    out = capsys.readouterr().out
    assert "silo north (csv): 32 train, 4 dev, 4 test pairs" in out  # the files, split 0.8 / 0.1 / 0.1
    assert ("  a run uses: train 10 from these 32 (max_train = 10); dev 2 from these 4 (max_eval = 2); "
            "test 2 from these 4 (max_eval = 2)") in out
    north = json.loads((tmp_path / "check.json").read_text())[0]
    assert north["counts"] == {"train": 32, "dev": 4, "test": 4}
    assert north["used"] == {"train": 10, "dev": 2, "test": 2}

    assert main(argv) == 0  # no cap: all of them
    out = capsys.readouterr().out
    assert out.count("  a run uses all of them") == 2
    assert json.loads((tmp_path / "check.json").read_text())[0]["used"] == {"train": 32, "dev": 4, "test": 4}


def test_a_seed_that_draws_another_few_shot_sample_is_another_data_setup(tmp_path):
    """A study seed shifts multitask's sample seeds (studyfile.seeded) unless a variant fixes them: the
    runs of seed 1 read other examples, so they are checked apart (the configs alone: no data is read)."""
    from fedsilo.runs.datastudy import study_setups

    study = tmp_path / "mt.toml"
    study.write_text('[study]\nname = "mt"\nseeds = [0, 1]\n[base.task]\nname = "multitask"\n'
                     'tasks = ["glue-sst2", "superglue-cb"]\nclients = 2\n'
                     '[variants.drawn]\n[variants.fixed]\ntask = {sample_seeds = [100]}\n')
    setups = study_setups(study, []).setups
    assert [(s.runs, s.cfg.task.sample_seeds) for s in setups] == [
        ({"drawn": [0], "fixed": [0, 1]}, [100]), ({"drawn": [1]}, [101])]
    assert setups[0].covers() == "variants drawn (seed 0), fixed (seeds 0, 1)"


REPO = Path(__file__).resolve().parents[1]
# A file of this repository, or a module of an installed package, as the docs and the experiments' comments cite them.
CITED = re.compile(r"(?<![\w/.$-])((?:fedsilo|docs|bench|experiments|tests|tools|examples)/[\w./+-]*?"
                   r"\.(?:py|md|toml|json|jsonl|tsv|csv|txt|sh|yaml|tpl))(?![\w/])")
PACKAGED = re.compile(r"(?<![\w/.$-])((flwr|transformers|peft|torch|tokenizers)/[\w./-]*?\.py)(?![\w/])")
WRITTEN = re.compile(r"--(?:out|json|doc)[ =]$")  # a path a command writes, not one it cites
PLACEHOLDER = re.compile(r"/[A-Z][A-Z_]+(?=[/.]|$)|seed-S")  # runs/STEM/VARIANT, seed-S: stand for a user's names


def citations():
    """(file:line, path, its package or None) of every path cited in docs/*.md and experiments/**/*.toml comments."""
    for doc in sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "experiments").rglob("*.toml")):
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            text = line.partition("#")[2] if doc.suffix == ".toml" else line
            where = f"{doc.relative_to(REPO)}:{n}"
            for m in CITED.finditer(text):
                if not WRITTEN.search(text[:m.start()]) and not PLACEHOLDER.search(m.group(1)):
                    yield where, m.group(1), None
            for m in PACKAGED.finditer(text):
                yield where, m.group(1), m.group(2)


def git_ignored(paths):
    """Those of `paths` a clean clone lacks: ignored by git and not tracked (none outside a git checkout)."""
    if not paths or not (REPO / ".git").exists():
        return set()
    done = subprocess.run(["git", "check-ignore", "--stdin"], cwd=REPO, input="\n".join(paths),
                          capture_output=True, text=True)
    return set(done.stdout.split())


def test_every_path_the_docs_and_experiments_cite_exists():
    """docs/instruct-bench.md once cited bench/results/instruct_throughput.json, a file never committed; and
    docs/benchmarks.md cited two records bench/results/.gitignore kept out of git, present here and absent
    from CI's clean clone (issue 52's stop)."""
    missing, in_repo = [], []
    for where, path, package in citations():
        root = REPO if package is None else Path(importlib.util.find_spec(package).origin).parent.parent
        if not (root / path).exists():
            missing.append(f"{where}: {path}" + (f" (not in the installed {package})" if package else ""))
        elif package is None:
            in_repo.append((where, path))
    ignored = git_ignored(sorted({path for _, path in in_repo}))
    missing += [f"{where}: {path} (ignored by git: not in a clean clone)" for where, path in in_repo if path in ignored]
    assert missing == []


def test_every_choice_of_a_client_setting_is_in_the_usage_reference():
    """usage.md's [client] row listed schedule_span's `run` and `round`, not `server_rounds`, which
    experiments/instruct/flowertune.toml and docs/instruct.md use."""
    import typing

    from fedsilo.client.settings import ClientConfig

    row = next(line for line in (REPO / "docs" / "usage.md").read_text().splitlines() if line.startswith("| `[client]`"))
    choices = {name: typing.get_args(f.annotation) for name, f in ClientConfig.model_fields.items()
               if typing.get_origin(f.annotation) is typing.Literal}
    assert "schedule_span" in choices
    assert [f"{name} = {v!r}" for name, values in choices.items() for v in values if f"`{v}`" not in row] == []
