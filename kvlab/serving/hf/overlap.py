"""Where a step's device work runs, and when the host hears of it (chapter 10, overlap scheduling).

A step of the serving loop has a **host** part (choose the requests, map their pages, build the
inputs; later: read the tokens back, record them, release what finished) and a **device** part
(the forward pass, the greedy token, the copy of the tokens back to the host). Without overlap
the two alternate and each waits for the other::

    host    | schedule n | launch n |  wait ........ | process n | schedule n+1 | launch n+1 | ...
    device  |            |          |   forward n    |           |              |            | fwd n+1

With overlap (mini-sglang's ``Scheduler.overlap_loop``, ``python/minisgl/scheduler/scheduler.py``)
the host schedules and launches step n+1 *before* it reads step n's tokens, so the device
finds the next step queued when it finishes one::

    host    | schedule n+1 | launch n+1 | wait | process n | schedule n+2 | launch n+2 | wait ...
    device  |   forward n ...................  |   forward n+1 ..........................

A :class:`DeviceQueue` is the device's queue of work, in submission order:

* :class:`CudaQueue` -- a CUDA stream: ``submit`` enqueues the kernels and a copy of the tokens
  into pinned host memory and records an event; ``result`` waits on that event only;
* :class:`ThreadQueue` -- a CPU stand-in for a stream: one worker thread runs the submitted
  work in order while the caller goes on (torch releases the interpreter lock inside its ops),
  with or without overlap, so a step's parts sit on the same two lanes as on a GPU;
* :class:`DeviceQueue` itself runs the work inside ``submit`` (tests build on it).

Each submitted piece of work returns ``(tokens, logits)`` on the host; the queue notes when it
ran on the device clock (:class:`StepTimes` of the timeline, seconds since the call began).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

__all__ = ["StepTimes", "Ticket", "DeviceQueue", "ThreadQueue", "CudaQueue", "device_queue",
           "to_host"]


class StepTimes(NamedTuple):
    """When one step's parts ran, in seconds since the :meth:`~kvlab.serving.hf.PagedGenerator.generate`
    call began (the host's clock; a CUDA step's device times are read from events)."""

    index: int
    requests: int                     # requests in the step
    tokens: int                       # tokens in its forward pass
    decode_only: bool
    schedule: tuple[float, float]     # host: choose the requests, map their pages
    launch: tuple[float, float]       # host: build the inputs, hand the work to the device
    process: tuple[float, float]      # host: wait for the tokens, record them, release the finished
    device: tuple[float, float]       # device: the forward pass and the tokens' copy
    tokens_at: float = 0.0            # host: when the wait ended (the tokens were there)


class Ticket:
    """One piece of submitted work: its result once done, and when it ran."""

    __slots__ = ("future", "value", "event", "events", "span")

    def __init__(self):
        self.future: Future | None = None
        self.value = None
        self.event = None          # CUDA: recorded after the copy to the host
        self.events = None         # CUDA: (start, end) around the work, for the timeline
        self.span = (0.0, 0.0)     # host clock: when the work ran (perf_counter)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host that is safe to keep once the work is done: from a CUDA
    tensor into pinned memory without waiting (the queue's event says when it has landed)."""
    if t.device.type != "cuda":
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class DeviceQueue:
    """The device's work, in submission order (see the module docstring)."""

    #: True where ``submit`` returns before the work is done
    asynchronous = False
    timeline = False

    def begin(self, timeline: bool) -> None:
        """A new call: record when each piece of work ran (``timeline``) or not."""
        self.drain()              # anything an interrupted call left running finishes first
        self.timeline = timeline

    def submit(self, work: Callable[[], tuple]) -> Ticket:
        ticket = Ticket()
        start = time.perf_counter()
        ticket.value = work()
        ticket.span = (start, time.perf_counter())
        return ticket

    def result(self, ticket: Ticket) -> tuple:
        """Wait for ``ticket``'s work; its value (its exception, if it failed)."""
        return ticket.value

    def device_span(self, ticket: Ticket) -> tuple[float, float]:
        """When the work ran (host clock, perf_counter seconds); after :meth:`result`."""
        return ticket.span

    def drain(self) -> None:
        """Wait for every piece of work submitted so far (their errors are not raised here:
        the caller is already handling one)."""

    def close(self) -> None:
        self.drain()


class ThreadQueue(DeviceQueue):
    """One worker thread runs the work in order, like a stream on a CPU. Its work runs in
    ``torch.inference_mode()`` (a per-thread mode) like the caller's."""

    asynchronous = True

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-device")
        self._last: Future | None = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], tuple]) -> Ticket:
        ticket = Ticket()

        def run():
            start = time.perf_counter()
            with torch.inference_mode():
                try:
                    return work()
                finally:
                    ticket.span = (start, time.perf_counter())

        with self._lock:
            ticket.future = self._last = self._pool.submit(run)
        return ticket

    def result(self, ticket: Ticket) -> tuple:
        return ticket.future.result()

    def drain(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            try:
                last.result()       # the worker runs in order: the last one done, all are
            except BaseException:   # noqa: BLE001 - its error belongs to the call that failed
                pass

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


class CudaQueue(DeviceQueue):
    """The current CUDA stream: ``submit`` only enqueues (kernels, the tokens' copy into pinned
    memory, an event); :meth:`result` waits for that event, not for the whole stream -- so the
    host can wait for step n while step n+1 is already queued behind it."""

    asynchronous = True

    def begin(self, timeline: bool) -> None:
        super().begin(timeline)
        if timeline:   # a reference event with a known host time: device times on the host's clock
            self.drain()
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin_host = time.perf_counter()

    def submit(self, work: Callable[[], tuple]) -> Ticket:
        ticket = Ticket()
        start = end = None
        if self.timeline:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        ticket.value = work()
        if end is not None:
            end.record()
            ticket.events = (start, end)
        ticket.event = torch.cuda.Event()
        ticket.event.record()
        return ticket

    def result(self, ticket: Ticket) -> tuple:
        ticket.event.synchronize()
        return ticket.value

    def device_span(self, ticket: Ticket) -> tuple[float, float]:
        if ticket.events is None:
            return (0.0, 0.0)
        start, end = ticket.events
        return tuple(self._origin_host + self._origin.elapsed_time(e) / 1e3 for e in (start, end))

    def drain(self) -> None:
        torch.cuda.current_stream().synchronize()


def device_queue(device: torch.device) -> DeviceQueue:
    """The queue a generator uses: a CUDA stream on a GPU, a worker thread on a CPU."""
    return CudaQueue() if device.type == "cuda" else ThreadQueue()
