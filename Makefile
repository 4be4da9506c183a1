# kvlab — two commands do everything on a fresh Linux machine with Python 3.11:
#   make lab    set up .venv and open the course in JupyterLab (your notebooks: work/)
#   make test   set up .venv, run the unit tests, execute every notebook (nbval), build the
#               website and drive it and JupyterLab in headless Chromium (installs Debian's
#               chromium if missing), then run the tests that depend on Triton's version
#               (marker triton, tests/conftest.py) and chapters 03, 06, 08, 09, 10 again
#               with the oldest supported Triton (.venv-oldest: .venv with that Triton)
# `make help` lists every target: a target's "## " comment is its line there.

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# torch is installed first and pinned, so the resolver never swaps it for another build:
# the CPU-only build from PyTorch's CPU index where no NVIDIA GPU is found, else PyPI's CUDA
# build (tools/torch_build.py); TORCH_BUILD=cpu or cuda decides instead.
TORCH_SPEC ?= torch==2.13.0
TORCH_BUILD ?= auto
PYTEST_WORKERS ?= 2
# The oldest Triton kvlab supports (kvlab/base/triton_compat.py: OLDEST_TRITON; what torch 2.11 pins),
# tested beside the newest NumPy (.venv's).
TRITON_OLDEST ?= triton==3.6.0
VENV_OLDEST   ?= .venv-oldest
OLDEST_CHAPTERS ?= 03 06 08 09 10
export PYTHONHASHSEED = 0
# setuptools' "Editable installation" box (a note on folders named like the package, nothing a
# learner can act on) shows through pip's --quiet: this warnings filter keeps it out.
NO_EDITABLE_NOTE := ignore:Editable installation
# Bytecode: pip compiles nothing at install (--no-compile saves about 45 s of a set-up, most of
# it on modules nothing imports); Python compiles a module at its first import and keeps it in
# __pycache__/, here even where the environment turns that off (PYTHONDONTWRITEBYTECODE, set in
# many containers), or every pytest worker, notebook kernel and checker child would compile
# torch, kvlab and the rewritten tests again (about 9 s per pytest process).
export PYTHONDONTWRITEBYTECODE =
NO_COMPILE := --no-compile
# Tests run two pytest workers on small tensors: one BLAS/OpenMP thread each avoids oversubscription.
export OMP_NUM_THREADS ?= 1

.PHONY: help notebooks setup setup-oldest lab fresh test test-unit test-notebooks test-ui test-oldest figures gpu-check bench site clean

help:  ## list the targets, one line each
	@echo "kvlab: make <target>"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-z-]*:[^=]*## / {printf "  %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(VENV)/.installed  ## create .venv with kvlab and everything the course and its tests use

# A line per step (README says how long it takes and how much disk it needs: measure again
# when the dependencies change).
$(VENV)/.installed: pyproject.toml
	@$(PYTHON) tools/preflight.py
	@echo "kvlab set-up 1/5: a virtual environment in $(VENV)/ ($$($(PYTHON) --version 2>&1))"
	@$(PYTHON) -m venv $(VENV)
	@echo "kvlab set-up 2/5: upgrading pip"
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "kvlab set-up 3/5: $(TORCH_SPEC), the largest download, in the build this machine can use:"
	@TORCH_BUILD="$(TORCH_BUILD)" $(BIN)/python tools/torch_build.py install --python "$(BIN)/python" --spec "$(TORCH_SPEC)" $(NO_COMPILE)
	@echo "kvlab set-up 4/5: kvlab and its extras (Triton, JupyterLab, transformers, test and site tools)"
	@PYTHONWARNINGS="$(NO_EDITABLE_NOTE)" $(BIN)/python -m pip install --quiet $(NO_COMPILE) -e ".[dev]" "$(TORCH_SPEC)"
	@echo "kvlab set-up 5/5: the notebooks' Jupyter kernel"
	@$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvlab)" >/dev/null
	@touch $@
	@echo "kvlab set-up: done, $$(du -sh $(VENV) | cut -f1) in $(VENV)/"

# Your notebooks: copies in $(WORK)/ (ignored by git) made on the first `make lab`, so a
# `git pull` of course updates never touches your work (tools/workspace.py).
WORK     ?= work
CHAPTER  ?=
# JupyterLab refuses to run as root (Docker, many cloud machines) unless told it may.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS ?=
lab: setup  ## set up .venv and open the course in JupyterLab, on chapter 00 (your notebooks: work/)
	@$(BIN)/python tools/workspace.py prepare "$(WORK)"
	$(BIN)/jupyter lab --ServerApp.root_dir="$(WORK)" $(LAB_ROOT) $(LAB_ARGS) "$(WORK)/00_tour.ipynb"

fresh: setup  ## a fresh copy of one chapter in work/ (yours, if edited, kept renamed): make fresh CHAPTER=03
	@$(BIN)/python tools/workspace.py fresh "$(CHAPTER)" "$(WORK)"

test: setup test-unit test-notebooks test-ui test-oldest  ## everything: unit tests, notebooks, website, browser, oldest Triton

test-unit: setup  ## the unit tests (tests/, not the browser)
	MPLBACKEND=Agg $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not ui" tests/

# Each solutions notebook it runs is also saved with its outputs in build/executed, for the site.
test-notebooks: setup  ## execute both builds of every chapter (nbval)
	KVLAB_SAVE_EXECUTED=build/executed $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/

# JupyterLab and the website in headless Chromium (Debian's chromium, installed once when missing).
test-ui: setup site  ## the browser tests: JupyterLab, `make lab` itself, and the website (built first)
	@sh tools/install_chromium.sh
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m ui -p no:cacheprovider tests/ui/

# The same checks on the oldest supported Triton. .venv-oldest holds that Triton alone and
# sees everything else in .venv (a .pth file adds .venv's site-packages after its own): .venv
# with the older Triton (and .venv's newest NumPy), made in seconds instead of a second
# install of everything.
setup-oldest: $(VENV_OLDEST)/.installed  ## create .venv-oldest: .venv with the oldest supported Triton

$(VENV_OLDEST)/.installed: $(VENV)/.installed
	@echo "kvlab: $(VENV_OLDEST)/, $(VENV) with $(TRITON_OLDEST) in place of its Triton"
	@rm -rf $(VENV_OLDEST)
	@$(PYTHON) -m venv $(VENV_OLDEST)
	@$(VENV_OLDEST)/bin/python -m pip install --quiet $(NO_COMPILE) --no-deps "$(TRITON_OLDEST)"
	@$(VENV_OLDEST)/bin/python tools/share_venv.py "$(VENV)"
	@$(VENV_OLDEST)/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvlab)" >/dev/null
	@touch $@

test-oldest: setup-oldest  ## what depends on Triton's version (-m triton) and chapters 03, 06, 08, 09, 10 on the oldest supported Triton
	@$(VENV_OLDEST)/bin/python -c 'import triton, numpy; print(f"oldest supported: triton {triton.__version__}, numpy {numpy.__version__}")'
	MPLBACKEND=Agg $(VENV_OLDEST)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "triton and not ui" -p no:cacheprovider tests/
	$(VENV_OLDEST)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env -p no:cacheprovider $(foreach n,$(OLDEST_CHAPTERS),$(wildcard notebooks/solutions/$(n)_*.ipynb))

figures: setup  ## render figures/ from the chapters' scenes
	$(BIN)/python -m kvlab.course.scenes figures/

# On a machine with CUDA: unit tests and every notebook with compiled Triton, in the
# current Python (no venv; the GPU image already has torch and triton). kvlab is used from
# this checkout through PYTHONPATH (nothing installed); the notebooks' kernel inherits it.
# Offline box without Jupyter: make gpu-check GPU_WHEELS=<dir with nbval, ipykernel... wheels>
# (one or more folders; unpacked into GPU_SITE). Dry run without CUDA: GPU_REQUIRE=0.
# Without make: sh tools/gpu_check.sh (same settings, from the environment). A run on a GPU
# writes its record to GPU_RECORD (date, commit, GPU, counts): commit it (CONTRIBUTING.md).
GPU_WHEELS    ?=
GPU_SITE      ?= /tmp/kvlab-site
GPU_REQUIRE   ?= 1
GPU_TESTS     ?= tests/
GPU_NOTEBOOKS ?= notebooks/
GPU_RECORD    ?= figures/gpu-check.md
gpu-check:  ## on a GPU machine: unit tests and every notebook with compiled Triton; records the run
	PYTHON="$(PYTHON)" GPU_WHEELS="$(GPU_WHEELS)" GPU_SITE="$(GPU_SITE)" GPU_REQUIRE="$(GPU_REQUIRE)" \
	  GPU_TESTS="$(GPU_TESTS)" GPU_NOTEBOOKS="$(GPU_NOTEBOOKS)" GPU_RECORD="$(GPU_RECORD)" sh tools/gpu_check.sh

bench: setup  ## the benchmarks of chapter 09 (on a GPU; a smoke run without one)
	$(BIN)/python -m kvlab.bench

clean:  ## remove the environments and what builds and tests wrote (never work/)
	rm -rf $(VENV) $(VENV_OLDEST) test-output .pytest_cache build

# Build both notebooks of every chapter from its percent-format source in notebooks/src/:
# notebooks/NN_*.ipynb (the learner's: starters) and notebooks/solutions/NN_*.ipynb (answers).
notebooks: setup  ## build both notebooks of every chapter from notebooks/src/*.py
	$(BIN)/python tools/build_notebooks.py

# The course's website in build/site/html, offline (Sphinx + MyST-NB; CONTRIBUTING says why):
# each chapter executed once (reused from `make test-notebooks` when current), its pages, a
# link check. SITE_JOBS kernels execute chapters at once.
SITE_JOBS ?= 2
site: setup  ## build the website (every chapter with its outputs) into build/site/html
	$(BIN)/python tools/build_site.py --jobs $(SITE_JOBS)
