"""End to end through HTTP: a tail budget holds a step, decides it when the worker moves on,
forwards the kept trajectories whole with ``kept_because`` on their roots, and explains itself."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import pytest

from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op
from tracecar.client.cli import main as cli_main
from tracecar.collector.exporters.forward import SendResult

pytestmark = pytest.mark.timeout(120)
EXPERIMENT = "exp-tail"


class RecordingSink:
    """A backend that accepts everything and remembers what it got, in order."""

    name = "recording"

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        with self._lock:
            self.spans.extend(dict(s) for s in spans)
        return SendResult(delivered=[s["span_id"] for s in spans])

    async def aclose(self) -> None:
        return None

    def of_step(self, step: int) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s.get("attributes", {}).get("step") == step]


class ToolError(Exception):
    pass


@rollout_trace_op
async def generate(prompt: str) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"text": f"reply to {prompt}"}


@rollout_trace_op
async def call_tool(query: str) -> dict[str, Any]:
    await asyncio.sleep(0)
    if query == "fail":
        raise ToolError("backend down")
    return {"result": query}


async def rollout(step: int, index: int, n: int, reward: float, fail: bool) -> str:
    with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop") as traj:
        await generate(f"q{index}")
        try:
            await call_tool("fail" if fail else "ok")
        except ToolError:
            pass
    annotate(traj, reward=reward)
    return traj.span_id


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_held_then_decided_then_forwarded_with_kept_because(start_collector, tracer_to, capsys):
    sink = RecordingSink()
    col = start_collector(sink=sink, max_trajectories_per_step=3, keep_spread_groups=0, keep_groups_whole=False,
                          reward_wait_s=0.3, step_idle_s=60, decision_wait_s=120)
    tracer = tracer_to(col.url, experiment=EXPERIMENT, project="proj")

    async def step_one() -> dict[tuple[int, int], str]:
        keys = [(i, n) for i in range(3) for n in range(2)]
        ids = await asyncio.gather(*(rollout(1, i, n, float(i * 10 + n), fail=(i, n) == (1, 0)) for i, n in keys))
        return dict(zip(keys, ids))

    ids = asyncio.run(step_one())
    assert tracer.flush(20)

    # held: committed, visible as an open step, nothing forwarded
    page = httpx.get(col.url + "/v1/decisions", params={"experiment": EXPERIMENT, "step": 1}).json()
    assert page["mode"] == "tail" and page["budget"] == {"max_trajectories_per_step": 3}
    assert page["decisions"] == [] and len(page["open"]) == 1
    assert page["open"][0]["held_trajectories"] == 6 and page["open"][0]["with_reward"] == 6
    assert sink.of_step(1) == []
    metrics = httpx.get(col.url + "/metrics").text
    assert "tracecar_held_spans 24.0" in metrics  # 6 × (root + generate + call_tool + annotation)

    # the worker starts step 2: step 1 closes and is decided
    asyncio.run(rollout(2, 0, 0, 1.0, fail=False))
    assert tracer.flush(20)
    page = wait_for(lambda: (p := httpx.get(col.url + "/v1/decisions", params={"experiment": EXPERIMENT, "step": 1}).json())["decisions"] and p)
    assert page["kept"] == 3 and page["dropped"] == 3 and page["open"] == []
    assert page["kept_by_rule"] == {"error": 1, "reward_max": 1, "reward_min": 1}
    assert page["dropped_by_reason"] == {"max_trajectories_per_step": 3}
    assert {d["closed_by"] for d in page["decisions"]} == {"next_step"}
    expected = {ids[(1, 0)]: "error", ids[(2, 1)]: "reward_max", ids[(0, 0)]: "reward_min"}

    # forwarded: each kept trajectory whole, its root saying why; nothing of the dropped ones
    got = wait_for(lambda: len(sink.of_step(1)) == 9 and sink.of_step(1))
    assert got, sink.of_step(1)
    roots = {s["span_id"]: s for s in got if s["parent_id"] is None}
    assert {sid: r["attributes"]["kept_because"] for sid, r in roots.items()} == expected
    assert {s["trace_id"] for s in got} == set(expected)
    for trace_id in expected:
        names = sorted(s["name"] for s in got if s["trace_id"] == trace_id)
        assert names == ["agent_loop", "call_tool", "generate"]
    with sink._lock:
        annotations = {s["trace_id"] for s in sink.spans if s["kind"] == "annotation"}
    assert set(expected) <= annotations and not annotations & (set(ids.values()) - set(expected))

    # explained on /metrics and by the CLI
    metrics = httpx.get(col.url + "/metrics").text
    assert 'tracecar_trajectories_kept_total{rule="error"} 1.0' in metrics
    assert 'tracecar_trajectories_dropped_total{reason="max_trajectories_per_step"} 3.0' in metrics
    assert 'tracecar_step_decisions_total{closed_by="next_step"} 1.0' in metrics
    capsys.readouterr()
    cli_main(["decisions", "--url", col.url, "--step", "1", "--experiment", EXPERIMENT])
    out = capsys.readouterr().out
    assert "kept 3 (error 1, reward_max 1, reward_min 1); dropped 3 (max_trajectories_per_step 3)" in out
    assert out.count("no  max_trajectories_per_step\n") == 3 and f"{ids[(1, 0)]}" in out


def test_no_budget_forwards_at_once_and_reports_no_decisions(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink)
    assert col.collector.pipeline.selection is None
    tracer = tracer_to(col.url, experiment=EXPERIMENT)
    asyncio.run(rollout(1, 0, 0, 1.0, fail=False))
    assert tracer.flush(20)
    assert wait_for(lambda: len(sink.of_step(1)) == 3)
    assert all("kept_because" not in s["attributes"] for s in sink.of_step(1))
    page = httpx.get(col.url + "/v1/decisions", params={"step": 1, "experiment": EXPERIMENT}).json()
    assert page["mode"] == "pass" and page["decisions"] == [] and page["open"] == []
