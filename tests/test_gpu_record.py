"""The record of the last GPU run (tools/gpu_record.py, figures/gpu-check.md): counts read from
pytest's own JUnit report, skips with their reasons, failures by name, and nothing written
where there is no GPU (a dry run must never overwrite the GPU's record)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_record  # noqa: E402

SAMPLE = '''
import pytest

def test_passes():
    assert True

def test_also_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("set-up failed")

def test_errors(broken):
    pass

def test_skipped():
    pytest.skip("needs the Triton interpreter (make test, no CUDA)")

@pytest.mark.skipif(True, reason="needs the Triton interpreter (make test, no CUDA)")
def test_skipped_too():
    pass
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """pytest's own JUnit report of a run with 2 passed, 1 failed, 1 error and 2 skipped."""
    folder = tmp_path_factory.mktemp("junit")
    (folder / "test_sample.py").write_text(SAMPLE)
    xml = folder / "unit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--junitxml={xml}", str(folder / "test_sample.py")], capture_output=True, cwd=folder)
    return xml


MACHINE = gpu_record.Machine("NVIDIA H200 (sm_90), 1 GPU, CUDA 13.0",
                             "Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0")


def test_the_counts_come_from_pytests_report(report):
    step = gpu_record.read_junit("unit tests", str(report))
    assert (step.passed, step.failed, step.errors, step.skipped) == (2, 1, 1, 2)
    assert step.skips == {"needs the Triton interpreter (make test, no CUDA)": 2}
    assert [f.rsplit("::", 1)[1] for f in step.failures] == ["test_fails", "test_errors"]
    assert not step.green


def test_the_record_says_when_where_and_what(report):
    steps = [gpu_record.read_junit("unit tests", str(report))]
    text = gpu_record.render(steps, {"checkers' safety net cost": True}, MACHINE, "0123abcd4567",
                             "2026-01-02 03:04 UTC", {"GPU_TESTS": "-n 8 tests/", "GPU_NOTEBOOKS": ""})
    assert "**RED**: unit tests 2 passed, 1 failed, 1 errors, 2 skipped" in text
    for said in ("2026-01-02 03:04 UTC", "0123abcd4567", "NVIDIA H200 (sm_90)", "triton 3.6.0",
                 "`-n 8 tests/`", "| unit tests | 2 | 1 | 1 | 2 |", "test_fails`",
                 "- 2 x needs the Triton interpreter (make test, no CUDA)"):
        assert said in text, said
    assert "GPU_NOTEBOOKS" not in text    # a setting left empty is not listed


def test_a_green_run_is_green_and_a_step_without_a_report_is_not(report, tmp_path):
    good = gpu_record.Step("notebooks", 120, 0, 0, 0, 61.0, gpu_record.Counter(), [])
    assert "**green**" in gpu_record.render([good], {"sandbox": True}, MACHINE, "c", "d", {})
    assert "**RED**" in gpu_record.render([good], {"sandbox": False}, MACHINE, "c", "d", {})
    missing = gpu_record.read_junit("notebooks", str(tmp_path / "never-written.xml"))
    assert missing.errors == 1 and not missing.green


def test_without_a_gpu_nothing_is_written(tmp_path, monkeypatch, report):
    monkeypatch.setattr(gpu_record, "this_machine", lambda: None)
    out = tmp_path / "gpu-check.md"
    assert gpu_record.main(["--out", str(out), "--step", f"unit tests={report}"]) == 0
    assert not out.exists()


def test_on_a_gpu_the_record_is_written(tmp_path, monkeypatch, report):
    monkeypatch.setattr(gpu_record, "this_machine", lambda: MACHINE)
    out = tmp_path / "figures" / "gpu-check.md"
    assert gpu_record.main(["--out", str(out), "--step", f"unit tests={report}", "--check", "sandbox=0"]) == 0
    assert "NVIDIA H200" in out.read_text() and "| sandbox | passed |" in out.read_text()


@pytest.mark.slow
def test_gpu_check_runs_every_step_records_and_fails_if_any_did(tmp_path, report):
    """A run whose unit tests fail: the notebooks' step still runs, the check ends red naming
    the step, and the record is written red on a GPU, left alone without one."""
    (tmp_path / "test_red.py").write_text("def test_red():\n    assert False\n")
    (tmp_path / "test_green.py").write_text("def test_green():\n    assert True\n")
    record = tmp_path / "gpu-check.md"
    # Not the settings of a `make gpu-check` this runs under: its GPU_WHEELS / GPU_SITE would
    # have this run delete and re-unpack the wheels the other test workers are importing from.
    outer = {k: v for k, v in os.environ.items() if not k.startswith("GPU_")}
    env = dict(outer, PYTHON=sys.executable, GPU_REQUIRE="0", GPU_RECORD=str(record),
               GPU_TESTS=f"-p no:xdist {tmp_path / 'test_red.py'}",
               GPU_NOTEBOOKS=f"-p no:xdist {tmp_path / 'test_green.py'}",
               KVLAB_PROGRESS_FILE=str(tmp_path / "progress.json"))
    run = subprocess.run(["sh", str(ROOT / "tools" / "gpu_check.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gpu_check.sh: FAILED: unit-tests (GPU_REQUIRE=0)" in run.stderr
    assert "1 failed" in run.stdout and "1 passed" in run.stdout       # both steps ran
    assert "gpu_check_sandbox: all PASS" in run.stdout
    if torch.cuda.is_available():
        assert "**RED**: unit tests 0 passed, 1 failed" in record.read_text()
    else:
        assert "no CUDA GPU here" in run.stdout and not record.exists()
    # (run by `make gpu-check GPU_RECORD=...` itself, this test must not see that make's settings)
    plain = {k: v for k, v in outer.items()
             if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    make = subprocess.run(["make", "-n", "-C", str(ROOT), "gpu-check"], capture_output=True, text=True,
                          env=plain).stdout
    assert 'GPU_RECORD="figures/gpu-check.md"' in make
