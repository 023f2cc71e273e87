"""Beyond VERL's own tracing, end to end (client → collector over HTTP → Weave sink → loopback
Weave): rollouts linked to the trainer's W&B run and step, trajectories as Weave threads,
rewards and tail sampling's ``kept_because`` on the calls a user looks at."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.support.weave_stub import WeaveStub
from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(120)
API_KEY = "k" * 40


class Agent:
    @rollout_trace_op
    async def generate(self, prompt: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"text": f"reply to {prompt}"}

    @rollout_trace_op
    async def execute(self, query: str) -> dict[str, Any]:
        self.normalize(query)  # a sync op nested in the tool call
        if query == "fail":
            raise RuntimeError("tool down")
        return {"result": query}

    @rollout_trace_op
    def normalize(self, query: str) -> str:
        return query.lower()

    @rollout_trace_op
    async def run(self, index: int, fail: bool) -> dict[str, Any]:
        await self.generate(f"q{index}")
        try:
            await self.execute("fail" if fail else "ok")
        except RuntimeError:
            pass
        return await self.generate("again")


async def rollout(agent: Agent, step: int, index: int, n: int, reward: float | None, *, fail: bool = False,
                  validate: bool = False) -> str:
    with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, validate=validate, name="agent_loop") as traj:
        await agent.run(index, fail)
        if reward is not None:
            annotate(reward=reward)  # VERL's adapter annotates inside the open trajectory
    return traj.span_id


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def calls_by_trajectory(stub: WeaveStub) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for c in stub.completed_calls():
        out.setdefault(c["attributes"]["tracecar"]["trace_id"], []).append(c)
    return out


def op(call: dict[str, Any]) -> str:
    return call["op_name"].split("/op/")[1].split(":")[0]


def test_tail_kept_trajectories_reach_weave_linked_threaded_and_scored(
        start_collector, tracer_to, weave_stub: WeaveStub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_RUN_ID", "run-abc")  # set in the Ray runtime env: the trainer's wandb.init uses it too
    col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity="team", wandb_project="rl",
                          weave_server_url=weave_stub.url, max_trajectories_per_step=3, keep_spread_groups=0,
                          keep_groups_whole=False, reward_wait_s=0.3, step_idle_s=60, decision_wait_s=120)
    tracer = tracer_to(col.url, experiment="exp-links")
    assert tracer.config.wandb_run_id == "run-abc"
    agent = Agent()

    async def step_one() -> dict[tuple[int, int], str]:
        keys = [(i, n) for i in range(3) for n in range(2)]
        ids = await asyncio.gather(*(rollout(agent, 1, i, n, float(i * 10 + n), fail=(i, n) == (1, 0)) for i, n in keys))
        return dict(zip(keys, ids))

    ids = asyncio.run(step_one())
    asyncio.run(rollout(agent, 2, 0, 0, 1.0))  # the worker moves on: step 1 is decided
    assert tracer.flush(20)
    expected = {ids[(1, 0)]: "error", ids[(2, 1)]: "reward_max", ids[(0, 0)]: "reward_min"}
    got = wait_for(lambda: (c := calls_by_trajectory(weave_stub)) and all(len(c.get(t, ())) == 5 for t in expected) and c)
    assert got and not set(got) & (set(ids.values()) - set(expected))  # dropped ones never reach Weave
    feedback = wait_for(lambda: len(f := [i for r in weave_stub.requests_to("/feedback/batch/create") for i in r.body["batch"]]) >= 3 and f)

    for trace_id, rule in expected.items():
        calls = got[trace_id]
        assert len(calls) == 5  # run, generate ×2, execute, normalize: no call for the trajectory
        (top,) = [c for c in calls if c["parent_id"] is None]
        assert op(top) == "Agent.run" and top["id"] == top["trace_id"]
        assert top["attributes"]["kept_because"] == rule  # where tail sampling decided
        assert all("kept_because" not in c["attributes"] for c in calls if c is not top)
        # linked to the trainer's run at the trajectory's step
        assert {(c["wb_run_id"], c["wb_run_step"]) for c in calls} == {("team/rl/run-abc", 1)}
        # one thread per trajectory, the loop's children its turns, deeper calls in their turn
        by_id = {c["id"]: c for c in calls}
        assert top["thread_id"] is None
        turns = sorted((c for c in calls if c["parent_id"] == top["id"]), key=lambda c: c["started_at"])
        assert [op(c) for c in turns] == ["Agent.generate", "Agent.execute", "Agent.generate"]
        assert all(c["thread_id"] == trace_id and c["turn_id"] == c["id"] for c in turns)
        (inner,) = [c for c in calls if op(c) == "Agent.normalize"]
        assert inner["thread_id"] == trace_id and inner["turn_id"] == inner["parent_id"] == turns[1]["id"]
        assert by_id[inner["parent_id"]]["trace_id"] == inner["trace_id"] == top["id"]
        # the reward, on the call a user looks at
        mine = [f for f in feedback if f["weave_ref"].endswith(top["id"])]
        assert len(mine) == 1 and mine[0]["payload"]["reward"] == float(
            next(i * 10 + n for (i, n), t in ids.items() if t == trace_id))
    assert len(feedback) == 3  # the kept step-1 trajectories (step 2 is still held)
    (failed,) = [c for c in got[ids[(1, 0)]] if op(c) == "Agent.execute"]
    assert failed["exception"] is not None and "tool down" in failed["exception"]
    (top,) = [c for c in got[ids[(1, 0)]] if c["parent_id"] is None]
    assert top["summary"]["status_counts"]["error"] == 1  # descendant_error, as weave rolls it up


def test_run_step_follows_the_trajectory_and_the_collector_knows_a_default_run(
        start_collector, tracer_to, weave_stub: WeaveStub, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_RUN_ID", "TRACECAR_WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity="team", wandb_project="rl",
                          weave_server_url=weave_stub.url, wandb_run_id="team/rl/collector-run")
    tracer = tracer_to(col.url, experiment="exp-links")
    assert tracer.config.wandb_run_id is None
    agent = Agent()

    async def main() -> dict[str, str]:
        return {
            "train": await rollout(agent, 4, 0, 0, None),
            "validation": await rollout(agent, 4, 1, 0, None, validate=True),  # logged at the same step
            "async": await rollout(agent, -1, 2, 0, None),  # fully-async rollouts: no training step
        }

    ids = asyncio.run(main())
    assert tracer.flush(20)
    got = wait_for(lambda: (c := calls_by_trajectory(weave_stub)) and all(len(c.get(t, ())) == 5 for t in ids.values()) and c)
    assert got
    steps = {kind: {(c["wb_run_id"], c["wb_run_step"]) for c in got[t]} for kind, t in ids.items()}
    assert steps == {"train": {("team/rl/collector-run", 4)}, "validation": {("team/rl/collector-run", 4)},
                     "async": {("team/rl/collector-run", None)}}
    assert 'tracecar_spans_dead_lettered_total{exporter="weave"} 0.0' in httpx.get(col.url + "/metrics").text


def test_an_offline_wandb_run_in_the_process_is_found(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the workers share the trainer's process, the VERL adapter reads ``wandb.run``."""
    wandb = pytest.importorskip("wandb")
    from tracecar.client import verl as tv

    for name in ("WANDB_RUN_ID", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert tv._current_wandb_run_id() is None
    run = wandb.init(mode="offline", project="rl", dir=str(tmp_path))
    try:
        found = tv._current_wandb_run_id()
        assert found is not None and found.rsplit("/", 1)[-1] == run.id
    finally:
        run.finish()
    assert tv._current_wandb_run_id() is None


def test_a_bad_run_id_is_ignored_with_a_warning_not_the_batch(start_collector) -> None:
    col = start_collector()
    span = {"span_id": "s1", "trace_id": "s1", "parent_id": None, "name": "op", "kind": "op",
            "start_time": 1.0, "end_time": 2.0, "attributes": {}, "inputs": {}, "output": None, "exception": None}
    r = httpx.post(col.url + "/v1/spans", json={"v": 1, "worker": "w", "wandb_run_id": "two words", "spans": [span]})
    body = r.json()
    assert r.status_code == 200 and body["accepted"] == 1, body
    assert body["warnings"]["s1"] == ["wandb_run_id: ignored, expected a W&B run id or entity/project/run_id "
                                      "(at most 256 characters, no spaces), got a string of 9 characters"]
    assert 'tracecar_span_warnings_total{kind="wandb_run_id"} 1.0' in httpx.get(col.url + "/metrics").text
    stored = httpx.get(col.url + "/v1/trajectories/s1").json()["root"]
    assert "wandb_run_id" not in stored
