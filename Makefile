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
	$(BIN)/gradbalance compare --variant scaled --seeds 2 --out runs/demo --overwrite
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
	$(BIN)/mypy

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# A venv with torch and `pip install .` (no extras), checked by .ci/install_smoke.py from a
# temporary folder so that src/ cannot be imported. The venv (build/check-install-venv) is
# reused while it holds exactly what it was created with; otherwise it is made afresh.
check-install: $(STAMP)
	@set -e; start=$$(date +%s); venv="$(CURDIR)/build/check-install-venv"; \
	if [ "$$(cat "$$venv/.torch-spec" 2>/dev/null)" != "$(TORCH_SPEC)" ] || \
	   ! "$$venv/bin/python" -m pip freeze --exclude gradbalance 2>/dev/null \
	     | cmp -s - "$$venv/.freeze"; then \
	  echo "check-install: new venv $$venv with $(TORCH_SPEC)"; \
	  rm -rf "$$venv"; $(PYTHON) -m venv "$$venv"; \
	  "$$venv/bin/python" -m pip install --quiet "$(TORCH_SPEC)"; \
	  "$$venv/bin/python" -m pip freeze > "$$venv/.freeze"; \
	  echo "$(TORCH_SPEC)" > "$$venv/.torch-spec"; \
	fi; \
	"$$venv/bin/python" -m pip uninstall --quiet --yes gradbalance 2>/dev/null || true; \
	rm -rf build/lib build/bdist.*; \
	"$$venv/bin/python" -m pip install --quiet .; \
	"$$venv/bin/python" -m pip freeze --exclude gradbalance | cmp - "$$venv/.freeze" || \
	  { echo "check-install: pip install . brought packages beyond torch's"; exit 1; }; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && "$$venv/bin/python" -W "ignore:Failed to initialize NumPy" \
	  "$(CURDIR)/.ci/install_smoke.py"); \
	echo "check-install: ok in $$(( $$(date +%s) - start )) s"

figures: $(STAMP)
	$(BIN)/gradbalance figures --out runs/figures --overwrite

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) runs site
