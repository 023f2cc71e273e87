"""collector/processors/sampling/head.py: each trajectory's decision is persisted by every batch
that carries its spans, so one batch's failed write cannot lose it (a reward that comes later,
after a restart, must follow its trajectory)."""

from __future__ import annotations

from typing import Any

from tracecar.collector.processors.sampling.head import StepBudgetSampler
from tracecar.collector.spool.store import TRACE_DECISIONS


def span(trace: str, index: int) -> dict[str, Any]:
    return {"span_id": f"{trace}-{index}", "trace_id": trace, "kind": "op", "worker": "w0",
            "attributes": {"experiment_name": "e", "step": 1, "sample_index": index, "validate": False}}


def test_a_failed_write_of_one_batch_leaves_the_decision_to_the_other() -> None:
    sampler = StepBudgetSampler(1, lambda key: {})
    first = sampler.sample([span("t0", 0), span("t1", 1)])
    second = sampler.sample([span("t0", 0), span("t1", 1)])  # decided while the first batch was being written
    sampler.forget(first.new_decisions)  # the first batch's write failed
    traced = {(i, keep) for key, i, keep in second.new_decisions if key == TRACE_DECISIONS}
    assert traced == {("t0", True), ("t1", False)}


def test_a_trajectory_the_cache_lost_is_asked_of_the_store_once() -> None:
    asked: list[str] = []
    sampler = StepBudgetSampler(1, lambda key: {}, load_trace=lambda t: asked.append(t) or False)
    reward = {"span_id": "r", "trace_id": "gone", "kind": "annotation", "worker": "w0", "attributes": {"reward": 1.0}}
    assert sampler.sample([reward]).dropped == [reward]
    assert sampler.sample([dict(reward, span_id="r2")]).dropped and asked == ["gone"]
