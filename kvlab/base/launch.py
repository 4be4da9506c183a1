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
    later calls:           the compiled kernel's C launcher, called directly   (launch only)

A later call asks what may change between calls, as ``compiled[grid]`` would: the current
device (part of the key) and stream from Triton's driver, and whether a launch hook (a
profiler) is installed, in which case it goes through ``compiled[grid](*args)``. What cannot
change once a kernel is loaded (its launcher, function handle and metadata) is kept with it.

The compiled kernel's launcher (``compiled.run``) is a Python object around a C function; its
``__call__`` only adds scratch buffers these kernels do not use. Where kvlab knows how that C
function is called in the installed Triton (:data:`C_ENTRIES`, read from each version's
``backends/nvidia/driver.py``), it is called directly; a pointer argument may then be a tensor
or a plain address (``tensor.data_ptr()``): an address skips the ``data_ptr()`` call and the
driver query (is this a device pointer?) the C launcher makes for a tensor, about a third of
a microsecond each. The caller vouches that an address is of a tensor on the right device.

The key is what the caller knows to change the compiled code: the device, the tensors'
dtypes, the constexprs. In the interpreter, or where Triton cannot skip alignment
specialisation, every call takes the ordinary path.
"""
from __future__ import annotations

import inspect
import re
import types
from typing import Callable, NamedTuple, Sequence

import torch
import triton

from . import runtime

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


#: ``entry(programs, stream, args)``: a compiled kernel launched on a 1-D grid, no hooks
Entry = Callable[[int, int, tuple], None]


def _entry_triton36(run, function, metadata) -> Entry:
    # triton 3.6: launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch,
    #                    profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)
    launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl

    def entry(programs: int, stream: int, args: tuple) -> None:
        launch(programs, 1, 1, stream, function, coop, pdl, None, None, metadata, None, None, None, *args)
    return entry


def _entry_triton37(run, function, metadata) -> Entry:
    # triton 3.7-3.9: launch(gx, gy, gz, stream, function, cooperative, pdl, packed_metadata,
    #                        launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch,
    #                        arg_annotations, kernel_signature, args)
    launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    annotations, signature = run.arg_annotations, run.kernel_signature

    def entry(programs: int, stream: int, args: tuple) -> None:
        launch(programs, 1, 1, stream, function, coop, pdl, metadata, None, None, None, None, None,
               annotations, signature, args)
    return entry


#: How the C launcher of a compiled kernel is called, per Triton (major, minor): the versions
#: whose ``driver.py`` kvlab has read. Any other takes ``compiled.run``, Triton's own wrapper.
C_ENTRIES: dict[tuple[int, int], Callable[..., Entry]] = {
    (3, 6): _entry_triton36, (3, 7): _entry_triton37, (3, 8): _entry_triton37, (3, 9): _entry_triton37}


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


TRITON_VERSION: tuple[int, int] = _version(triton.__version__)


def c_entry(compiled) -> Entry | None:
    """The compiled kernel's C launcher as an :data:`Entry`, or None where kvlab does not know
    how to call it here (another Triton, scratch buffers to allocate, a sanitizer, a wrapper)."""
    make = C_ENTRIES.get(TRITON_VERSION)
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if make is None or not isinstance(launch, types.BuiltinFunctionType):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
            or getattr(run, "gsan_enabled", False):
        return None
    if make is _entry_triton37 and not hasattr(run, "arg_annotations"):
        return None
    return make(run, compiled.function, compiled.packed_metadata)


def launch_ready(device: int) -> int | None:
    """The current stream of CUDA device ``device`` if a kept kernel may be launched there right
    now through its :data:`Entry` (the device is current, no launch hook is installed), else None.
    (``torch._C`` directly: Triton's CUDA driver asks torch for both, through Python wrappers.)"""
    if _get_device() != device or not _no_launch_hooks():
        return None
    return _get_stream(device)


_get_device = getattr(torch._C, "_cuda_getDevice", lambda: -1)
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)


def raw_stream(device: int) -> int:
    """The handle of CUDA device ``device``'s current stream (what a launch goes to)."""
    return _get_stream(device)


class _Kept(NamedTuple):
    """A compiled kernel and what launching it reads, looked up once instead of per call."""

    device: int
    key: tuple
    compiled: object
    run: object        # the compiled kernel's launcher (``compiled.run``)
    function: object
    metadata: object
    entry: Entry | None  # its C launcher, called directly (None: go through ``run``)


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
        kept = _Kept(device, key, compiled, compiled.run, compiled.function, compiled.packed_metadata,
                     c_entry(compiled))
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
            stream = driver.get_current_stream(device)
            if kept.entry is not None:
                kept.entry(grid[0], stream, args)
            else:
                kept.run(grid[0], 1, 1, stream, kept.function, kept.metadata, None, None, None, *args)
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

    def entry_for(self, device: int, key: tuple = ()) -> Entry | None:
        """The C entry of the kernel kept for ``(device, key)`` (after :meth:`warmup` or a first
        launch), or None. Launching through it is the caller's job: the device must be current,
        :func:`launch_ready` must say so, and the stream must be the current one."""
        kept = self._compiled.get((device, key)) if self.direct else None
        return None if kept is None else kept.entry

    @property
    def compiled_keys(self) -> list:
        return list(self._compiled)
