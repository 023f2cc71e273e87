"""tracecar.client.traceparent(): the W3C header an inference engine parents its spans on."""

from __future__ import annotations

import asyncio

from tracecar.client import rollout_trace_attr, rollout_trace_op, trace_headers, traceparent
from tracecar.client import tracer as _tracer
from tracecar.client.spans import ids


def test_names_the_current_span_and_the_root_when_the_span_was_made_in_another_process(start_collector, tracer_to):
    tracer = tracer_to(start_collector().url)
    got: dict[int, tuple[str | None, str]] = {}

    @rollout_trace_op
    async def generate(i: int) -> None:
        await asyncio.sleep(0)
        got[i] = (traceparent(), _tracer.current.get().span_id)

    async def one(i: int) -> str:
        with rollout_trace_attr(sample_index=i, step=0) as root:
            await generate(i)
        return root.span_id

    async def both() -> list[str]:
        return list(await asyncio.gather(one(0), one(1)))  # concurrent tasks never mix their contexts

    for i, root in enumerate(asyncio.run(both())):
        header, span_id = got[i]
        assert span_id[:16] == root[:16] and span_id != root
        assert header == f"00-{root}-{span_id[16:]}-01" and trace_headers() is None

    with rollout_trace_attr(sample_index=5, step=0) as root:
        old_prefix = ids.prefix
        ids.reset()  # what a fork does: spans made from now on carry another prefix

        @rollout_trace_op
        def call() -> tuple[str | None, dict[str, str] | None]:
            return traceparent(), trace_headers()

        header, headers = call()
        assert ids.prefix != old_prefix
        assert header == f"00-{root.span_id}-{root.span_id[16:]}-01"  # names the root: still the right trajectory
        assert headers == {"traceparent": header, "tracestate": "tracecar=top"}  # placed as the root's child
    assert tracer.flush(10)


def test_tracestate_says_where_an_engine_span_sits_in_verls_weave_tree(start_collector, tracer_to):
    """trajectory root -> top; in a top-level call -> <that call>; deeper -> <top-level call>.<turn>."""
    from tracecar.client.traceparent import tracestate

    tracer = tracer_to(start_collector().url)
    seen: dict[str, tuple[str | None, str]] = {}

    @rollout_trace_op
    def generate() -> None:
        seen["generate"] = (tracestate(), _tracer.current.get().span_id)

    @rollout_trace_op
    def turn() -> None:
        seen["turn"] = (tracestate(), _tracer.current.get().span_id)
        generate()

    @rollout_trace_op
    def run() -> None:
        seen["run"] = (tracestate(), _tracer.current.get().span_id)
        turn()

    with rollout_trace_attr(sample_index=1, step=0):
        assert tracestate() == "tracecar=top"
        run()
    top, turn_id = seen["run"][1], seen["turn"][1]
    assert seen["run"][0] == f"tracecar={top}"
    assert seen["turn"][0] == f"tracecar={top}.{turn_id}"
    assert seen["generate"][0] == f"tracecar={top}.{turn_id}"  # deeper calls belong to their turn
    with rollout_trace_attr(sample_index=2, step=0, trace=False):
        assert trace_headers()["traceparent"].endswith("-00") and "tracestate" not in trace_headers()
    assert tracestate() is None and trace_headers() is None
    assert tracer.flush(10)
