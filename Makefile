# kvlab — two commands do everything on a fresh Linux machine with Python 3.11:
#   make lab    set up .venv and open the course in JupyterLab
#   make test   set up .venv, run the unit tests, execute every notebook (nbval)
# Others: make figures | make gpu-check | make bench | make test-ui | make clean

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# torch is installed first and pinned, so the resolver never swaps it for another build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
export MPLBACKEND ?= Agg
export PYTHONHASHSEED = 0

.PHONY: notebooks setup lab test test-unit test-notebooks test-ui figures gpu-check bench clean

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

test: setup test-unit test-notebooks

test-unit: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not ui" tests/

test-notebooks: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/

test-ui: setup
	$(BIN)/python -m pytest -q -m ui tests/

figures: setup
	$(BIN)/python -m kvlab.gallery figures/

# On a machine with CUDA: unit tests and every notebook with compiled Triton, in the
# current Python (no venv; the GPU image already has torch and triton).
gpu-check:
	KVLAB_REQUIRE_GPU=1 $(PYTHON) -m pytest -q -m "not ui" tests/
	KVLAB_REQUIRE_GPU=1 $(PYTHON) -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/

bench: setup
	$(BIN)/python -m kvlab.bench

clean:
	rm -rf $(VENV) test-output .pytest_cache

# Rebuild notebooks/*.ipynb from their percent-format sources in notebooks/src/.
notebooks: setup
	for f in notebooks/src/*.py; do $(BIN)/python tools/py2nb.py $$f notebooks/$$(basename $${f%.py}).ipynb; done
