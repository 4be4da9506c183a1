"""Launch a kernel that is compiled once, without Triton's per-call bookkeeping (chapter 09).

``kernel[grid](*args)`` binds the arguments to the signature, works out how to specialise
each one, builds a cache key and looks the compiled kernel up, on every call: 10-15 us of
host time on a server CPU, as much as the allocation work itself. The allocator kernels are
written so that one compilation serves every call (integers typed ``tl.int64``, no value or
alignment specialisation), so after the first call :class:`Launcher` keeps the compiled
kernel and launches it directly with ``compiled[grid](*args)``, Triton's own entry point for
an already compiled kernel::

    first call, per key:   kernel[grid](*args)  ->  compiles (or loads from the cache),
                           launches, returns the CompiledKernel  ->  kept under `key`
    later calls:           compiled.run(grid, stream, ..., *args)   (launch only)

A later call asks what may change between calls, as ``compiled[grid]`` would: the current
device (part of the key) and stream from Triton's driver, and whether a launch hook (a
profiler) is installed, in which case it goes through ``compiled[grid](*args)``. What cannot
change once a kernel is loaded (its launcher, function handle and metadata) is kept with it.

The key is what the caller knows to change the compiled code: the device, the tensors'
dtypes, the constexprs. In the interpreter, or where Triton cannot skip alignment
specialisation, every call takes the ordinary path.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple, Sequence

import triton

from .. import runtime

#: Whether ``triton.jit`` can be told not to specialise on pointer alignment (a sliced free
#: list has an unaligned pointer; a kernel compiled for an aligned one would be wrong there).
ALIGNMENT_OPTION: bool = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def jit_options(ints: Sequence[str], pointers: Sequence[str]) -> dict:
    """``triton.jit`` options: no specialisation on integer values (``== 1``, ``% 16 == 0``) nor
    on pointer alignment, so a new batch size or a sliced tensor never triggers a recompile."""
    opts: dict = {"do_not_specialize": list(ints)}
    if ALIGNMENT_OPTION:
        opts["do_not_specialize_on_alignment"] = list(pointers)
    return opts


#: Triton's driver registry: ``.active`` is the driver a launch goes through (looked up per
#: call, as Triton does: a test or a tool may swap it)
_DRIVERS = triton.runtime.driver


def _current_device() -> int:
    return _DRIVERS.active.get_current_device()


def _runtime_knobs():
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "runtime", None)


_KNOBS = _runtime_knobs()


def _no_hook(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def _no_launch_hooks() -> bool:
    """No launch hook is installed (a profiler installs them): the compiled kernel may be run
    without building the metadata the hooks would read."""
    return _KNOBS is not None and _no_hook(_KNOBS.launch_enter_hook) and _no_hook(_KNOBS.launch_exit_hook)


class _Kept(NamedTuple):
    """A compiled kernel and what launching it reads, looked up once instead of per call."""

    device: int
    key: tuple
    compiled: object
    run: object        # the compiled kernel's launcher (``compiled.run``)
    function: object
    metadata: object


class Launcher:
    """``kernel[grid](*args)``, with the compiled kernel kept per ``key`` after its first launch.

    ``grid`` is 1-D, ``(programs,)``. ``args`` are all of the kernel's parameters, positionally
    and in signature order, constexprs included (that is how a compiled kernel takes them).
    Per call it still asks the driver for the current device and stream, and Triton's knobs
    for launch hooks, as ``kernel[grid]`` would: a caller may switch either between calls.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct = not runtime.INTERPRET and ALIGNMENT_OPTION
        self._compiled: dict = {}
        self._last: _Kept | None = None  # the entry the previous call used

    def _keep(self, device: int, key: tuple, compiled) -> _Kept:
        if hasattr(compiled, "result"):  # a future, under Triton's async compile mode
            compiled = compiled.result()
        compiled._init_handles()  # loaded onto the device: ``run`` and ``function`` are final
        kept = _Kept(device, key, compiled, compiled.run, compiled.function, compiled.packed_metadata)
        self._compiled[(device, key)] = kept
        return kept

    def __call__(self, grid: tuple, args: tuple, key: tuple = ()) -> None:
        if not self.direct:
            self.kernel[grid](*args)
            return
        driver = _DRIVERS.active
        device = driver.get_current_device()
        kept = self._last
        if kept is None or kept.key is not key or kept.device != device:  # (the allocator passes
            kept = self._compiled.get((device, key))                      # one key object per call)
            if kept is None:
                self._last = self._keep(device, key, self.kernel[grid](*args))  # compiles and launches
                return
            self._last = kept
        if _no_launch_hooks():
            # what the compiled kernel's own launcher does, minus the hook metadata nobody reads
            kept.run(grid[0], 1, 1, driver.get_current_stream(device), kept.function, kept.metadata,
                     None, None, None, *args)
        else:
            kept.compiled[grid + (1,) * (3 - len(grid))](*args)  # a compiled kernel takes a 3-D grid

    def warmup(self, grid: tuple, args: tuple, key: tuple = ()) -> float:
        """Compile (or load from Triton's cache) without launching; returns the seconds it took."""
        import time

        if not self.direct:
            return 0.0  # the interpreter compiles nothing
        full_key = (_current_device(), key)
        if full_key in self._compiled:
            return 0.0
        t0 = time.perf_counter()
        self._keep(full_key[0], key, self.kernel.warmup(*args, grid=grid))  # the first launch only launches
        return time.perf_counter() - t0

    @property
    def compiled_keys(self) -> list:
        return list(self._compiled)
