# Set-up and the two commands of the README. Everything installs into a local .venv.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch by default; e.g. TORCH_SPEC="torch==2.14.1" for another build.
TORCH_SPEC ?= torch==2.13.0
# The lowest torch the core supports (pyproject.toml's floor): check-floor runs the core unit
# tests against it. On x86_64 Linux PyPI serves it as a CUDA build (about 3 GB, cached by pip).
TORCH_FLOOR ?= torch==2.6.0
EXTRAS ?= all,test,lightning,docs
# Every tool and optional dependency pinned (torch and what torch pins itself are chosen by
# TORCH_SPEC); `make lock` refreshes it.
CONSTRAINTS := constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP = -m pip install --quiet --constraint $(CURDIR)/$(CONSTRAINTS)

.PHONY: demo test lint typecheck docs check-install check-floor lock gpu-check figures bench clean

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP) --upgrade pip
	$(BIN)/python $(PIP) "$(TORCH_SPEC)"
	$(BIN)/python $(PIP) -e ".[$(EXTRAS)]"
	touch $(STAMP)

# Refresh the pins: a fresh venv takes the newest releases that pyproject.toml allows, and
# their versions (less torch and the packages torch pins) become constraints.txt.
lock:
	@set -e; venv="$(CURDIR)/build/lock-venv"; rm -rf "$$venv"; $(PYTHON) -m venv "$$venv"; \
	"$$venv/bin/python" -m pip install --quiet --upgrade pip; \
	"$$venv/bin/python" -m pip install --quiet "$(TORCH_SPEC)"; \
	"$$venv/bin/python" -m pip install --quiet ".[$(EXTRAS)]"; \
	{ echo "# Pinned test, docs and optional dependencies: written by 'make lock' with"; \
	  echo "# $(TORCH_SPEC) on Python $$("$$venv/bin/python" -c 'import platform; print(platform.python_version())'). Do not edit by hand."; \
	  "$$venv/bin/python" -m pip freeze --all --exclude gradbalance \
	    | grep -viE '^(torch|sympy|mpmath|triton|nvidia-[a-z0-9-]*)=='; } > $(CONSTRAINTS); \
	rm -rf "$$venv"; echo "lock: $$(grep -vc '^#' $(CONSTRAINTS)) pins in $(CONSTRAINTS)"

demo: $(STAMP)
	$(BIN)/gradbalance compare --variant scaled --seeds 2 --out runs/demo --overwrite
	@echo "demo outputs in runs/demo: summary.md, summary.csv, runs.csv, compare.png; tensorboard --logdir runs/demo/tb"

# ruff, the type checker, the tests (docstring examples included), the API docs build and
# a core-only install in a fresh venv.
# pytest runs in a random order (pytest-randomly), spread by pytest-xdist over one worker
# process per core, each with one torch thread (tests/conftest.py). The seed is printed at
# the end; `make test PYTEST_ARGS=--randomly-seed=N TEST_WORKERS=0` replays that order in one
# process (`PYTEST_ARGS=-p no:randomly` runs the files in order).
PYTEST_ARGS ?=
TEST_WORKERS ?= logical
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist worksteal
test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory check-install
	$(MAKE) --no-print-directory check-floor

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

# The declared torch floor, proven: a venv with $(TORCH_FLOOR), `pip install .` (a
# non-editable copy of this tree) and the pinned test tools runs the core unit tests. The venv
# (build/floor-venv) is reused while the floor, the pins and pyproject.toml are unchanged.
# On x86_64 Linux PyPI serves torch 2.6.0 as a CUDA build: about 6.5 GB installed and 3.5 GB
# downloaded, so a new venv first checks FLOOR_FREE_GB of free disk where it goes and where pip
# unpacks (TMPDIR), installs without pip's cache, and removes itself when its install fails.
FLOOR_VERSION = $(patsubst torch==%,%,$(TORCH_FLOOR))
FLOOR_EXTRAS = all,test
FLOOR_FREE_GB ?= 11
check-floor: $(STAMP)
	@set -e; start=$$(date +%s); venv="$(CURDIR)/build/floor-venv"; \
	grep -q '"torch>=$(FLOOR_VERSION)"' pyproject.toml || \
	  { echo "check-floor: pyproject.toml does not declare torch>=$(FLOOR_VERSION)"; exit 1; }; \
	want="$(TORCH_FLOOR) [$(FLOOR_EXTRAS)] $$(cat $(CONSTRAINTS) pyproject.toml | md5sum)"; \
	if [ "$$(cat "$$venv/.spec" 2>/dev/null)" != "$$want" ]; then \
	  echo "check-floor: new venv $$venv with $(TORCH_FLOOR)"; \
	  rm -rf "$$venv"; mkdir -p "$(CURDIR)/build"; \
	  for dir in "$(CURDIR)/build" "$${TMPDIR:-/tmp}"; do \
	    free=$$(df -Pk "$$dir" | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	    [ "$$free" -ge $(FLOOR_FREE_GB) ] || { echo "check-floor: $$dir has $$free GB free;" \
	      "a new venv with $(TORCH_FLOOR) needs about $(FLOOR_FREE_GB) GB there. Free disk" \
	      "space (or lower FLOOR_FREE_GB where the wheel is smaller) and run it again."; exit 1; }; \
	  done; \
	  $(PYTHON) -m venv "$$venv"; \
	  { "$$venv/bin/python" $(PIP) --no-cache-dir --upgrade pip && \
	    "$$venv/bin/python" $(PIP) --no-cache-dir "$(TORCH_FLOOR)" ".[$(FLOOR_EXTRAS)]"; } || \
	    { rm -rf "$$venv"; echo "check-floor: installing $(TORCH_FLOOR) failed;" \
	      "$$venv removed"; exit 1; }; \
	  echo "$$want" > "$$venv/.spec"; \
	fi; \
	rm -rf build/lib build/bdist.*; \
	"$$venv/bin/python" $(PIP) --no-deps --force-reinstall .; \
	"$$venv/bin/python" -c "import sys, torch, gradbalance; \
	v = torch.__version__.split('+')[0]; \
	sys.exit(0 if v == '$(FLOOR_VERSION)' and 'site-packages' in gradbalance.__file__ \
	         else f'check-floor: torch {v} / {gradbalance.__file__}')"; \
	"$$venv/bin/python" -m pytest $(PYTEST_PARALLEL) tests/unit -p no:cacheprovider; \
	echo "check-floor: torch $(FLOOR_VERSION) ok in $$(( $$(date +%s) - start )) s"

# On a machine with CUDA: its own venv (build/gpu-venv), the CUDA tests of tests/gpu/ and a
# short CUDA step benchmark, everything written to GPU_OUT; elsewhere it says so and exits 0.
GPU_OUT ?= build/gpu-check
gpu-check:
	bash .ci/gpu_check.sh "$(GPU_OUT)"

figures: $(STAMP)
	$(BIN)/gradbalance figures --out runs/figures --overwrite

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) runs site
