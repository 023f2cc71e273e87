"""The generation loop is sacred: with the collector down, traced code runs and nothing raises."""

from __future__ import annotations

import asyncio

import pytest

from tests.support import free_port  # closed again at once: connections to it are refused
from tracecar.client import rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(60)


class Loop:
    @rollout_trace_op
    async def run(self, prompt_ids: list[int]) -> dict[str, list[int]]:
        await asyncio.sleep(0)
        return {"response_ids": [i + 1 for i in prompt_ids]}

    @rollout_trace_op
    def fails(self, x: int) -> int:
        raise KeyError(x)


def test_collector_down_traced_function_returns_its_result(tracer_to):
    tracer = tracer_to(f"http://127.0.0.1:{free_port()}", queue_max_spans=50, retry_max_elapsed_s=0.5,
                       retry_initial_s=0.05, http_timeout_s=0.5)
    loop = Loop()

    async def main() -> list[dict[str, list[int]]]:
        outs = []
        for i in range(200):
            with rollout_trace_attr(sample_index=i, step=1, rollout_n=0):
                outs.append(await loop.run([i, i + 1]))
        return outs

    outs = asyncio.run(main())
    assert outs == [{"response_ids": [i + 1, i + 2]} for i in range(200)]
    with pytest.raises(KeyError):  # the function's own exception still reaches the caller
        loop.fails(3)
    assert tracer.flush(10)  # bounded: retries give up after retry_max_elapsed_s
    stats = tracer.stats()
    # 401 spans were produced; the queue holds 50: the overflow was dropped at once, what the
    # sender took was dropped after its retries gave up, and nothing is unaccounted for
    dropped = stats["dropped"]
    assert set(dropped) == {"queue_full", "retries_exhausted"}
    assert dropped["queue_full"] > 0 and dropped["retries_exhausted"] > 0
    assert stats["sent"] == 0 and stats["queued"] == 0
    assert sum(dropped.values()) == 401


def test_a_long_context_span_larger_than_a_batch_still_goes_out(start_collector, tracer_to):
    """128k-token prompts are ~0.8 MB of ids: bigger than a batch, far from the span bound."""
    col = start_collector()
    tracer = tracer_to(col.url, batch_max_bytes=64 * 1024)
    loop = Loop()
    prompt = list(range(100_000, 228_000))

    async def main() -> None:
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
            await loop.run(prompt)

    asyncio.run(main())
    assert tracer.flush(20)
    stats = tracer.stats()
    assert stats["dropped_total"] == 0 and stats["sent"] == 2
    import httpx

    [traj] = httpx.get(col.url + "/v1/trajectories").json()["trajectories"]
    tree = httpx.get(f"{col.url}/v1/trajectories/{traj['trace_id']}").json()
    assert tree["root"]["children"][0]["inputs"]["prompt_ids"] == prompt


def test_a_bug_while_posting_counts_every_span_of_the_batch(tracer_to, caplog):
    """An error the sender does not expect (not an HTTP failure) costs the batch it was sending:
    each of its spans is counted as dropped, and the sender goes on with the next batch; its
    traceback is logged once, not once a batch."""
    tracer = tracer_to(f"http://127.0.0.1:{free_port()}", flush_interval_s=60, batch_max_spans=10)

    class Broken:
        def post(self, *args, **kwargs):
            raise RuntimeError("a bug in the post path")

    tracer.sender._client = lambda: Broken()
    loop = Loop()

    async def main() -> None:
        for i in range(30):
            with rollout_trace_attr(sample_index=i, step=1, rollout_n=0):
                await loop.run([i, i + 1])

    asyncio.run(main())
    with caplog.at_level("ERROR", logger="tracecar"):
        assert tracer.flush(10)
    stats = tracer.stats()
    assert stats["dropped"] == {"internal_error": 60} and stats["sent"] == 0  # 30 calls + 30 trajectories
    errors = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None  # 6 batches failed: one traceback
