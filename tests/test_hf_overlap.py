"""Overlap scheduling in kvlab.serving.hf.PagedGenerator: step n+1 is scheduled and launched before the
host reads step n's tokens, and the tokens are still exactly ``generate``'s.

Every run ends requests at different steps (EOS for some, max_new_tokens for others), cuts long
prompts into chunks, and reuses page-table rows (few rows, more prompts). Beside the tokens:
who is scheduled when (a request that reached max_new_tokens never again; one that produced
EOS rides exactly one more step, with overlap), each request released exactly once, and -- with
a device that runs a step only when the host waits for it, so the host is always a step
ahead -- no step ever touches a page or a row of a request released before it ran.
"""
from __future__ import annotations

import random
import time
from collections import deque

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.56")

import kvlab  # noqa: E402
from hf_helpers import VOCAB, assert_identical, pages_accounted_for, reference  # noqa: E402
from kvlab.serving.hf import PagedGenerator, tiny_model  # noqa: E402
from kvlab.serving.hf.loop import ServingLoop  # noqa: E402
from kvlab.serving.hf.overlap import DeviceQueue, ThreadQueue, Ticket  # noqa: E402

ARCHS = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: tiny_model(arch, str(tmp_path_factory.mktemp(arch)), seed=1, device=kvlab.DEVICE,
                             **(dict(head_dim=32) if arch == "qwen3" else {})) for arch in ARCHS}


def workload(model, seed: int):
    """Prompts (two behind a shared system prompt, a long one for chunks, a one-token one),
    per-prompt max_new_tokens, and two EOS tokens that end two requests at different steps
    (chosen from what the model says: its 2nd token for one, its 5th for another)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(13)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 6)]
    prompts += [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 1, 9, 4)]
    max_new = [7, 5, 8, 6, 7, 3]
    plain = [reference(model, p, 8)[0] for p in prompts]
    eos = [plain[0][1], plain[2][4]]
    return prompts, max_new, eos


def serve(model, prompts, max_new, eos, monkeypatch, **kw):
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    gen = PagedGenerator(model, **kw)
    steps = []
    got = gen.generate(prompts, max_new_tokens=max_new, output_logits=True, on_step=steps.append)
    return gen, got, steps


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_same_tokens_with_eos_at_different_steps_chunks_and_reused_rows(models, arch, page_size,
                                                                         overlap, monkeypatch):
    model = models[arch]
    prompts, max_new, eos = workload(model, seed=page_size)
    gen, got, steps = serve(model, prompts, max_new, eos, monkeypatch, page_size=page_size,
                            num_pages=160 // page_size + 4, max_running=3, prefill_budget=8,
                            overlap=overlap)
    assert_identical(model, gen, prompts, got, max_new)
    by = [r.finished_by for r in gen.requests]
    ended_by_eos = [len(t) for t, b in zip(got, by) if b == "eos"]
    assert "length" in by and len(set(ended_by_eos)) >= 2, (by, got)   # EOS at different steps
    assert gen.stats["chunks"] > 0 and gen.stats["most_running"] <= 3
    # scheduled once per token it produced; with overlap a request that produced EOS before its
    # last allowed token rides one more step (its token there is dropped), never two
    for i, (tokens, r) in enumerate(zip(got, gen.requests)):
        decodes = sum(i in s.decode for s in steps)
        rides = overlap and r.finished_by == "eos" and len(tokens) < max_new[i]
        assert decodes == len(tokens) - 1 + rides, (i, decodes, tokens, r.finished_by)
    pages_accounted_for(gen)
    # the same generator again: the cache serves what the first call computed
    again = gen.generate(prompts[:3], max_new_tokens=max_new[:3], output_logits=True)
    assert again == got[:3] and sum(r.cached for r in gen.requests) > 0
    assert_identical(model, gen, prompts[:3], again, max_new[:3])
    pages_accounted_for(gen)


def test_every_finished_request_is_released_exactly_once(models, monkeypatch):
    model = models["llama"]
    prompts, max_new, eos = workload(model, seed=3)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    gen = PagedGenerator(model, page_size=4, num_pages=64, max_running=2, prefill_budget=8, overlap=True)
    ended, aborted = [], []
    cache_req, release_req = gen.manager.cache_req, gen.manager.release_req

    def counting_cache_req(req, *, finished):
        if finished:
            ended.append(req)
        return cache_req(req, finished=finished)

    monkeypatch.setattr(gen.manager, "cache_req", counting_cache_req)
    monkeypatch.setattr(gen.manager, "release_req", lambda req: aborted.append(req) or release_req(req))
    gen.generate(prompts, max_new_tokens=max_new)
    assert len(ended) == len(prompts) == len(set(map(id, ended))) and not aborted
    pages_accounted_for(gen)


# --- a device that runs each step only when the host waits for it -------------------------

class LazyQueue(DeviceQueue):
    """A device as late as it can be: a step's work runs when the host waits for its tokens,
    after the host has scheduled (and mapped the pages of) the next step."""

    asynchronous = True

    def __init__(self):
        self.pending: deque = deque()

    def submit(self, work):
        ticket = Ticket()
        ticket.value = ticket          # not run yet
        self.pending.append((ticket, work))
        return ticket

    def _run_next(self):
        ticket, work = self.pending.popleft()
        start = time.perf_counter()
        try:
            ticket.value = work()
        except BaseException as e:
            ticket.value = e
        ticket.span = (start, time.perf_counter())

    def result(self, ticket):
        while ticket.value is ticket:
            self._run_next()
        if isinstance(ticket.value, BaseException):
            raise ticket.value
        return ticket.value

    def drain(self):
        while self.pending:
            self._run_next()


class PageGuard:
    """Wraps each step's device work with a check, made when the work runs: every request of
    the step still holds its row, and every page it reads is neither free nor someone else's."""

    def __init__(self, gen, monkeypatch):
        self.gen, self.checked, self.violations = gen, 0, []
        launch = gen._launch_step

        def guarded(step, produces, queue, **kw):
            outer = self

            class Checked:
                def submit(self, work):
                    def run():
                        outer.check(step)
                        return work()
                    return queue.submit(run)
            return launch(step, produces, Checked(), **kw)
        monkeypatch.setattr(gen, "_launch_step", guarded)

    def check(self, step) -> None:
        m, P = self.gen.manager, self.gen.page_size
        free = set(m.free_slots.tolist())
        for req, row, end in zip(step.reqs, step.table_idx, step.end):
            slots = self.gen.page_table[row, :end]
            if req.finished or m.allocated_pages(req) == 0:
                self.violations.append(f"row {row}: its request was released before the step ran")
            elif bool((slots < 0).any()) or set((slots // P * P).tolist()) & free:
                self.violations.append(f"row {row}: reads a free or unmapped page")
        self.checked += 1


def race_workload(model):
    """Requests that end early by EOS (at different steps) and, behind them, requests that
    share their prompts' pages: the rows and pages they give back are taken at once."""
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(12)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(n)] for n in (1, 3, 2, 5, 4, 1)]
    plain = [reference(model, p, 6)[0] for p in prompts]
    return prompts, [plain[0][1], plain[1][3]]


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_step_reads_a_page_of_a_request_that_finished_a_step_earlier(models, page_size, monkeypatch):
    model = models["llama"]
    prompts, eos = race_workload(model)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    gen = PagedGenerator(model, page_size=page_size, num_pages=96 // page_size, max_running=2, overlap=True)
    gen._queues[True] = LazyQueue()
    guard = PageGuard(gen, monkeypatch)
    got = gen.generate(prompts, max_new_tokens=6, output_logits=True)
    assert guard.checked == gen.stats["steps"] and not guard.violations, guard.violations
    assert_identical(model, gen, prompts, got, 6)
    assert sum(r.finished_by == "eos" for r in gen.requests) >= 2
    pages_accounted_for(gen)


def test_the_page_guard_catches_a_release_while_the_request_rides_a_step(models, monkeypatch):
    """mini-sglang's order (release a request as soon as its EOS is read, while the step it
    rides in has not run) under the late device: the guard sees that step touch a released
    request's row -- so the test above can fail."""
    model = models["llama"]
    prompts, eos = race_workload(model)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    gen = PagedGenerator(model, page_size=1, num_pages=96, max_running=2, overlap=True)
    gen._queues[True] = LazyQueue()
    guard = PageGuard(gen, monkeypatch)
    process = ServingLoop.process
    monkeypatch.setattr(ServingLoop, "process", lambda self, step, in_flight: process(self, step, None))
    try:
        gen.generate(prompts, max_new_tokens=6)
    except Exception:  # noqa: BLE001 - a step may also fail outright on what it reads
        pass
    assert guard.violations


class SlowThreadQueue(ThreadQueue):
    """The worker thread waits a little before each step: the host is well ahead."""

    def submit(self, work):
        return super().submit(lambda: (time.sleep(0.01), work())[1])


def test_a_slow_worker_thread_gives_the_same_tokens(models, monkeypatch):
    model = models["qwen3"]
    prompts, eos = race_workload(model)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    gen = PagedGenerator(model, page_size=2, num_pages=64, max_running=3, prefill_budget=9, overlap=True)
    gen._queues[True] = SlowThreadQueue()
    guard = PageGuard(gen, monkeypatch)
    got = gen.generate(prompts, max_new_tokens=6, output_logits=True)
    assert not guard.violations
    assert_identical(model, gen, prompts, got, 6)
    pages_accounted_for(gen)


# --- memory pressure (chapter 12's policies) with overlap ------------------------------------

@pytest.mark.parametrize("page_size, pages", [(1, 50), (16, 3)])
@pytest.mark.parametrize("policy", ["recompute", "retract", "swap"])
def test_every_memory_policy_stops_and_resumes_requests_with_overlap(models, policy, page_size, pages):
    """A pool too small for the answers: the policy stops requests (the step in flight is
    processed first) and brings them back; an end of text the scheduler cannot foresee
    (``end_after``) ends one early. Tokens and logits are generate's; every page comes back."""
    model = models["llama"]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 17, 4, 12, 3, 6)]
    ends = [10, 10, 10, 8, 10, 10]
    gen = PagedGenerator(model, page_size=page_size, num_pages=pages, max_running=6, prefill_budget=7,
                         policy=policy, overlap=True)
    got = gen.generate(prompts, max_new_tokens=10, end_after=ends, output_logits=True)
    assert sum(r.stops for r in gen.requests) > 0, "the pool never ran short: the test proves nothing"
    assert [r.finished_by for r in gen.requests] == ["stop" if e < 10 else "length" for e in ends]
    for i, (prompt, e) in enumerate(zip(prompts, ends)):
        want, want_logits = reference(model, prompt, e)
        assert got[i] == want, (policy, i, got[i], want)
        assert float((gen.logits[i] - want_logits).abs().max()) <= 1e-4
    pages_accounted_for(gen)


# --- timelines, arrivals ------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_the_timeline_shows_the_order_of_host_and_device_work(models, overlap):
    gen = PagedGenerator(models["llama"], page_size=4, num_pages=64, overlap=overlap)
    rng = random.Random(0)
    gen.generate([[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 9, 2)], max_new_tokens=5,
                 timeline=True)
    tl = gen.timeline
    assert [s.index for s in tl] == list(range(gen.stats["steps"]))
    for s in tl:
        assert s.schedule[0] <= s.schedule[1] <= s.launch[0] <= s.launch[1] <= s.process[1]
        assert s.launch[0] <= s.device[0] <= s.device[1] <= s.process[1]
    for a, b in zip(tl, tl[1:]):
        assert a.device[1] <= b.device[0]                 # the device runs steps in order
        if overlap:                                      # step n+1 launched before n is processed
            assert b.launch[1] <= a.process[0]
        else:                                            # n processed before n+1 is scheduled
            assert a.process[1] <= b.schedule[0]
    assert [s.decode_only for s in tl] == [s.index > 0 for s in tl]


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_arrive_over_time_with_their_own_max_new_tokens(models, overlap):
    model = models["qwen3"]
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 3, 11, 2)]
    arrivals, max_new = [0.0, 0.0, 0.4, 0.45], [4, 6, 2, 5]
    gen = PagedGenerator(model, page_size=4, num_pages=64, overlap=overlap)
    got = gen.generate(prompts, max_new_tokens=max_new, arrivals=arrivals, output_logits=True)
    assert_identical(model, gen, prompts, got, max_new)
    for r, a in zip(gen.requests, arrivals):
        assert r.arrival == a and r.times[0] >= a and r.ttft > 0 and r.latency >= r.ttft
        assert len(r.itl) == r.generated - 1 and all(t >= 0 for t in r.itl)


# --- on a GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_the_loop_waits_only_for_the_tokens(models, overlap, monkeypatch):
    """Scheduling, launching, advancing and recording run with torch's sync debug mode set to
    raise: the host waits for the GPU only on each step's token event (with overlap, while the
    next step is already queued)."""
    from kvlab.serving.hf.overlap import CudaQueue

    model = models["llama"]
    gen = PagedGenerator(model, page_size=16, num_pages=64, max_running=8, prefill_budget=16,
                         overlap=overlap)
    assert gen.graphs is not None and gen.graphs.capture
    result = CudaQueue.result

    def waiting(self, ticket):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return result(self, ticket)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    run = ServingLoop.run

    def strict_run(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(CudaQueue, "result", waiting)
    monkeypatch.setattr(ServingLoop, "run", strict_run)
    prompts, max_new, eos = workload(model, seed=9)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    got = gen.generate(prompts, max_new_tokens=max_new, output_logits=True)
    assert_identical(model, gen, prompts, got, max_new)
    assert gen.stats["graph_steps"] > 0 and gen.stats["chunks"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_same_tokens_with_and_without_overlap(models, page_size, overlap, monkeypatch):
    model = models["qwen3"]
    prompts, max_new, eos = workload(model, seed=20 + page_size)
    gen, got, steps = serve(model, prompts, max_new, eos, monkeypatch, page_size=page_size,
                            num_pages=160 // page_size + 4, max_running=3, prefill_budget=8,
                            overlap=overlap)
    assert_identical(model, gen, prompts, got, max_new)
    assert gen.stats["graph_steps"] > 0
    pages_accounted_for(gen)
