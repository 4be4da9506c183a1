"""PagedGenerator stays usable after a failure or an interrupt anywhere in ``generate``.

Failures are injected at every mutating step of a call, as an error or as a KeyboardInterrupt
(a learner pressing stop): between any two lines of the serving loop's own code (scheduling,
admission, launch, advance, recording, release, the generator's own lines, and its clean-up
itself), at each call of the cache manager's mutating words (before their work, or after it:
the change made, the caller never told), in the device's step and in the wait for it. After
each, whatever happened: no request holds a row, every page is free or in the prefix cache,
``check_integrity`` holds, and the same generator's next call gives ``generate``'s tokens. A
hypothesis state machine interleaves such failures with ordinary calls, overlap on and off.
Every bad argument of the package's public calls is refused with ``InvalidArgument``.
"""
from __future__ import annotations

import random

import pytest
import torch
from faults import Boom, Interrupted, failing, interrupt_at_line
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

transformers = pytest.importorskip("transformers", minversion="4.56")

import kvlab  # noqa: E402
from hf_helpers import VOCAB, pages_accounted_for, reference, torch_decode_step  # noqa: E402
from kvlab import InvalidArgument  # noqa: E402
from kvlab.serving.hf import PagedGenerator, tiny_model  # noqa: E402
from kvlab.serving.hf.loop import ServingLoop  # noqa: E402
from kvlab.serving.hf.prefill import PrefillAdder  # noqa: E402
from kvlab.serving.hf.room import Room  # noqa: E402

INJECTED = (Boom, Interrupted)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model("llama", str(tmp_path_factory.mktemp("llama")), seed=2, device=kvlab.DEVICE)


def small_workload():
    """Two prompts behind a shared prefix (one waits for the other's pages), a long one (in
    chunks), a one-token one: with two rows, rows are reused."""
    rng = random.Random(11)
    system = [rng.randrange(VOCAB) for _ in range(5)]
    return [system + [1, 2], system + [3], [rng.randrange(VOCAB) for _ in range(9)], [7]]


class References:
    """generate's tokens per (prompt, max_new_tokens), computed once."""

    def __init__(self, model):
        self.model, self.cache = model, {}

    def __call__(self, prompts, max_new):
        out = []
        for p in prompts:
            key = (tuple(p), max_new)
            if key not in self.cache:
                self.cache[key] = reference(self.model, p, max_new)[0]
            out.append(self.cache[key])
        return out


def generator(model, overlap: bool):
    return PagedGenerator(model, page_size=2, num_pages=24, max_running=2, prefill_budget=6,
                          decode_step=torch_decode_step, overlap=overlap)


def assert_healthy(gen, refs, prompts, max_new=3):
    """Every page accounted for, and the next call gives generate's tokens."""
    pages_accounted_for(gen)
    assert gen.generate(prompts, max_new_tokens=max_new) == refs(prompts, max_new)
    pages_accounted_for(gen)


#: the serving loop's own code: every line of these is a place an interrupt may land
LOOP_CODE = [ServingLoop.run, ServingLoop.schedule, ServingLoop._admit, ServingLoop.advance,
             ServingLoop.process, ServingLoop.release, PrefillAdder.try_admit, PrefillAdder._take,
             PrefillAdder.add_chunk, Room.make_room, PagedGenerator.generate,
             PagedGenerator._launch_step]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("code", LOOP_CODE, ids=lambda f: f.__qualname__)
def test_an_interrupt_between_any_two_lines_of_the_loop_leaves_a_usable_generator(model, code, overlap):
    refs, prompts = References(model), small_workload()
    gen = generator(model, overlap)
    interrupted = 0
    for k in range(1, 2000):
        with interrupt_at_line(code, k) as seen:
            try:
                got = gen.generate(prompts, max_new_tokens=3)
            except Interrupted:
                interrupted += 1
            else:
                assert got == refs(prompts, 3)
        assert_healthy(gen, refs, prompts[:2] + prompts[3:], 2)
        if seen[0] < k:          # the call ran to its end: every line has had its interrupt
            break
    assert interrupted >= 1, f"{code.__qualname__}: no interrupt landed"


def test_an_interrupt_inside_the_clean_up_is_finished_by_the_next_call(model):
    """The clean-up after a failure is interrupted in turn, at each of its lines: the next
    call finishes it before it starts (it reads what is left from the manager itself)."""
    refs, prompts = References(model), small_workload()
    gen = generator(model, overlap=True)
    for k in range(1, 12):
        complete = gen.manager.complete_step
        gen.manager.complete_step = failing(complete, 2)
        try:
            with interrupt_at_line(PagedGenerator._settle, k + 2):   # the 1st _settle runs at entry
                with pytest.raises(INJECTED):
                    gen.generate(prompts, max_new_tokens=3)
        finally:
            del gen.manager.complete_step
        assert gen.generate(prompts, max_new_tokens=3) == refs(prompts, 3)
        pages_accounted_for(gen)


# --- the state machine: ordinary calls and failing ones, in any order ----------------------

#: the cache manager's mutating words a generate call uses
MANAGER_WORDS = ["admit", "mixed_step", "complete_step", "cache_req", "release_req", "allocate_paged"]


class GeneratorMachine(RuleBasedStateMachine):
    model = None
    failed = 0          # injected failures that reached the caller, over all runs

    @initialize(overlap=st.booleans())
    def setup(self, overlap):
        self.refs = References(self.model)
        self.prompts = small_workload()
        self.gen = generator(self.model, overlap)

    def _call(self, prompts, max_new, *, cleanup_may_fail=False):
        try:
            got = self.gen.generate(prompts, max_new_tokens=max_new)
        except INJECTED:
            GeneratorMachine.failed += 1
            if not cleanup_may_fail:      # the call cleaned up after itself
                pages_accounted_for(self.gen)
            return                        # (else the next call finishes the clean-up)
        assert got == self.refs(prompts, max_new)
        pages_accounted_for(self.gen)

    @rule(pick=st.lists(st.integers(0, 3), min_size=1, max_size=4), max_new=st.integers(1, 4))
    def serve(self, pick, max_new):
        self._call([self.prompts[i] for i in pick], max_new)

    @rule(overlap=st.booleans())
    def switch_overlap(self, overlap):
        self.gen.overlap = overlap

    @rule(word=st.sampled_from(MANAGER_WORDS), k=st.integers(0, 8), after=st.booleans(),
          error=st.sampled_from(INJECTED), max_new=st.integers(1, 4))
    def serve_while_the_manager_fails(self, word, k, after, error, max_new):
        manager = self.gen.manager
        setattr(manager, word, failing(getattr(manager, word), k, after=after, error=error))
        try:
            self._call(self.prompts, max_new, cleanup_may_fail=word == "release_req")
        finally:
            delattr(manager, word)

    @rule(k=st.integers(0, 6), error=st.sampled_from(INJECTED), where=st.sampled_from(["step", "wait"]))
    def serve_while_the_device_fails(self, k, error, where):
        """The k-th step's device work raises (it surfaces when the host waits for it), or
        the host's wait for it is interrupted (the work itself goes on)."""
        gen = self.gen
        if where == "step":
            launch = gen._launch_step

            class Failing:
                count = 0

            def failing_launch(step, produces, queue, **kw):
                n, Failing.count = Failing.count, Failing.count + 1

                class Q:
                    def submit(self, work):
                        return queue.submit(work if n != k else failing(work, 0, error=error))
                return launch(step, produces, Q(), **kw)
            gen._launch_step = failing_launch
            try:
                self._call(self.prompts, 3)
            finally:
                del gen._launch_step
        else:
            queue = gen._queue(gen.overlap)
            queue.result = failing(queue.result, k, error=error)
            try:
                self._call(self.prompts, 3)
            finally:
                del queue.result

    @invariant()
    def the_books_balance(self):
        if hasattr(self, "gen"):
            self.gen.manager.check_integrity()


@pytest.mark.slow
def test_generator_machine(model):
    GeneratorMachine.model = model
    run = GeneratorMachine.TestCase
    run.settings = settings(max_examples=12 if kvlab.INTERPRET else 40, stateful_step_count=8,
                            deadline=None, derandomize=True)
    run().runTest()
    assert GeneratorMachine.failed > 10, "the injected failures hardly ever reached a call"


# --- bad arguments -----------------------------------------------------------------------

def _bad_calls(model):
    from kvlab.serving.hf import (check_paged_attention_inputs, graph_batch_sizes, pad_decode_batch,
                          paged_attention_reference, paged_attention_step, paged_decode_attention,
                          prefill_attention, tiny_config)

    gen = PagedGenerator(model, page_size=4, num_pages=32, max_running=4)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    pool, table = torch.zeros(64, 2, 16), torch.zeros(5, 16, dtype=torch.int32)
    rows, lens = torch.tensor([0, 1]), torch.tensor([1, 1])
    return {
        "page_size": lambda: PagedGenerator(model, page_size="4"),
        "num_pages": lambda: PagedGenerator(model, num_pages=0),
        "max_running": lambda: PagedGenerator(model, max_running=2.0),
        "max_seq_len": lambda: PagedGenerator(model, max_seq_len=-1),
        "graph_sizes": lambda: PagedGenerator(model, graph_sizes=5),
        "graph_sizes[0]": lambda: PagedGenerator(model, graph_sizes=[0]),
        "decode_step": lambda: PagedGenerator(model, decode_step=3),
        "check_steps": lambda: PagedGenerator(model, check_steps=1),
        "overlap": lambda: PagedGenerator(model, overlap="yes"),
        "policy": lambda: PagedGenerator(model, policy="bogus"),
        "host_pages": lambda: PagedGenerator(model, policy="swap", host_pages=-1),
        "model": lambda: PagedGenerator("llama"),
        "prompts": lambda: gen.generate(None),
        "prompts[0][1]": lambda: gen.generate([[1, "a"]]),
        "prompts[0][0]": lambda: gen.generate([[[1]]]),
        "max_new_tokens[1]": lambda: gen.generate([[1], [2]], max_new_tokens=[1, 0]),
        "max_new_tokens": lambda: gen.generate([[1]], max_new_tokens=[1, 2]),
        "output_logits": lambda: gen.generate([[1]], output_logits=1),
        "on_step": lambda: gen.generate([[1]], on_step=3),
        "arrivals[0]": lambda: gen.generate([[1]], arrivals=[float("nan")]),
        "arrivals": lambda: gen.generate([[1]], arrivals=3),
        "timeline": lambda: gen.generate([[1]], timeline="x"),
        "end_after[0]": lambda: gen.generate([[1]], end_after=[0]),
        "overlap ": lambda: setattr(gen, "overlap", 1),
        "rows": lambda: pad_decode_batch([1, 2], torch.tensor([0, 0]), table, [1, 2], 4),
        "sizes": lambda: pad_decode_batch(rows, torch.tensor([0, 0]), table, None, 4),
        "sizes[0]": lambda: pad_decode_batch(rows, torch.tensor([0, 0]), table, [0], 4),
        "dummy_row": lambda: pad_decode_batch(rows, torch.tensor([0, 0]), table, [2], 99),
        "positions": lambda: pad_decode_batch(rows, torch.tensor([99, 0]), table, [2], 4),
        "max_bs": lambda: graph_batch_sizes("a"),
        "scale": lambda: paged_attention_reference(q, pool, pool, table, rows, lens, "x"),
        "scale ": lambda: paged_decode_attention(q, pool, pool, table, rows, lens, -1.0),
        "positions ": lambda: paged_attention_step(q, k, k, pool, pool, table, rows, "ab"),
        "k": lambda: paged_attention_step(q, q, k, pool, pool, table, rows, [0, 0]),
        "table_idx": lambda: check_paged_attention_inputs(q, pool, pool, table, [0], [1]),
        "slots": lambda: prefill_attention(q, pool, pool, [0, 1], 0, None),
        "start": lambda: prefill_attention(q, pool, pool, torch.tensor([0, 1]), -1, None),
        "arch": lambda: tiny_config("gpt2"),
        "hidden_size": lambda: tiny_config(hidden_size=0),
        "seed": lambda: tiny_model(seed="a"),
        "foo": lambda: tiny_model(foo=1),
        "device": lambda: tiny_model(device="nope"),
    }


def test_every_bad_argument_is_refused_naming_it(model):
    for name, call in _bad_calls(model).items():
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.argument.startswith(name.strip()), (name, err.value.argument)
