"""A newcomer's traps around `fedsilo init` for instruction data (issue 50, /work/newcomer/REPORT.md):
a silo whose rows share one instruction (init groups it by input, the split error names split.by),
the instruct config's generic base (its sizes, a commented init_from, and an init_from of other
sizes named by setting), `data check`'s exit code for a silo that cannot be split, init's help on
.json arrays, the experiment's name, the warning prefix under progress bars, the instruct table's
legend, and `generate --input`. Every file is written here; one tiny run (a tokenizer fitted on a
small GSM8K-shaped file written here) serves the tests that need a trained run.
"""
import contextlib
import csv
import io
import json
import re
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from fedsilo.cli import main
from fedsilo.config import load_config
from fedsilo.errors import DataError
from fedsilo.progress import Progress
from fedsilo.runs.tables import table_caption
from fedsilo.sources.load import load_rows

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "List each drug and the adverse effect it caused in this case report sentence."


def write_one_instruction_csv(path: Path, n: int = 40, inputs_differ: bool = True) -> Path:
    """lakeview's shape: one fixed instruction (column prompt), the text in context, the answer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "context", "answer"])
        for i in range(n):
            w.writerow([INSTRUCTION, f"Patient {i} took drug {i} and had a rash." if inputs_differ else "A rash.",
                        f"drug: drug {i}, adverse effect: rash"])
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def alpaca_rows(n: int) -> list[dict]:
    return [{"instruction": f"What is fact {i}?", "input": "", "output": f"Fact {i} is true."} for i in range(n)]


def hospitals(root: Path) -> Path:
    write_one_instruction_csv(root / "lakeview.csv")
    write_jsonl(root / "northside.jsonl", alpaca_rows(30))
    return root


def init(data: Path, out: Path, task: str = "instruct") -> int:
    return main(["init", str(data), "--task", task, "--out", str(out)])


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("fedsilo: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ---- 1. rows sharing one instruction ------------------------------------------------------------------

def test_init_groups_a_silo_whose_rows_share_one_instruction_by_its_input(tmp_path, capsys):
    """Before: init wrote `split = {dev = 0.1, test = 0.1, seed = 0}  # ... grouped by instruction`,
    which no run could split (1 distinct instruction). Now it writes by = "input" with a DECIDE line
    saying why, and the other silo keeps the default grouping."""
    config = tmp_path / "hospitals.toml"
    assert init(hospitals(tmp_path / "data"), config) == 0
    out = capsys.readouterr().out
    assert re.search(r"DECIDE for lakeview: .*1 distinct instruction.*40 distinct input.*split\.by", out), out
    text = config.read_text()
    assert re.search(r'^split = \{dev = 0\.1, test = 0\.1, seed = 0, by = "input"\}  # .*grouped by input', text,
                     re.M), text
    cfg = load_config(config)
    assert cfg.task.sources["lakeview"].split.by == "input"
    assert cfg.task.sources["northside"].split.by is None
    counts = {s: len(rows) for s, rows in load_rows("lakeview", cfg.task.sources["lakeview"]).splits.items()}
    assert counts == {"train": 32, "dev": 4, "test": 4}


def test_a_split_of_one_instruction_names_its_grouping_and_split_by_input(tmp_path):
    """Before: `1 distinct instruction value(s) ... cannot be split ...; give more rows, or files per
    split`, and more rows would not help. Now the error names the grouping key and the fix."""
    path = write_one_instruction_csv(tmp_path / "lakeview.csv")
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "instruct"\n[task.sources.lakeview]\npath = "lakeview.csv"\n'
                      'fields = {instruction = "prompt", response = "answer", input = "context"}\n'
                      "split = {dev = 0.1, test = 0.1}\n")
    with pytest.raises(DataError) as err:
        load_rows("lakeview", load_config(config).task.sources["lakeview"])
    said = str(err.value)
    assert f"1 distinct instruction value(s) in {path} cannot be split into train and dev and test" in said
    assert "groups rows by instruction" in said and "40 distinct values" in said
    assert 'set split.by = "input" in [task.sources.lakeview]' in said and "give more rows" not in said


def test_a_split_of_one_instruction_and_one_input_asks_for_files_per_split(tmp_path):
    write_one_instruction_csv(tmp_path / "same.csv", inputs_differ=False)
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "instruct"\n[task.sources.same]\npath = "same.csv"\n'
                      'fields = {instruction = "prompt", response = "answer", input = "context"}\n'
                      "split = {dev = 0.1, test = 0.1}\n")
    with pytest.raises(DataError, match=r"groups rows by instruction .*: give rows with more distinct instruction "
                                        r"values, or files per split$"):
        load_rows("same", load_config(config).task.sources["same"])


def test_your_data_lists_the_instruct_split_keys_and_says_one_thing_about_the_overlap():
    """Before: section 6 said an overlap is 'the instruction with its input', the reference table
    'split and compared by instruction', and no `by` value was listed for instruction data."""
    doc = (ROOT / "docs" / "your-data.md").read_text()
    section = doc[doc.index("## 6. Instruction data"):doc.index("## 7.")]
    row = next(line for line in doc.splitlines() if line.startswith("| `instruct` |"))
    for text in (section, row):
        assert 'by = "input"' in text, text[:200]
        assert "the instruction with its input" in text
    assert "compared by instruction" not in doc
    assert re.search(r"`split\.by`.*`instruction`.*`input`.*`response`.*`system`", section.replace("\n", " "))


# ---- 2. starting from the generic base ----------------------------------------------------------------

def test_inits_instruct_config_carries_the_generic_bases_sizes_and_a_commented_init_from(tmp_path, capsys):
    """Before: the instruct config had no model sizes and no init_from; uncommenting
    model.init_from alone failed on a tensor's shape. Now [model] is experiments/instruct/generic.toml's
    sizes and uncommenting init_from gives a config that loads."""
    config = tmp_path / "mine.toml"
    assert init(hospitals(tmp_path / "data"), config) == 0
    capsys.readouterr()
    text = config.read_text()
    assert "experiments/instruct/generic.toml" in text
    generic = tomllib.loads((ROOT / "experiments" / "instruct" / "generic.toml").read_text())["model"]
    model = tomllib.loads(text)["model"]
    sizes = ("kind", "d_model", "d_ff", "num_layers", "num_heads")
    assert {k: model[k] for k in sizes} == {k: generic[k] for k in sizes}
    recipe = re.sub(r"^# (init_from = )", r"\1", text, flags=re.M)
    assert recipe.count("\n") == text.count("\n") and recipe != text
    config.write_text(recipe)
    assert load_config(config).model.init_from == "runs/generic"


# ---- the tiny run the next tests read ----------------------------------------------------------------

def write_run_config(root: Path, d_ff: int = 64, init_from: Path | None = None) -> Path:
    """An own silo (Alpaca rows with an input each) and a tokenizer fitted on a GSM8K-shaped file."""
    gsm8k = root / "bench" / "gsm8k"
    if not gsm8k.is_dir():
        write_jsonl(gsm8k / "train.jsonl", [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n"
                                             f"#### {i + 1}"} for i in range(480)])
        write_jsonl(gsm8k / "test.jsonl", [{"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"}
                                           for i in range(4)])
        write_jsonl(root / "desk.jsonl", [{"instruction": "Name the colour of the item.", "output": f"colour {i}",
                                           "input": f"item {i} of {3 * i} apples, " + "red " * (i % 7) * 6}
                                          for i in range(40)])
    config = root / f"run-{d_ff}.toml"
    config.write_text(f'name = "newcomer"\n[task]\nname = "instruct"\nsilos = ["desk"]\n'
                      f'data_dir = "{root / "bench"}"\n'
                      'tokenizer_silo = "gsm8k"\nvocab_size = 300\nmax_length = 48\nmax_new_tokens = 2\n'
                      'max_prompt_length = 4\n'
                      '[task.sources.desk]\npath = "desk.jsonl"\nfields = {response = "output"}\n'
                      'split = {dev = 0.1, test = 0.1, by = "input"}\n'
                      f'[model]\nkind = "causal"\nd_model = 32\nd_ff = {d_ff}\nnum_layers = 1\nnum_heads = 4\n'
                      + (f'init_from = "{init_from}"\n' if init_from else "")
                      + '[client]\noptimizer = "adamw"\nlr = 1e-2\nbatch_size = 4\nsteps = 1\n'
                      '[federation]\nrounds = 1\n[engine]\nthreads = 1\n')
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One round of one step, with progress bars (as a newcomer's first run), its stderr kept."""
    root = tmp_path_factory.mktemp("newcomer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSILO_DATA", str(root / "data-root"))
        mp.setenv("FEDSILO_CACHE_DIR", str(root / "cache"))
        config = write_run_config(root)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["run", str(config), "--out", str(root / "run")]) == 0, err.getvalue()
        yield SimpleNamespace(root=root, path=root / "run", err=err.getvalue())


# ---- 2. init_from of other model sizes ----------------------------------------------------------------

def test_init_from_a_run_of_other_sizes_names_each_setting_that_differs(run, capsys):
    """Before: `tensor ... has shape (64, 32), the wrong shape: the model's is (96, 32) (another
    tokenizer or model size?)`. Now the line also names the settings that differ, there and here."""
    config = write_run_config(run.root, d_ff=96, init_from=run.path)
    assert main(["run", str(config), "--out", str(run.root / "other"), "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "the wrong shape" in line
    assert f"{run.path / 'config.toml'} differs from this config in model.d_ff = 64 there, 96 here" in line
    assert "d_model" not in line.split("differs")[1]  # only what differs


# ---- 3. data check's exit code ------------------------------------------------------------------------

def test_data_check_reports_a_silo_that_cannot_be_split_as_a_blocking_row(tmp_path, capsys):
    """Before: `fedsilo: error: silo lakeview: 1 distinct instruction value(s) ...`, exit 2, no other
    silo reported. Now that silo is a row that cannot be run, the others are checked, exit 1."""
    config = tmp_path / "c.toml"
    data = hospitals(tmp_path / "data")
    config.write_text('[task]\nname = "instruct"\n'
                      f'[task.sources.lakeview]\npath = "{data / "lakeview.csv"}"\n'
                      'fields = {instruction = "prompt", response = "answer", input = "context"}\n'
                      "split = {dev = 0.1, test = 0.1}\n"
                      f'[task.sources.northside]\npath = "{data / "northside.jsonl"}"\n'
                      'fields = {response = "output"}\nsplit = {dev = 0.1, test = 0.1}\n')
    assert main(["data", "check", str(config), "--no-lengths"]) == 1
    captured = capsys.readouterr()
    assert "error" not in captured.err
    out = captured.out
    assert re.search(r"^silo lakeview \(csv\): cannot be run: 1 distinct instruction value\(s\) .*split\.by = "
                     r'"input"', out, re.M), out
    assert re.search(r"^silo northside \(jsonl\): 24 train, 3 dev, 3 test records$", out, re.M), out
    assert out.rstrip().endswith("2 silo(s) checked: 1 cannot be run (lakeview)")


def test_data_check_json_marks_the_silo_that_cannot_be_split(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "instruct"\n'
                      f'[task.sources.lakeview]\npath = "{write_one_instruction_csv(tmp_path / "l.csv")}"\n'
                      'fields = {instruction = "prompt", response = "answer", input = "context"}\n'
                      "split = {dev = 0.1, test = 0.1}\n")
    assert main(["data", "check", str(config), "--no-lengths", "--json", str(tmp_path / "c.json")]) == 1
    capsys.readouterr()
    (row,) = json.loads((tmp_path / "c.json").read_text())
    assert row["blocking"] and "cannot be split" in row["error"]


# ---- 4. init's help ------------------------------------------------------------------------------------

def test_inits_help_names_json_arrays(capsys):
    """Before: the help listed "CSV, TSV, JSONL, or line-aligned files"."""
    assert main(["init", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert ".json (one JSON array of rows" in help_text


# ---- 5. the experiment's name --------------------------------------------------------------------------

def test_init_names_the_experiment_after_the_config_it_writes(tmp_path, capsys):
    """Before: `name = "data"`, the data folder's name, which titles every run table."""
    config = tmp_path / "hospitals.toml"
    assert init(hospitals(tmp_path / "data"), config) == 0
    capsys.readouterr()
    assert load_config(config).name == "hospitals"
    assert re.search(r'^name = "hospitals"  # .*this file', config.read_text(), re.M)


# ---- 6. the warning prefix under progress bars, the legend's full stop ----------------------------------

def test_a_warning_under_progress_bars_is_a_fedsilo_warning_line(run):
    """Before: the train truncation warning came as a bare log line (`[03:46:07] instruct: northside
    train: ...`), wrapped, without `fedsilo: warning:`."""
    assert re.search(r"^fedsilo: warning: instruct: desk train: \d+ of 32 records are longer than "
                     r"task\.max_length = 48 tokens", run.err, re.M), run.err


def test_a_warning_under_progress_bars_keeps_its_brackets():
    out = io.StringIO()
    said = 'silo bank: set bad_rows = "skip" in [task.sources.bank] to leave them out'
    with Progress(True, Console(file=out, width=60)) as progress:
        progress.warn(said)
    assert f"fedsilo: warning: {said}" in out.getvalue()


def test_the_instruct_tables_legend_ends_its_metrics_sentence(run):
    """Before: '... read without its start A silo's cell: ...'."""
    caption = table_caption(json.loads((run.path / "results.json").read_text()))
    assert "read without its start. A silo's cell" in caption


# ---- 7. generate --input -------------------------------------------------------------------------------

def prompt_tokens(capsys, *args: str) -> int:
    """The prompt's length in tokens, from generate's warning (the run reads at most 4)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # as a fresh process shows each warning
        assert main(["generate", *args]) == 0
    found = re.findall(r"generate: the prompt is (\d+) tokens", capsys.readouterr().err)
    assert len(found) == 1
    return int(found[0])


def test_generate_renders_input_as_a_records_input_after_the_instruction(run, capsys):
    """Before: no --input (argparse: unrecognized arguments). Now the input follows the instruction
    after a blank line, as a record's input is rendered."""
    run_dir, instruction, given = str(run.path), "Name the colour of the item.", "item 7 of 21 apples"
    with_input = prompt_tokens(capsys, run_dir, "--prompt", instruction, "--input", given)
    assert with_input == prompt_tokens(capsys, run_dir, "--prompt", f"{instruction}\n\n{given}")
    assert with_input > prompt_tokens(capsys, run_dir, "--prompt", instruction)
