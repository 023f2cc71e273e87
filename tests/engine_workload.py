"""A VERL-shaped rollout with vLLM-shaped engine spans from several worker processes, for the exporter tests.

``run_workers(url, n)`` starts ``n`` real processes (``python -m tests.engine_workload``), each the
real tracecar client (configured as VERL's adapter would: a project, an experiment, its worker id)
plus a vLLM-shaped engine (opentelemetry-sdk with vLLM's span name, kind, resource and
``gen_ai.*`` attribute names, parented with ``trace_headers()``) exporting to the collector's
``/v1/traces``. Every process counts its spans from 1 under its own random prefix, so the same
counters recur in every process (what collided in Phoenix). Projects alternate between
processes (``proj-a``, ``proj-b``), so each exporter must file every trajectory under its own.

Each process runs ``TRAJECTORIES`` trajectories concurrently, each with ``SPANS_PER_TRAJECTORY``
spans: ``agent_loop`` → ``ToolAgentLoop.run`` → two ``LLMServerClient.generate`` turns (each
causing one ``llm_request``; their decoded prompts are the chat so far in Qwen's template, the
first answer a Hermes tool call), ``HermesToolParser.extract_tool_calls``, ``SearchTool.execute``
(a tool call, with its helper ``SearchTool.lookup``) and ``ToolAgentLoop.format_tool_response``
(a helper whose name contains "tool"). In even trajectories the first engine span is exported
and answered while its ``generate`` still runs and the client has sent nothing of the
trajectory (open markers off): it reaches the collector first. The last trajectory's second
turn raises (an LLM call that failed; its engine span has an ERROR status). Writes a manifest:
per trajectory its trace id, project, worker and whether its engine span went first.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tracecar.client import rollout_trace_op, trace_headers

PROJECTS = ("proj-a", "proj-b")
EXPERIMENT = "engine-multi"
TRAJECTORIES = 4
SPANS_PER_TRAJECTORY = 10  # agent_loop, run, 2 generate, 2 llm_request, parser, execute, lookup, format_tool_response
ENGINE_SPANS_PER_TRAJECTORY = 2
TOOL_CALLS_PER_TRAJECTORY = 1
ROOT = Path(__file__).resolve().parents[1]
# each turn's decoded prompt as Qwen's chat template renders it (VERL decodes what the model read)
TOOL_CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "four"}}\n</tool_call>'
FIRST_PROMPT = "<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
SECOND_PROMPT = (FIRST_PROMPT + TOOL_CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\nfour-0, four-1\n"
                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def project_of(k: int) -> str:
    return PROJECTS[k % len(PROJECTS)]


def run_workers(url: str, n: int, work: Path, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Runs ``n`` worker processes against the collector at ``url``; returns every trajectory's manifest entry."""
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACECAR_", "WANDB_", "OTEL_"))}
    procs = []
    for k in range(n):
        path = work / f"manifest-{k}.json"
        procs.append((path, subprocess.Popen([sys.executable, "-m", "tests.engine_workload", url, str(k), str(path)],
                                             cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)))
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    for path, proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"worker timed out: {err[-3000:]}") from None
        assert proc.returncode == 0, err[-3000:]
        out.extend(json.loads(path.read_text()))
    assert len(out) == n * TRAJECTORIES
    assert len({t["trace_id"] for t in out}) == len(out)
    return out


class _Run:
    """This process's engine and worker number (the traced classes below are VERL's names, at module level)."""

    engine: Any = None
    k = 0


class LLMServerClient:
    @rollout_trace_op
    async def generate(self, request_id: str, prompt_ids: list[int], first: bool = False, fail: bool = False) -> dict[str, Any]:
        error = RuntimeError("engine dead") if fail else None
        _Run.engine.request(trace_headers(), request_id, len(prompt_ids), 3, arrival=time.time(), error=error)
        if first:
            _Run.engine.flush()  # answered by the collector before this call returns: the trajectory's first span
        await asyncio.sleep(0.01)
        if fail:
            raise RuntimeError("engine dead")
        second = len(prompt_ids) > 4
        return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9], "prompt_text": SECOND_PROMPT if second else FIRST_PROMPT,
                "response_text": "4<|im_end|>" if second else TOOL_CALL + "<|im_end|>"}


class HermesToolParser:
    @rollout_trace_op
    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[list[dict[str, Any]], str]:
        return [{"name": "search", "arguments": {"q": "four"}}], "calling search"


class SearchTool:
    @rollout_trace_op
    def lookup(self, query: str, limit: int = 2) -> list[str]:
        return [f"{query}-{i}" for i in range(limit)]

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict[str, Any]]:
        return ", ".join(self.lookup(parameters["q"])), 0.0, {}


class ToolAgentLoop:
    @rollout_trace_op
    def format_tool_response(self, text: str) -> str:
        return f"<tool_response>{text}</tool_response>"

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], i: int, **kwargs: Any) -> dict[str, Any]:
        server, k = LLMServerClient(), _Run.k
        first = await server.generate(f"req-{k}-{i}-0", [1, 2, 3, 4], first=i % 2 == 0)
        calls, _ = await HermesToolParser().extract_tool_calls(first["response_ids"])
        text, _, _ = await SearchTool().execute(f"tool-{i}", calls[0]["arguments"])
        self.format_tool_response(text)
        try:
            await server.generate(f"req-{k}-{i}-1", [1, 2, 3, 4, 7, 8, 9, 5], fail=i == TRAJECTORIES - 1)
        except RuntimeError:
            pass
        return {"prompt_ids": [1, 2, 3, 4], "response_ids": [7, 8, 9, 5, 7, 8, 9], "num_turns": 3}


async def _worker(url: str, k: int) -> list[dict[str, Any]]:
    from tests.test_otlp_receiver import VllmEngine
    from tracecar.client import annotate, rollout_trace_attr
    from tracecar.client import tracer as tracer_module
    from tracecar.client.config import ClientConfig

    tracer = tracer_module.configure(ClientConfig(url=url, project=project_of(k), experiment=EXPERIMENT,
                                                  worker_id=f"worker-{k}", open_markers=False, flush_interval_s=0.3))
    _Run.engine, _Run.k = VllmEngine(url + "/v1/traces"), k
    engine = _Run.engine

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(0.02 * i)
        with rollout_trace_attr(sample_index=k * 10 + i, step=1, rollout_n=0, name="agent_loop") as root:
            await ToolAgentLoop().run({"temperature": 0.7}, i, raw_prompt=[{"role": "user", "content": "2+2?"}])
            annotate(reward=float(i))
        return {"trace_id": root.span_id, "project": project_of(k), "worker": f"worker-{k}", "sample_index": k * 10 + i,
                "engine_first": i % 2 == 0,
                "failed_turn": i == TRAJECTORIES - 1, "reward": float(i)}

    manifest = list(await asyncio.gather(*(one(i) for i in range(TRAJECTORIES))))
    assert tracer.flush(30), "spans not delivered"
    engine.flush()
    engine.close()
    tracer_module.shutdown(10)
    return manifest


if __name__ == "__main__":
    entries = asyncio.run(_worker(sys.argv[1], int(sys.argv[2])))
    Path(sys.argv[3]).write_text(json.dumps(entries))


def collector_process(work: Path, **settings: Any) -> Any:
    """A collector process (``python -m tracecar.collector``) on 127.0.0.1 with ``settings``; the
    caller stops it (``.terminate()``): module-scoped fixtures share one per server."""
    from tests.support import free_port
    from tests.support.collector import ProcessCollector, collector_env

    port = free_port()
    return ProcessCollector(url=f"http://127.0.0.1:{port}",
                            env=collector_env(port, work, log_level="warning", **settings)).start()


def wait_delivered(url: str, spans: int, timeout_s: float = 120) -> None:
    """Waits until the collector at ``url`` has forwarded ``spans`` spans and owes nothing."""
    from tests.support.collector import scrape_metric

    deadline = time.monotonic() + timeout_s
    while True:
        forwarded = scrape_metric(url, "tracecar_spans_forwarded_total")
        pending = scrape_metric(url, "tracecar_spool_depth")
        waiting = scrape_metric(url, "tracecar_otlp_held_spans_waiting")
        if forwarded >= spans and pending == 0 and waiting == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"forwarded {forwarded} of {spans}, {pending} pending, {waiting} waiting")
        time.sleep(0.2)


def assert_engine_spans_came_first(url: str) -> None:
    """The workload's point: some engine spans reached the collector before their trajectory, were
    held, and all of them joined it (none sent to a default destination)."""
    from tests.support.collector import scrape_metric

    held = scrape_metric(url, "tracecar_otlp_held_spans_total", outcome="held")
    joined = scrape_metric(url, "tracecar_otlp_held_spans_total", outcome="joined")
    released = sum(scrape_metric(url, "tracecar_otlp_held_spans_total", outcome=o) for o in ("expired", "overflow", "foreign"))
    assert held > 0, "no engine span arrived before its trajectory: the run did not test what it is for"
    assert joined == held and released == 0, (held, joined, released)
