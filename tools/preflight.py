"""Before `make lab` / `make setup` builds anything: can kvlab run on this machine?

    python3 tools/preflight.py     # prints nothing and exits 0 when it can

kvlab's kernels need Triton, and pip has Triton for Linux only: on macOS (and native
Windows) the set-up would fail deep inside pip, minutes in. kvlab also needs Python 3.10 or
newer. Both are said here, up front, in one readable message with what to do instead.

This file must run on any Python a newcomer may have as ``python3``: keep it free of
f-strings, annotations and anything newer than Python 3.0 (the old Python is the very case
it reports).
"""
import sys

MIN_PYTHON = (3, 10)
COLAB_URL = ("https://colab.research.google.com/github/kvlab-course/kvlab/blob/main/"
             "notebooks/00_tour.ipynb")


def problems(platform, version, has_venv=True):
    """What stops kvlab on ``platform`` (``sys.platform``) with Python ``version`` (a tuple);
    ``has_venv``: whether this Python can make a virtual environment with pip in it."""
    found = []
    if platform == "darwin":
        found.append(
            "kvlab needs Linux: its kernels run on Triton, and pip has no Triton for macOS, so the "
            "set-up would fail inside pip. Open the course in Colab instead (nothing to install):\n"
            "    " + COLAB_URL + "\n"
            "or use a Linux machine (a Linux VM or container on this Mac works too).")
    elif platform.startswith(("win", "cygwin", "msys")):
        found.append(
            "kvlab needs Linux: its kernels run on Triton, and pip has no Triton for Windows. "
            "Use WSL2 (Ubuntu) and run `make lab` there, or open the course in Colab:\n"
            "    " + COLAB_URL)
    if tuple(version[:2]) < MIN_PYTHON:
        found.append(
            "kvlab needs Python %d.%d or newer; `%s` is Python %d.%d. Install a newer Python "
            "(your distribution's python3.11 package, pyenv or conda) and run "
            "`make lab PYTHON=python3.11`." % (MIN_PYTHON + (sys.executable or "python3",)
                                                + tuple(version[:2])))
    if not found and not has_venv:
        found.append(
            "This Python cannot make a virtual environment with pip in it (its `venv` or "
            "`ensurepip` module is missing). On Debian or Ubuntu: `sudo apt install "
            "python3-venv` (or python3.X-venv for your version), then run `make lab` again.")
    return found


def _has_venv():
    try:
        import ensurepip  # noqa: F401
        import venv  # noqa: F401
    except ImportError:
        return False
    return True


def main():
    version = tuple(sys.version_info[:2])
    # the venv check imports modules, which a foreign platform may not have: only after the rest
    found = problems(sys.platform, version) or problems(sys.platform, version, _has_venv())
    for text in found:
        sys.stderr.write("\n" + text + "\n\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
