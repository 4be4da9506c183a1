"""Sending a learner's function to a fresh Python process, by its source.

A *spawned* child (a new interpreter, the only kind that is safe once CUDA has started) does
not inherit the notebook's objects, so a kernel defined in a cell has to travel. Pickle cannot
send it (it lives in ``__main__``, and a ``@triton.jit`` kernel is not picklable), so it goes
as its source plus what its code refers to::

    parent                                   child
    ship(kernel) -> Shipped(source, line,    rebuild(shipped): the source in a file of its own,
                    refs = {"tl": module,      the ``def`` on its original line, the refs put
                            "helper": Shipped, into the module, ``triton.jit`` applied again
                            "BLOCK": 8})

Line numbers are kept, so a line the child reports is the line of the learner's cell.
Something that cannot travel (an object with state, a lambda) raises :class:`CannotShip`; the
sandbox then runs the call another way.
"""
from __future__ import annotations

import ast
import dis
import hashlib
import importlib
import inspect
import pickle
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class CannotShip(Exception):
    """This function (or something it refers to) cannot be sent to another process."""


@dataclass
class Shipped:
    """A function by value: its source and the names its code uses."""

    name: str
    source: str  # the file the child writes: blank lines, then the def (decorators removed)
    filename: str  # where it was defined in the parent (a notebook cell's file, a module)
    is_jit: bool
    jit_options: dict = field(default_factory=dict)
    refs: dict[str, tuple] = field(default_factory=dict)  # name -> ("module"|"value"|"function", x)
    reference: tuple[str, str] | None = None  # (module, name): kvlab's own code is imported

    def key(self) -> str:
        """Equal for equal functions (same source, same values referred to)."""
        refs = sorted((name, kind, (value.name, value.source) if kind == "function" else value)
                      for name, (kind, value) in self.refs.items())
        data = (self.name, self.source, self.filename, self.is_jit,
                sorted(self.jit_options.items()), refs, self.reference)
        return hashlib.sha1(repr(data).encode()).hexdigest()[:16]


def _kernel_parts(obj) -> tuple[Callable, bool, dict] | None:
    """(python function, is_jit, jit options) of a Triton kernel object, else None."""
    try:
        from triton.runtime.jit import JITFunction
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - kvlab needs Triton
        return None
    if isinstance(obj, InterpretedFunction):
        return obj.fn, True, dict(getattr(obj, "kwargs", {}) or {})
    if isinstance(obj, JITFunction):
        opts = {k: getattr(obj, k) for k in ("do_not_specialize", "debug", "noinline")
                if getattr(obj, k, None)}
        return obj.fn, True, opts
    return None


def _global_names(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _importable(fn: Callable) -> bool:
    """Whether pickle can send ``fn`` by reference (it lives in a module the child can import)."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    return (mod is not None and mod.__name__ != "__main__" and getattr(mod, "__file__", None)
            and getattr(mod, getattr(fn, "__qualname__", "").split(".")[0], None) is not None)


def _ref(name: str, value: Any, seen: dict, own_by_source: bool) -> tuple:
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    parts = _kernel_parts(value)
    if parts is not None or (isinstance(value, types.FunctionType) and not _importable(value)):
        return ("function", ship(value, seen, own_by_source=own_by_source))
    try:
        return ("value", pickle.dumps(value))
    except Exception as e:  # noqa: BLE001 - anything can be in a notebook's globals
        raise CannotShip(f"`{name}` ({type(value).__name__}) cannot be sent to another process: "
                         f"{e}") from None


def ship(obj, seen: dict | None = None, *, own_by_source: bool = False) -> Shipped:
    """``obj`` (a function or a Triton kernel) by value: see the module docstring. kvlab's own
    code travels by reference (the child imports it), or with ``own_by_source`` by its source
    too, for a child that must not import kvlab (:mod:`kvlab.check.gpu_targets`)."""
    seen = {} if seen is None else seen
    if id(obj) in seen:
        return seen[id(obj)]
    parts = _kernel_parts(obj)
    fn, is_jit, options = parts if parts is not None else (obj, False, {})
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if (not own_by_source and module is not None and module.__name__.startswith("kvlab.")
            and getattr(module, getattr(fn, "__qualname__", ""), None) is obj):
        # kvlab's own code (a reference solution): the child imports it, relative imports and all
        shipped = Shipped(fn.__name__, "", fn.__code__.co_filename, is_jit,
                          reference=(module.__name__, fn.__qualname__))
        seen[id(obj)] = shipped
        return shipped
    if not isinstance(fn, types.FunctionType) or fn.__name__ == "<lambda>":
        raise CannotShip(f"{getattr(fn, '__name__', type(fn).__name__)} is not a plain function")
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise CannotShip(f"the source of {fn.__name__} is not available: {e}") from None
    text = textwrap.dedent("".join(lines))
    try:
        node = ast.parse(text).body[0]
    except SyntaxError as e:
        raise CannotShip(f"the source of {fn.__name__} does not parse on its own: {e}") from None
    body = text.splitlines()
    def_at = node.lineno - 1  # the decorators (above it) become blank lines
    source = "\n" * (first - 1 + def_at) + "\n".join(body[def_at:]) + "\n"
    shipped = Shipped(fn.__name__, source, fn.__code__.co_filename, is_jit, options)
    seen[id(obj)] = shipped
    values = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            values[name] = fn.__globals__[name]
    if is_jit:  # Triton looks for triton.language among a kernel's globals, used or not
        values.update({name: value for name, value in fn.__globals__.items()
                       if isinstance(value, types.ModuleType)
                       and value.__name__ in ("triton", "triton.language")})
    for name, value in values.items():
        if value is not obj:
            shipped.refs[name] = _ref(name, value, seen, own_by_source)
    return shipped


def to_plain(shipped: Shipped, memo: dict | None = None) -> dict:
    """``shipped`` as dicts and tuples only, so that a child which has not imported kvlab can
    unpickle it (:func:`from_plain` turns it back)."""
    memo = {} if memo is None else memo
    if id(shipped) in memo:
        return memo[id(shipped)]
    plain = memo[id(shipped)] = {f: getattr(shipped, f) for f in
                                 ("name", "source", "filename", "is_jit", "jit_options", "reference")}
    plain["refs"] = {name: (kind, to_plain(value, memo) if kind == "function" else value)
                     for name, (kind, value) in shipped.refs.items()}
    return plain


def from_plain(plain: dict, memo: dict | None = None) -> Shipped:
    memo = {} if memo is None else memo
    if id(plain) in memo:
        return memo[id(plain)]
    fields = {k: v for k, v in plain.items() if k != "refs"}
    shipped = memo[id(plain)] = Shipped(**fields)
    shipped.refs = {name: (kind, from_plain(value, memo) if kind == "function" else value)
                    for name, (kind, value) in plain["refs"].items()}
    return shipped


def file_names(shipped: Shipped, workdir: Path) -> dict[str, str]:
    """The files :func:`rebuild` writes for ``shipped`` and what it refers to -> their originals."""
    out, todo = {}, [shipped]
    while todo:
        s = todo.pop()
        path = str(workdir / f"{s.name}_{s.key()}.py")
        if path not in out:
            out[path] = s.filename
            todo += [v for kind, v in s.refs.values() if kind == "function"]
    return out


def rebuild(shipped: Shipped, workdir: Path, built: dict | None = None):
    """The function again, in this process: its source in ``workdir`` as a module of its own."""
    built = {} if built is None else built
    key = shipped.key()
    if key in built:
        return built[key]
    if shipped.reference is not None:
        module_name, name = shipped.reference
        built[key] = getattr(importlib.import_module(module_name), name)
        return built[key]
    path = workdir / f"{shipped.name}_{key}.py"
    path.write_text(shipped.source)
    module = types.ModuleType(f"kvlab_shipped_{shipped.name}_{key}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    built[key] = None  # a function that refers to itself finds its own name in the module
    for name, (kind, value) in shipped.refs.items():
        if kind == "module":
            module.__dict__[name] = importlib.import_module(value)
        elif kind == "value":
            module.__dict__[name] = pickle.loads(value)
        elif value.key() not in built:
            module.__dict__[name] = rebuild(value, workdir, built)
        elif built[value.key()] is not None:
            module.__dict__[name] = built[value.key()]
        # else: it is being built right now (functions that call each other): left out
    exec(compile(shipped.source, str(path), "exec"), module.__dict__)  # noqa: S102
    fn = module.__dict__[shipped.name]
    if shipped.is_jit:
        import triton

        fn = triton.jit(fn, **shipped.jit_options)
        module.__dict__[shipped.name] = fn
    built[key] = fn
    return fn
