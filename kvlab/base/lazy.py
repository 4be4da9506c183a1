"""Lazy package attributes: a subsystem's names load on first use, from the module that defines them.

Each subsystem's ``__init__`` lists its public names and the module each lives in (d2l-style:
the package says where a thing is defined); :func:`lazy_exports` gives it the module-level
``__getattr__`` / ``__dir__`` that import that module on first use. A chapter that needs only
the page table then pays for (and can break on) nothing else, and a subsystem's ``__init__``
imports nothing, so importing one module of it never runs the others.
"""
from __future__ import annotations

import importlib
from typing import Callable, Iterable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], submodules: Iterable[str] = (),
                 fallback: str | None = None) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a name to its module (relative
    to the package); ``submodules`` are loaded by name (``kvlab.alloc.paging``); ``fallback``
    names a module whose other attributes the package also answers for (an old module that
    became this package)."""
    subs = frozenset(submodules)

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        elif name in subs:
            value = importlib.import_module(f".{name}", package)
        elif fallback is not None and not name.startswith("__"):
            try:
                value = getattr(importlib.import_module(f".{fallback}", package), name)
            except AttributeError:
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | subs)

    return __getattr__, __dir__
