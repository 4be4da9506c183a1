"""Compile kvlab's kernels for GPUs this machine does not have (``tests/test_gpu_targets.py``).

    launches = record(lambda: kvlab.page_to_token(starts, 4), "01 page_to_token")
    refused = compile_for(launches, 75)        # [] when Triton compiles every one for sm_75
    missing = set(jit_functions()) - reached(launches, jit_functions())

:func:`record` runs a call (in the interpreter, or on a GPU) and keeps every kernel launch it
makes: the kernel and Triton's signature of that launch (argument types and constexpr values,
:func:`kvlab.course.checking.compiled.signature`), so each kernel is compiled exactly as the chapters
launch it. Every launch path is seen: Triton's ``run`` (compiled and interpreted), a
:class:`kvlab.base.launch.Launcher` that keeps its compiled kernel, and the allocator's C
entries (:class:`kvlab.alloc.fast_alloc_kernels.DirectKernels`, on a GPU), which are sent through
their Launcher while recording. A launch a checker makes through
:func:`kvlab.course.checking.core.call_learner` is kept and not run (the checkers' own helpers give the
exercises' launches). :func:`compile_for` sends each launch, by its source
(:func:`kvlab.course.checking.shipping.ship`), to the compile check's child Python
(:mod:`kvlab.course.checking.compile_child`), which compiles it with Triton's compiler for
``GPUTarget("cuda", arch, 32)``: no GPU needed, ptxas included. :func:`jit_functions` finds
every ``@triton.jit`` function of the package by importing all of it; :func:`reached` names the
launched kernels and every ``@triton.jit`` helper they call, so a kernel that no launch reaches
is seen.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import kvlab
from kvlab.course.checking import compiled
from kvlab.course.checking.shipping import Shipped, _kernel_parts, ship, to_plain


@dataclass(frozen=True)
class Launch:
    kernel: object = field(compare=False)  # the JITFunction (GPU) or InterpretedFunction
    name: str                              # kvlab.alloc.paging_kernels.page_to_token_kernel
    types: tuple                           # ((param, "*i64"), ...) in signature order
    constants: tuple                       # ((param, value), ...)
    what: str = field(compare=False)       # the spec that launched it

    def describe(self) -> str:
        floats = sorted({t.lstrip("*") for _, t in self.types if "fp" in t or "bf" in t})
        consts = ", ".join(f"{k}={v}" for k, v in self.constants)
        return f"{self.name}({'/'.join(floats) or 'ints'}; {consts}) [{self.what}]"


def qualified(obj) -> str:
    fn = _kernel_parts(obj)[0]
    return f"{fn.__module__}.{fn.__qualname__}"


class _Recorded(Exception):
    """A checker's launch was kept; the checker's call stops here."""


def _launch(kernel, args: tuple, kwargs: dict, what: str) -> Launch:
    found = compiled.signature(_kernel_parts(kernel)[0], args, kwargs)
    if found is None:
        raise AssertionError(f"{qualified(kernel)}: Triton's signature of this launch cannot be "
                             f"worked out ({what}): an argument of an unknown type")
    types, constants = found
    return Launch(kernel, qualified(kernel), tuple(types.items()),
                  tuple((k, v) for k, v in constants.items()), what)


@contextlib.contextmanager
def _recording(into: list[Launch], what: str):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from kvlab.base.launch import Launcher

    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def recorder(cls):
        def run(self, *args, grid, warmup, **kwargs):
            into.append(_launch(self, args, kwargs, what))
            return originals[cls](self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    def kept(fn, args, kwargs):
        into.append(_launch(fn, args, kwargs, what))
        raise _Recorded

    # a Launcher that already keeps its compiled kernel (on a GPU, after an earlier test)
    # launches it without Triton's run: record its launches where they enter
    launcher_call = Launcher.__call__

    def launcher(self, grid, args, key=()):
        into.append(_launch(self.kernel, args, {}, what))
        return launcher_call(self, grid, args, key)

    # a warmed-up allocator on a GPU calls its kernels' C entries with addresses (DirectKernels),
    # past both of the above, and only where its launch gate, launch_ready, gives a stream: the
    # gate is closed meanwhile, so those launches take their Launcher (same kernel, same key)
    gates = _launch_gates()

    problem = compiled.problem
    for cls in originals:
        cls.run = recorder(cls)
    compiled.problem, Launcher.__call__ = kept, launcher
    for module in gates:
        module.launch_ready = _closed_gate
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run
        compiled.problem, Launcher.__call__ = problem, launcher_call
        for module, gate in gates.items():
            module.launch_ready = gate


def _closed_gate(device: int) -> None:
    """:func:`kvlab.base.launch.launch_ready` while recording: never ready."""
    return None


def _launch_gates() -> dict:
    """Every loaded kvlab module that holds a ``launch_ready`` (the gate in front of each direct
    launch), with the one it holds."""
    return {module: module.launch_ready for module in _kvlab_modules()
            if callable(getattr(module, "launch_ready", None))}


def _kvlab_modules() -> list:
    """Every loaded module of the package."""
    return [module for name, module in list(sys.modules.items())
            if (name == "kvlab" or name.startswith("kvlab.")) and module is not None]


def record(call: Callable[[], object], what: str) -> list[Launch]:
    """Every kernel launch ``call()`` makes (a checker's: kept, not run)."""
    launches: list[Launch] = []
    with _recording(launches, what), contextlib.suppress(_Recorded):
        call()
    if not launches:
        shadowed = [qualified(k) for k in _kernels_loaded() if "run" in vars(k)]
        raise AssertionError(f"{what}: launched no kernel" + (
            f"; these kernels hold a run of their own, which hides the recorder (a test "
            f"patched it with monkeypatch.setattr: use the kernel_run fixture): {shadowed}"
            if shadowed else ""))
    return launches


def _kernels_loaded() -> list:
    """The Triton kernels of every loaded kvlab module."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [obj for module in _kvlab_modules()
            for obj in list(vars(module).values()) if isinstance(obj, (JITFunction, InterpretedFunction))]


def jit_functions() -> dict[str, object]:
    """Every ``@triton.jit`` function defined in the package, by qualified name."""
    found = {}
    for info in pkgutil.walk_packages(kvlab.__path__, "kvlab."):
        if info.name.endswith(".__main__"):  # a command line, not a module to import
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            parts = _kernel_parts(value)
            if parts and parts[0].__module__ == module.__name__:
                found[qualified(value)] = value
    return found


def _where(obj) -> tuple[str, str]:
    fn = _kernel_parts(obj)[0]
    return fn.__code__.co_filename, fn.__name__


def _helpers(shipped: Shipped, seen: set[tuple[str, str]]) -> None:
    """(file, name) of every jit function ``shipped`` calls, directly or through others."""
    for kind, value in shipped.refs.values():
        if kind == "function" and value.is_jit and (value.filename, value.name) not in seen:
            seen.add((value.filename, value.name))
            _helpers(value, seen)


def reached(launches: list[Launch], functions: dict[str, object]) -> set[str]:
    """The qualified names of the launched kernels and of every jit helper they call
    (``functions``: :func:`jit_functions`)."""
    helpers: set[tuple[str, str]] = set()
    for launch in launches:
        _helpers(ship(launch.kernel, own_by_source=True), helpers)
    by_place = {_where(obj): name for name, obj in functions.items()}
    return {launch.name for launch in launches} | {by_place[h] for h in helpers if h in by_place}


def compile_for(launches: list[Launch], arch: int) -> list[str]:
    """Compile every launch for ``sm_<arch>``; what the compiler refused, one line each."""
    child = compiled._Child(("cuda", arch, 32))
    try:
        if not child.ready:
            return [f"sm_{arch}: Triton's compiler cannot run here (its probe kernel failed)"]
        refused = []
        for launch in launches:
            answer = child.ask({"kernel": to_plain(ship(launch.kernel, own_by_source=True)),
                                "signature": dict(launch.types),
                                "constexprs": dict(launch.constants)})
            if answer is None or answer.get("ok") is not True:
                why = (answer or {}).get("complaint") or (answer or {}).get("why") or "no answer"
                refused.append(f"sm_{arch}: {launch.describe()}: {why}")
        return refused
    finally:
        child.close()


def compile_for_each(launches_by_arch: dict[int, list[Launch]], workers: int = 2) -> list[str]:
    """:func:`compile_for` each arch, ``workers`` compiler children at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda item: compile_for(item[1], item[0]), launches_by_arch.items())
        return [line for lines in results for line in lines]
