#!/bin/sh
# Everything with compiled Triton on a CUDA machine: the unit tests (the GPU-only ones included:
# the checkers' spawned child survives a planted illegal address; their compile check refuses a
# planted kernel for this GPU, tests/test_compiled.py), what the checkers' safety net and compile
# check cost per check (tools/gpu_check_sandbox.py), then every notebook executed with nbval, in
# the current Python (no venv). `make gpu-check` runs this; it also runs without make:
#
#   sh tools/gpu_check.sh                          # python3 with Jupyter packages installed
#   GPU_WHEELS=.gpuwheels sh tools/gpu_check.sh    # offline box: unpack these wheels first
#
# Settings (environment): PYTHON (python3), GPU_WHEELS (folders of .whl files, space
# separated; unpacked into GPU_SITE, /tmp/kvlab-site), GPU_REQUIRE (1: fail unless kvlab
# compiles for CUDA; 0: a dry run in the interpreter), GPU_TESTS (tests/), GPU_NOTEBOOKS
# (notebooks/), GPU_RECORD (figures/gpu-check.md: the record of the run, written on a GPU
# only; commit it). kvlab is used from this checkout through PYTHONPATH, nothing is installed,
# and the notebooks' kernel (nbval --nbval-current-env) inherits the same PYTHONPATH.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
GPU_WHEELS=${GPU_WHEELS:-}
GPU_SITE=${GPU_SITE:-/tmp/kvlab-site}
GPU_REQUIRE=${GPU_REQUIRE:-1}
GPU_TESTS=${GPU_TESTS:-tests/}
GPU_NOTEBOOKS=${GPU_NOTEBOOKS:-notebooks/}
GPU_RECORD=${GPU_RECORD:-figures/gpu-check.md}

path=$(pwd)
if [ -n "$GPU_WHEELS" ]; then
    rm -rf "$GPU_SITE" && mkdir -p "$GPU_SITE"
    wheels=""
    for d in $GPU_WHEELS; do wheels="$wheels $(ls "$d"/*.whl)"; done
    # shellcheck disable=SC2086  # one word per wheel
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$GPU_SITE" $wheels; then
        echo "gpu_check.sh: pip could not install the wheels; unpacking them instead" >&2
        for w in $wheels; do "$PYTHON" -m zipfile -e "$w" "$GPU_SITE"; done
    fi
    path="$path:$GPU_SITE"
fi
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
KVLAB_REQUIRE_GPU=$GPU_REQUIRE
MPLBACKEND=${MPLBACKEND:-Agg}
PYTHONHASHSEED=0
# checks record the learner's progress: a check run must never write into the real home
KVLAB_PROGRESS_FILE="$(mktemp -d)/progress.json"
export PYTHONPATH KVLAB_REQUIRE_GPU MPLBACKEND PYTHONHASHSEED KVLAB_PROGRESS_FILE

if [ "$GPU_REQUIRE" = "1" ]; then
    "$PYTHON" tools/gpu_check_env.py --require-gpu
else
    "$PYTHON" tools/gpu_check_env.py
fi
# Every step runs, whatever the one before gave, so that the record of the run (GPU_RECORD,
# figures/gpu-check.md: tools/gpu_record.py, written on a GPU only) counts them all; -rs lists
# each skipped test's reason (one that needs another machine says which).
reports=$(mktemp -d)
failed=""
# shellcheck disable=SC2086  # GPU_TESTS / GPU_NOTEBOOKS may name several paths
"$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "not ui" --ignore=tests/ui \
    --junitxml="$reports/unit.xml" $GPU_TESTS || failed="$failed unit-tests"
sandbox=0
"$PYTHON" tools/gpu_check_sandbox.py || { sandbox=$?; failed="$failed sandbox-costs"; }
# shellcheck disable=SC2086
"$PYTHON" -m pytest -q -rs -p no:cacheprovider --nbval-lax --nbval-current-env \
    --junitxml="$reports/notebooks.xml" $GPU_NOTEBOOKS || failed="$failed notebooks"
GPU_TESTS=$GPU_TESTS GPU_NOTEBOOKS=$GPU_NOTEBOOKS "$PYTHON" tools/gpu_record.py --out "$GPU_RECORD" \
    --step "unit tests=$reports/unit.xml" --step "notebooks=$reports/notebooks.xml" \
    --check "checkers' safety net and compile check cost=$sandbox" || failed="$failed record"
rm -rf "$reports"
if [ -n "$failed" ]; then
    echo "gpu_check.sh: FAILED:$failed (GPU_REQUIRE=$GPU_REQUIRE)" >&2
    exit 1
fi
echo "gpu_check.sh: unit tests and notebooks passed (GPU_REQUIRE=$GPU_REQUIRE)"
