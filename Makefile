# kvlab — two commands do everything on a fresh Linux machine with Python 3.11:
#   make lab    set up .venv and open the course in JupyterLab
#   make test   set up .venv, run the unit tests, execute every notebook (nbval), drive
#               JupyterLab in headless Chromium (installs Debian's chromium if missing), then
#               run the unit tests and chapters 03, 06, 08, 09, 10 again with the oldest supported
#               Triton and the newest NumPy (.venv-oldest)
# Others: make figures | make gpu-check | make bench | make test-ui | make test-oldest | make clean

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# torch is installed first and pinned, so the resolver never swaps it for another build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
# The oldest Triton kvlab supports (kvlab/triton_compat.py: OLDEST_TRITON; what torch 2.11 pins),
# tested with whatever NumPy pip resolves for it today.
TRITON_OLDEST ?= triton==3.6.0
VENV_OLDEST   ?= .venv-oldest
OLDEST_CHAPTERS ?= 03 06 08 09 10
export PYTHONHASHSEED = 0
# Tests run two pytest workers on small tensors: one BLAS/OpenMP thread each avoids oversubscription.
export OMP_NUM_THREADS ?= 1

.PHONY: notebooks setup setup-oldest lab test test-unit test-notebooks test-ui test-oldest figures gpu-check bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "kvlab needs Python >= 3.10"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvlab)" >/dev/null
	@touch $@

lab: setup
	$(BIN)/jupyter lab notebooks/

test: setup test-unit test-notebooks test-ui test-oldest

test-unit: setup
	MPLBACKEND=Agg $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not ui" tests/

test-notebooks: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/

# JupyterLab in headless Chromium (Debian's chromium, installed once when missing).
test-ui: setup
	@sh tools/install_chromium.sh
	$(BIN)/python -m pytest -q -m ui -p no:cacheprovider tests/ui/

# The same checks on the oldest supported Triton: its own venv, newest NumPy.
setup-oldest: $(VENV_OLDEST)/.installed

$(VENV_OLDEST)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_OLDEST)/bin/python -m pip install --quiet "$(TORCH_SPEC)" "$(TRITON_OLDEST)"
	$(VENV_OLDEST)/bin/python -m pip install --quiet -e ".[test]" "$(TORCH_SPEC)" "$(TRITON_OLDEST)"
	$(VENV_OLDEST)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

test-oldest: setup-oldest
	@$(VENV_OLDEST)/bin/python -c 'import triton, numpy; print(f"oldest supported: triton {triton.__version__}, numpy {numpy.__version__}")'
	MPLBACKEND=Agg $(VENV_OLDEST)/bin/python -m pytest -q -n $(PYTEST_WORKERS) -m "not ui" -p no:cacheprovider tests/
	$(VENV_OLDEST)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env -p no:cacheprovider $(foreach n,$(OLDEST_CHAPTERS),$(wildcard notebooks/solutions/$(n)_*.ipynb))

figures: setup
	$(BIN)/python -m kvlab.scenes figures/

# On a machine with CUDA: unit tests and every notebook with compiled Triton, in the
# current Python (no venv; the GPU image already has torch and triton). kvlab is used from
# this checkout through PYTHONPATH (nothing installed); the notebooks' kernel inherits it.
# Offline box without Jupyter: make gpu-check GPU_WHEELS=<dir with nbval, ipykernel... wheels>
# (one or more folders; unpacked into GPU_SITE). Dry run without CUDA: GPU_REQUIRE=0.
# Without make: sh tools/gpu_check.sh (same settings, from the environment).
GPU_WHEELS    ?=
GPU_SITE      ?= /tmp/kvlab-site
GPU_REQUIRE   ?= 1
GPU_TESTS     ?= tests/
GPU_NOTEBOOKS ?= notebooks/
gpu-check:
	PYTHON="$(PYTHON)" GPU_WHEELS="$(GPU_WHEELS)" GPU_SITE="$(GPU_SITE)" GPU_REQUIRE="$(GPU_REQUIRE)" \
	  GPU_TESTS="$(GPU_TESTS)" GPU_NOTEBOOKS="$(GPU_NOTEBOOKS)" sh tools/gpu_check.sh

bench: setup
	$(BIN)/python -m kvlab.bench

clean:
	rm -rf $(VENV) $(VENV_OLDEST) test-output .pytest_cache

# Build both notebooks of every chapter from its percent-format source in notebooks/src/:
# notebooks/NN_*.ipynb (the learner's: starters) and notebooks/solutions/NN_*.ipynb (answers).
notebooks: setup
	$(BIN)/python tools/build_notebooks.py
