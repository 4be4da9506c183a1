"""Reference solutions, shown on request: ``kvlab.solutions.show("page_to_token")``.

Solutions are registered with their exercise (see :mod:`kvlab.check.core`); this module
prints their source so a learner who is stuck can read one, and returns the function.
"""
from __future__ import annotations

import inspect

from ..check import _load_all
from ..check.core import EXERCISES


def get(name: str):
    """The reference solution of exercise ``name`` (a function or kernel)."""
    _load_all()
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; known: {', '.join(sorted(EXERCISES))}")
    sol = EXERCISES[name].solution
    if sol is None:
        raise KeyError(f"exercise {name!r} has no stored solution")
    return sol


def where(name: str) -> str:
    """Where the solution of ``name`` lives, e.g. ``kvlab.kernels.alloc.alloc_extend_kernel``."""
    target = getattr(get(name), "fn", get(name))
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def show(name: str) -> str:
    """Print the source of the reference solution of ``name`` and return it.

    Several exercises can share one solution (the three parts of ``alloc_extend`` are one
    kernel): the header says so, and says where the code lives in the package.
    """
    sol = get(name)
    target = getattr(sol, "fn", sol)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        src = repr(sol)
    shared = sorted(n for n, ex in EXERCISES.items() if ex.solution is sol and n != name)
    header = f"# Reference solution for {name!r}: {where(name)}"
    if shared:
        header += f"\n# (the same code is the solution of {', '.join(shared)})"
    print(f"{header}\n{src}")
    return src
