"""VERL's max_samples_per_step_per_worker, enforced in the collector: whole trajectories only."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import pytest

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client import tracer as tracer_module
from tracecar.client.config import ClientConfig

pytestmark = pytest.mark.timeout(120)


@rollout_trace_op
async def generate(prompt_ids: list[int]) -> dict[str, list[int]]:
    await asyncio.sleep(0)
    return {"response_ids": prompt_ids[::-1]}


@rollout_trace_op
async def tool(name: str) -> str:
    await asyncio.sleep(0)
    return name.upper()


async def trajectory(step: int, index: int, n: int) -> None:
    with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop"):
        await generate([index, n, step] * 4)
        await tool(f"t{index}")
        await generate([n] * 9)


def _stable_listing(url: str, params: dict[str, object], timeout: float = 30.0) -> list[dict[str, object]]:
    """Polls until the store stops changing (a tail-based sampler may decide after a wait)."""
    deadline, last, stable_since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        page = httpx.get(url + "/v1/trajectories", params={**params, "limit": 1000}).json()
        key = (page["total"], tuple(sorted(t["trace_id"] for t in page["trajectories"])))
        if key != last:
            last, stable_since = key, time.monotonic()
        elif page["total"] and time.monotonic() - stable_since > 1.0:
            return page["trajectories"]
        time.sleep(0.2)
    raise TimeoutError("store did not settle")


def test_budget_per_step_per_worker_keeps_whole_samples(start_collector):
    col = start_collector(max_samples_per_step_per_worker=2)
    n_samples, rollout_n = 6, 3
    for worker in ("worker-a", "worker-b"):
        tracer = tracer_module.configure(ClientConfig(url=col.url, experiment="budget", worker_id=worker, flush_interval_s=0.02))

        async def step_of(step: int) -> None:
            await asyncio.gather(*(trajectory(step, i, n) for i in range(n_samples) for n in range(rollout_n)))

        for step in (1, 2):
            asyncio.run(step_of(step))
        assert tracer.flush(20)
        assert tracer.stats()["dropped_total"] == 0
        tracer_module.shutdown(5)

    kept = _stable_listing(col.url, {"experiment": "budget"})
    by_budget: dict[tuple[object, object], dict[object, set[object]]] = defaultdict(lambda: defaultdict(set))
    for t in kept:
        by_budget[(t["step"], t["worker"])][t["sample_index"]].add(t["rollout_n"])
        assert t["span_count"] == 4  # root + 2 generate + 1 tool: never a partial trajectory
    assert set(by_budget) == {(s, w) for s in (1, 2) for w in ("worker-a", "worker-b")}
    for samples in by_budget.values():
        assert len(samples) == 2  # exactly N distinct sample indices per (experiment, step, worker)
        assert all(rollouts == set(range(rollout_n)) for rollouts in samples.values())  # every rollout of a kept sample

    # nothing of a dropped sample is stored: every stored span belongs to a kept trajectory
    kept_ids = {t["trace_id"] for t in kept}
    rows = col.collector.spool.query("SELECT DISTINCT trace_id FROM spans WHERE kind != 'annotation'")
    assert {r["trace_id"] for r in rows} == kept_ids
    metrics = httpx.get(col.url + "/metrics").text
    sampled_out = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("tracecar_spans_sampled_out_total"))
    total_spans = 2 * 2 * n_samples * rollout_n * 4
    assert sampled_out == total_spans - len(kept) * 4


def test_budget_zero_keeps_nothing_and_unset_keeps_all(start_collector, tracer_to):
    none_col = start_collector(max_samples_per_step_per_worker=0)
    all_col = start_collector()
    for col, expected in ((none_col, 0), (all_col, 4 * 2)):
        tracer = tracer_to(col.url, experiment="b0")

        async def run() -> None:
            await asyncio.gather(*(trajectory(5, i, n) for i in range(4) for n in range(2)))

        asyncio.run(run())
        assert tracer.flush(20)
        time.sleep(0.3)
        if expected:
            assert len(_stable_listing(col.url, {"experiment": "b0"})) == expected
        else:
            page = httpx.get(col.url + "/v1/trajectories", params={"experiment": "b0"}).json()
            assert page["total"] == 0


def test_a_dropped_trajectorys_late_reward_stays_dropped_after_a_restart(start_collector, kit, tmp_path):
    """The trajectory's head decision is persisted with the per-sample ones: a reward the trainer
    sends after a collector restart (or after the in-memory map forgot it) follows its trajectory."""
    data_dir = tmp_path / "budget-restart"
    col = start_collector(max_samples_per_step_per_worker=1, data_dir=data_dir)
    kept, dropped = (kit.trajectory(children=1, step=7, sample_index=i, rollout_n=0) for i in (0, 1))
    assert kit.post(col.url, kept).json()["accepted"] == 2
    assert kit.post(col.url, dropped).json()["sampled_out"] == 2

    def reward(trajectory: list[dict[str, object]]) -> list[dict[str, object]]:
        root = trajectory[-1]
        return [{"span_id": kit.new_id(), "trace_id": root["trace_id"], "parent_id": None, "name": "annotation",
                 "kind": "annotation", "start_time": 9.0, "end_time": 9.0, "attributes": {"reward": 1.0},
                 "inputs": {}, "output": None, "exception": None}]

    col.stop()
    col = start_collector(max_samples_per_step_per_worker=1, data_dir=data_dir)
    late = kit.post(col.url, reward(dropped)).json()
    assert (late["accepted"], late["sampled_out"]) == (0, 1), late
    assert kit.post(col.url, reward(kept)).json()["accepted"] == 1
    assert httpx.get(f"{col.url}/v1/trajectories/{dropped[-1]['trace_id']}").status_code == 404
