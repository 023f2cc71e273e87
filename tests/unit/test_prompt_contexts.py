"""PromptContexts: a finished trajectory's contexts are released, the LRU bound still holds, and
no bookkeeping outlives its entry (the collector's memory for prompt references stays bounded)."""

from __future__ import annotations

from tracecar.collector.processors.prompt_refs import Context, PromptContexts


def _context(n: int) -> Context:
    return Context(list(range(n)), n)


def test_a_trajectory_s_contexts_are_released_at_the_next_batch_after_its_root() -> None:
    contexts = PromptContexts(max_bytes=10**9)
    for i in range(3):
        contexts.remember("w", f"a{i}", _context(100), "trace-a")
    contexts.remember("w", "b0", _context(100), "trace-b")
    contexts.remember("other", "a9", _context(100), "trace-a")  # same trace id, another worker: not this trajectory
    contexts.trajectory_ended("w", "trace-a")
    assert contexts.get("w", "a0") is not None  # the root's own batch still finds its bases
    assert contexts.release_ended() == 3
    assert [contexts.get("w", f"a{i}") for i in range(3)] == [None, None, None]
    assert contexts.get("w", "b0") is not None and contexts.get("other", "a9") is not None
    assert contexts.bytes == 2 * _context(100).size and len(contexts) == 2
    assert contexts.release_ended() == 0  # each ended trajectory is released once


def test_texts_set_later_keep_the_entry_in_its_trajectory() -> None:
    contexts = PromptContexts(max_bytes=10**9)
    contexts.remember("w", "a0", _context(10), "trace-a")
    contexts.set_texts("w", "a0", "prompt text", "response", "tok")
    assert contexts.get("w", "a0").text == "prompt text"  # type: ignore[union-attr]
    contexts.trajectory_ended("w", "trace-a")
    assert contexts.release_ended() == 1 and contexts.bytes == 0 and len(contexts) == 0


def test_eviction_by_the_bound_leaves_no_trajectory_bookkeeping_behind() -> None:
    size = _context(50).size
    evicted: list[int] = []
    contexts = PromptContexts(max_bytes=4 * size, on_evict=evicted.append)
    for i in range(100):
        contexts.remember("w", f"s{i}", _context(50), f"trace-{i}")  # roots never arrive
    assert len(contexts) == 4 and contexts.bytes == 4 * size and sum(evicted) == 96
    assert len(contexts._of_trace) == 4 and len(contexts._trace_of) == 4  # bounded with the entries
    contexts.trajectory_ended("w", "trace-0")  # long evicted: nothing to release, nothing queued
    assert contexts._ended == [] and contexts.release_ended() == 0


def test_a_context_references_the_span_s_lists_and_slices_across_prompt_and_response() -> None:
    """The context is the span's own prompt and response lists (no copy of every id per span);
    every slice a reference can ask for is what slicing prompt + response gives."""
    prompt, response = list(range(100, 107)), list(range(200, 204))
    context = Context.of(prompt, {"response_ids": response})
    assert context.ids is prompt and context.response is response
    assert context.n_ids == 11 and context.prompt_len == 7 and context.response_source == "output.response_ids"
    whole = prompt + response
    for start in range(len(whole) + 1):
        for stop in range(start, len(whole) + 1):
            assert context.slice(start, stop) == whole[start:stop], (start, stop)
    assert context.slice(0, 11) is not prompt  # a new list: the rebuilt prompt may be extended in place
    assert Context.of(prompt, {"response_ids": []}).response is None
    assert Context(list(range(5)), 5).size == _context(5).size
