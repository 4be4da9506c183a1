"""Which torch build `make setup` installs: CPU-only where there is no NVIDIA GPU, CUDA where there is.

    python3 tools/torch_build.py choose                      # prints "cpu" or "cuda" and why
    python3 tools/torch_build.py install --python .venv/bin/python --spec torch==2.13.0

On Linux, PyPI's torch wheel brings the CUDA libraries: for torch 2.13.0 (CUDA 13) 2.7 GB of
wheels (torch, a dozen ``nvidia-*`` packages, Triton) and 5.5 GB in ``.venv`` against 2.7 GB,
measured, of no use on a laptop without an NVIDIA GPU. PyTorch publishes a CPU-only build of
every release on its own wheel index (:data:`CPU_INDEX`: 0.2 GB for 2.13.0); this script
installs that one where no NVIDIA GPU is found, and PyPI's (CUDA) build where one is:

    TORCH_BUILD=auto (default)   nvidia-smi lists a GPU, or the driver shows one in
                                 /proc/driver/nvidia/gpus  ->  cuda;  otherwise  ->  cpu
    TORCH_BUILD=cpu | cuda       that build, whatever the machine has

The CPU choice asks PyTorch's index; where that index cannot be reached (a network that lets
only PyPI through, as this course's CI has), it says so and installs from pip's own index
instead, and then reports the build it got (``torch.version.cuda``). ``KVLAB_TORCH_CPU_INDEX``
names another CPU index (a mirror). The set-up's line says which build was chosen and why.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BUILDS = ("auto", "cpu", "cuda")
#: where a loaded NVIDIA driver lists its GPUs (``KVLAB_NVIDIA_PROC`` points elsewhere: the tests,
#: which fake the machine, on a machine that has one)
NVIDIA_PROC = Path(os.environ.get("KVLAB_NVIDIA_PROC") or "/proc/driver/nvidia/gpus")
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Choice:
    build: str  # "cpu" or "cuda"
    why: str    # the reason, in words


def nvidia_gpu(path_env: str | None = None, proc: Path = NVIDIA_PROC) -> str | None:
    """What shows an NVIDIA GPU on this machine (e.g. ``nvidia-smi: GPU 0: NVIDIA T4``), or None.

    ``nvidia-smi -L`` must list a GPU (it is installed with the driver, and fails without a
    working one); a machine whose driver is loaded but lacks the tool shows its GPUs in
    ``/proc/driver/nvidia/gpus``."""
    smi = shutil.which("nvidia-smi", path=path_env if path_env is not None else os.environ.get("PATH"))
    if smi:
        try:
            run = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            run = None
        listed = [line for line in (run.stdout if run else "").splitlines() if line.startswith("GPU ")]
        if run is not None and run.returncode == 0 and listed:
            return f"nvidia-smi: {listed[0].split(' (UUID')[0]}"
    try:
        if proc.is_dir() and any(proc.iterdir()):
            return f"the NVIDIA driver lists a GPU in {proc}"
    except OSError:
        pass
    return None


def choose(env: dict | None = None, path_env: str | None = None, proc: Path = NVIDIA_PROC) -> Choice:
    """The build to install: ``TORCH_BUILD`` when it names one, else by what the machine has."""
    env = os.environ if env is None else env
    asked = (env.get("TORCH_BUILD") or "auto").strip().lower()
    if asked not in BUILDS:
        raise SystemExit(f"TORCH_BUILD must be one of {', '.join(BUILDS)}; got {asked!r}")
    if asked != "auto":
        return Choice(asked, f"TORCH_BUILD={asked} asks for it")
    found = nvidia_gpu(path_env, proc)
    if found:
        return Choice("cuda", f"an NVIDIA GPU is here ({found}; TORCH_BUILD=cpu installs the "
                              "CPU-only build)")
    return Choice("cpu", "no NVIDIA GPU here (no nvidia-smi listing one, no NVIDIA driver; "
                         "TORCH_BUILD=cuda installs the CUDA build)")


def index_problem(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``url``'s torch page answers, else why not (in a few words)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout_s) as resp:
            resp.read(1)
        return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return str(reason) or type(e).__name__


def pip_args(choice: Choice, spec: str, cpu_index: str | None, byte_compile: bool = True) -> list[str]:
    """``pip install`` arguments: PyTorch's CPU index for the CPU build when it answers, else
    pip's own configuration (PyPI: the CUDA build on Linux x86_64). ``byte_compile=False``:
    pip's ``--no-compile`` (Python compiles each module at its first import instead)."""
    args = ["-m", "pip", "install", "--quiet", *([] if byte_compile else ["--no-compile"]), spec]
    if choice.build == "cpu" and cpu_index:
        args += ["--index-url", cpu_index]
    return args


def installed_build(python: str) -> str:
    """What the environment's torch is, e.g. ``torch 2.13.0+cpu, CPU-only``."""
    code = ("import torch; v = torch.version.cuda; "
            "print(f'torch {torch.__version__}, ' + (f'CUDA {v} build' if v else 'CPU-only'))")
    run = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "torch does not import"


def install(python: str, spec: str, choice: Choice, say=print, byte_compile: bool = True) -> int:
    index = os.environ.get("KVLAB_TORCH_CPU_INDEX") or CPU_INDEX
    cpu_index = None
    if choice.build == "cpu":
        problem = index_problem(index)
        if problem is None:
            cpu_index = index
            say(f"  the CPU-only build, from PyTorch's CPU wheel index: {choice.why}")
        else:
            say(f"  the CPU-only build: {choice.why}. PyTorch's CPU wheel index {index} cannot "
                f"be reached ({problem}), so torch comes from pip's own index instead (on Linux "
                "x86_64 PyPI's torch is the CUDA build: 2.7 GB of wheels instead of 0.2 GB)")
    else:
        say(f"  the CUDA build, from pip's own index: {choice.why}")
    run = subprocess.run([python, *pip_args(choice, spec, cpu_index, byte_compile)])
    if run.returncode != 0 and cpu_index:
        say(f"  pip could not install {spec} from {index} (above): installing from pip's own "
            "index instead")
        run = subprocess.run([python, *pip_args(choice, spec, None, byte_compile)])
    if run.returncode != 0:
        return run.returncode
    say(f"  installed {installed_build(python)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 tools/torch_build.py",
                                 description="Install the torch build this machine can use.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("choose", help="print cpu or cuda, and why")
    inst = sub.add_parser("install", help="pip-install torch into an environment")
    inst.add_argument("--python", required=True, help="the environment's python")
    inst.add_argument("--spec", required=True, help="the requirement, e.g. torch==2.13.0")
    inst.add_argument("--no-compile", action="store_true",
                      help="pip's --no-compile: no bytecode at install (compiled at first import)")
    args = ap.parse_args(argv)
    choice = choose()
    if args.command == "choose":
        print(f"{choice.build}: {choice.why}")
        return 0
    return install(args.python, args.spec, choice, byte_compile=not args.no_compile)


if __name__ == "__main__":
    sys.exit(main())
