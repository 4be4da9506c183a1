"""`make setup` installs the torch build the machine can use (tools/torch_build.py): the
CPU-only build from PyTorch's CPU index where no NVIDIA GPU is found, PyPI's CUDA build where
one is, ``TORCH_BUILD`` deciding instead; an unreachable CPU index falls back to pip's own,
and says so. The machines are faked: a ``nvidia-smi`` on ``PATH`` (or none), a driver folder,
and a ``python`` that records what pip was asked. A set-up run sees only the faked machine: its
``PATH`` is the fake folder alone and ``KVLAB_NVIDIA_PROC`` an empty place, so a real GPU of the
machine running the tests (``/usr/bin/nvidia-smi``, ``/proc/driver/nvidia``) never leaks in."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import torch_build  # noqa: E402

H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5e1e5f8c-0000-0000-0000-000000000000)"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")


def _bin(tmp_path: Path, smi_output: str | None = None, smi_rc: int = 0) -> Path:
    """A folder for PATH, with a fake ``nvidia-smi`` when ``smi_output`` is given."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    if smi_output is not None:
        smi = folder / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n/bin/cat <<'EOF'\n{smi_output}\nEOF\nexit {smi_rc}\n")
        smi.chmod(0o755)
    return folder


def test_a_machine_without_an_nvidia_gpu_gets_the_cpu_build(tmp_path):
    choice = torch_build.choose({}, path_env=str(_bin(tmp_path)), proc=tmp_path / "no-driver")
    assert choice.build == "cpu" and "no NVIDIA GPU" in choice.why and "TORCH_BUILD=cuda" in choice.why


def test_a_machine_with_an_nvidia_gpu_gets_the_cuda_build(tmp_path):
    choice = torch_build.choose({}, path_env=str(_bin(tmp_path, H200)), proc=tmp_path / "no-driver")
    assert choice.build == "cuda" and "NVIDIA H200" in choice.why and "UUID" not in choice.why


def test_an_nvidia_smi_without_a_working_driver_is_no_gpu(tmp_path):
    path = str(_bin(tmp_path, NO_DRIVER, smi_rc=9))
    assert torch_build.choose({}, path_env=path, proc=tmp_path / "no-driver").build == "cpu"


def test_a_driver_without_nvidia_smi_still_counts(tmp_path):
    proc = tmp_path / "gpus"
    (proc / "0000:3b:00.0").mkdir(parents=True)
    choice = torch_build.choose({}, path_env=str(_bin(tmp_path)), proc=proc)
    assert choice.build == "cuda" and str(proc) in choice.why


@pytest.mark.parametrize("asked", ["cpu", "cuda", "CUDA "])
def test_torch_build_decides_instead(tmp_path, asked):
    path = str(_bin(tmp_path, H200))
    choice = torch_build.choose({"TORCH_BUILD": asked}, path_env=path, proc=tmp_path / "none")
    assert choice.build == asked.strip().lower() and "TORCH_BUILD=" in choice.why


def test_a_wrong_torch_build_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(SystemExit, match="TORCH_BUILD must be one of auto, cpu, cuda; got 'gpu'"):
        torch_build.choose({"TORCH_BUILD": "gpu"}, path_env=str(_bin(tmp_path)))


def test_the_cpu_build_comes_from_pytorchs_cpu_index():
    cpu, cuda = torch_build.Choice("cpu", ""), torch_build.Choice("cuda", "")
    spec = "torch==2.13.0"
    assert torch_build.pip_args(cpu, spec, torch_build.CPU_INDEX)[-2:] == [
        "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert "--index-url" not in torch_build.pip_args(cuda, spec, torch_build.CPU_INDEX)
    assert "--index-url" not in torch_build.pip_args(cpu, spec, None)  # the index is unreachable


# -- the whole step, as `make setup` runs it ---------------------------------------------------
@pytest.fixture
def cpu_index(tmp_path):
    """A reachable "CPU index": a local server with a ``torch/`` page."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a>torch-2.13.0+cpu.whl</a>")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Quiet, directory=str(tmp_path / "index")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _fake_python(tmp_path: Path, fail_with_index: bool = False, build: str = "2.13.0+cpu") -> Path:
    """A ``python`` that logs each ``pip install`` it is asked for and says which torch it has."""
    script = tmp_path / "python"
    cuda = "None" if build.endswith("+cpu") else "'12.8'"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-c" ]; then exec {sys.executable} -c "import types, sys; '
        f"sys.modules['torch'] = types.SimpleNamespace(__version__='{build}', "
        f"version=types.SimpleNamespace(cuda={cuda})); exec(sys.argv[1])\" \"$2\"; fi\n"
        f'echo "$*" >> "{tmp_path}/pip.log"\n'
        + ('case "$*" in *--index-url*) exit 1;; esac\n' if fail_with_index else "")
        + "exit 0\n")
    script.chmod(0o755)
    return script


def _faked_env(path_dir: Path, **env) -> dict:
    """The environment of a set-up run on the faked machine alone: no system folder on PATH (a
    GPU machine's nvidia-smi is in /usr/bin) and no driver listing (not the real
    /proc/driver/nvidia/gpus)."""
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_BUILD"}
    environ.update(PATH=str(path_dir), KVLAB_NVIDIA_PROC=str(path_dir / "no-driver"), **env)
    return environ


def _install(tmp_path: Path, python: Path, path_dir: Path, *options: str,
             **env) -> subprocess.CompletedProcess:
    environ = _faked_env(path_dir, **env)
    return subprocess.run([sys.executable, str(ROOT / "tools" / "torch_build.py"), "install",
                           "--python", str(python), "--spec", "torch==2.13.0", *options],
                          capture_output=True, text=True, env=environ, timeout=60)


def test_set_up_on_a_laptop_installs_the_cpu_build_and_says_so(tmp_path, cpu_index):
    run = _install(tmp_path, _fake_python(tmp_path), _bin(tmp_path), KVLAB_TORCH_CPU_INDEX=cpu_index)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "pip.log").read_text().split() == [
        "-m", "pip", "install", "--quiet", "torch==2.13.0", "--index-url", cpu_index]
    assert "the CPU-only build, from PyTorch's CPU wheel index: no NVIDIA GPU here" in run.stdout
    assert "installed torch 2.13.0+cpu, CPU-only" in run.stdout


def test_set_up_on_a_gpu_machine_installs_the_cuda_build(tmp_path, cpu_index):
    python = _fake_python(tmp_path, build="2.13.0")
    run = _install(tmp_path, python, _bin(tmp_path, H200), KVLAB_TORCH_CPU_INDEX=cpu_index)
    assert run.returncode == 0, run.stderr
    assert "--index-url" not in (tmp_path / "pip.log").read_text()
    assert "the CUDA build, from pip's own index: an NVIDIA GPU is here (nvidia-smi: GPU 0: " \
        "NVIDIA H200" in run.stdout
    assert "installed torch 2.13.0, CUDA 12.8 build" in run.stdout


def test_a_laptop_set_up_on_a_machine_that_has_a_gpu_still_sees_only_the_laptop(tmp_path, cpu_index,
                                                                                monkeypatch):
    """The machine running the tests has a GPU (faked here: an nvidia-smi listing an H200 on
    its PATH, a driver listing one): the faked laptop still gets the CPU build."""
    real = tmp_path / "real"
    real.mkdir()
    _bin(real, H200)
    (real / "gpus" / "0000:3b:00.0").mkdir(parents=True)
    monkeypatch.setenv("PATH", f"{real / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("KVLAB_NVIDIA_PROC", str(real / "gpus"))
    assert torch_build.nvidia_gpu() is not None   # the "real" machine shows its GPU
    fake = _bin(tmp_path)
    assert _faked_env(fake)["PATH"] == str(fake)  # no folder of the real machine's
    assert not Path(_faked_env(fake)["KVLAB_NVIDIA_PROC"]).exists()
    run = _install(tmp_path, _fake_python(tmp_path), fake, KVLAB_TORCH_CPU_INDEX=cpu_index)
    assert run.returncode == 0, run.stderr
    assert "the CPU-only build" in run.stdout and "no NVIDIA GPU here" in run.stdout, run.stdout


def test_an_unreachable_cpu_index_falls_back_to_pips_own_and_says_so(tmp_path):
    closed = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens there
    run = _install(tmp_path, _fake_python(tmp_path), _bin(tmp_path), KVLAB_TORCH_CPU_INDEX=closed)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "pip.log").read_text().split() == ["-m", "pip", "install", "--quiet",
                                                          "torch==2.13.0"]
    assert re.search(r"PyTorch's CPU wheel index http://127\.0\.0\.1:9/whl/cpu cannot be reached "
                     r"\(.+\), so torch comes from pip's own index instead", run.stdout), run.stdout


def test_a_cpu_index_pip_cannot_install_from_falls_back_too(tmp_path, cpu_index):
    python = _fake_python(tmp_path, fail_with_index=True)
    run = _install(tmp_path, python, _bin(tmp_path), KVLAB_TORCH_CPU_INDEX=cpu_index)
    assert run.returncode == 0, run.stderr
    tried = (tmp_path / "pip.log").read_text().splitlines()
    assert len(tried) == 2 and "--index-url" in tried[0] and "--index-url" not in tried[1]
    assert "installing from pip's own index instead" in run.stdout


def test_make_setup_runs_the_choice_with_the_override_passed_on():
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "setup", "VENV=/nonexistent/v",
                          "TORCH_BUILD=cpu"], capture_output=True, text=True).stdout
    (line,) = [ln for ln in dry.splitlines() if "torch_build.py install" in ln]
    assert 'TORCH_BUILD="cpu"' in line and '--spec "torch==' in line
    assert "/nonexistent/v/bin/python" in line
    # no bytecode at install: each of the set-up's installs of packages passes --no-compile
    installs = [ln for ln in dry.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]
    assert len(installs) == 1 and all("--no-compile" in ln for ln in [line, *installs]), dry


def test_no_compile_is_passed_on_to_pip(tmp_path, cpu_index):
    run = _install(tmp_path, _fake_python(tmp_path), _bin(tmp_path), "--no-compile",
                   KVLAB_TORCH_CPU_INDEX=cpu_index)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "pip.log").read_text().split() == [
        "-m", "pip", "install", "--quiet", "--no-compile", "torch==2.13.0", "--index-url", cpu_index]


def test_make_writes_bytecode_even_where_the_environment_turns_it_off():
    """Installed without bytecode, every module is compiled at its first import and kept: also
    under PYTHONDONTWRITEBYTECODE=1 (else each process of `make test` compiles them again)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run(["make", "-s", "-C", str(ROOT), "--eval",
                          f'_bytecode: ; @{sys.executable} -c "import sys; print(sys.dont_write_bytecode)"',
                          "_bytecode"], capture_output=True, text=True, env=env, timeout=60)
    assert run.stdout.split() == ["False"], run.stdout + run.stderr
