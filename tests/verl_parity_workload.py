"""The VERL workload the parity harnesses run twice: once traced by one of VERL's own backends,
once by tracecar (``trace.backend=tracecar``), then diffed as the backend's server shows them.

VERL's own, unmodified agent-loop code (``AgentLoopWorker`` -> ``ToolAgentLoop`` /
``SingleTurnAgentLoop`` -> ``LLMServerClient``, the Hermes tool parser and ``BaseTool`` tools): tool
calls, a failing tool, nested sync and async ops, typed outputs, a secret in the tools' kwargs, a
validation batch. Used by tests/test_weave_parity.py and tests/test_mlflow_parity.py; needs the real
``verl`` (``.venv-verl``). Each harness runs it in ``PROCESSES`` worker processes at once
(:func:`run_processes`; ``python -m tests.verl_parity_workload BACKEND PROJECT MODEL_DIR K``), as
a VERL job's AgentLoopWorkers are, each with its own dataset indices, for VERL's backend and for
tracecar alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op  # VERL's, as a user's tool would

from tests.test_verl_adapter import FakeLoadBalancer, _Remote

SECRET = "sk-parity-secret-0123456789"
STEP = 7
PROMPTS = 3  # dataset prompts per batch (each n=2 rollouts), per worker process
PROCESSES = 3  # worker processes each harness runs, for VERL's backend and for tracecar alike

TOOL_CALLS = (
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    '<tool_call>{"name": "search", "arguments": {"query": "weave"}}</tool_call>'
    '<tool_call>{"name": "explode", "arguments": {"why": "always"}}</tool_call><|im_end|>'
)
ANSWER = "The answer is 5.<|im_end|>"


# ---------------------------------------------------------------------------------------------
# the workload: VERL's agent loops with three tools, one failing, one with nested sync/async ops
# ---------------------------------------------------------------------------------------------


class FakeServer:
    """A rollout server: three tool calls first (when tools are offered), then the answer."""

    def __init__(self, tokenizer: Any) -> None:
        async def generate(*, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
            from verl.workers.rollout.replica import TokenOutput

            text = tokenizer.decode(prompt_ids)
            out = TOOL_CALLS if ("Tools:" in text and "<|im_start|>tool" not in text) else ANSWER
            return TokenOutput(token_ids=tokenizer.encode(out, add_special_tokens=False), extra_fields={})

        self.generate = _Remote(generate)


def _schema(name: str, **props: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": list(props)}}})


class AddTool(BaseTool):
    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text=str(parameters["a"] + parameters["b"])), 1.0, {"op": "add"}


class SearchTool(BaseTool):
    """Nested ops: an async op calling a sync op and another async op."""

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        hits = self.lookup(parameters["query"], limit=2)
        ranked = await self.rank(hits)
        return ToolResponse(text=", ".join(ranked)), 0.5, {"hits": len(hits)}

    @rollout_trace_op
    def lookup(self, query: str, limit: int = 10, exact: bool = False) -> list[str]:
        return [f"{query}-{i}" for i in range(limit)]

    @rollout_trace_op
    async def rank(self, hits: list[str]) -> list[str]:
        return sorted(hits, reverse=True)


class ExplodeTool(BaseTool):
    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        raise RuntimeError(f"tool exploded: {parameters['why']}")


def make_worker(config: Any, tokenizer: Any) -> Any:
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient

    client = LLMServerClient(config, load_balancer_handle=FakeLoadBalancer(FakeServer(tokenizer)))
    worker = AgentLoopWorker(config, client)  # calls RolloutTraceConfig.init(...) itself
    worker.tools = [AddTool(config={}, tool_schema=_schema("add", a="integer", b="integer")),
                    SearchTool(config={}, tool_schema=_schema("search", query="string")),
                    ExplodeTool(config={}, tool_schema=_schema("explode", why="string"))]
    return worker


def make_batch(validate: bool, process: int = 0) -> Any:
    """Three prompts (two with tools, one without), n=2 rollouts each, interleaved as VERL does;
    worker process ``process`` takes the dataset indices ``3 * process`` … ``3 * process + 2``."""
    from verl.protocol import DataProto

    tool_prompt = [{"role": "user", "content": "What is 2+3? 数字 🙂"}]
    plain_prompt = [{"role": "user", "content": "Say hi"}]
    search_prompt = [{"role": "user", "content": "Search weave"}]
    agents = ["tool_agent", "tool_agent", "tool_agent", "tool_agent", "single_turn_agent", "single_turn_agent"]
    raw = [tool_prompt, tool_prompt, search_prompt, search_prompt, plain_prompt, plain_prompt]
    tools_kwargs = {"search": {"create_kwargs": {"api_key": SECRET}}}  # a secret the tool is created with
    return DataProto(
        non_tensor_batch={
            "raw_prompt": np.array(raw, dtype=object),
            "agent_name": np.array(agents, dtype=object),
            "index": np.array([0, 0, 1, 1, 2, 2]) + PROMPTS * process,
            "tools_kwargs": np.array([tools_kwargs] * 6, dtype=object),
        },
        meta_info={"global_steps": STEP, "validate": validate},
    )


def run_workload(config: Any, tokenizer: Any, process: int = 0) -> None:
    config.actor_rollout_ref.rollout.prompt_length = 4096  # the tool schemas, byte by byte
    config.actor_rollout_ref.rollout.multi_turn.max_parallel_calls = 3  # all three tool calls of a turn
    worker = make_worker(config, tokenizer)
    for validate in (False, True):
        asyncio.run(worker.generate_sequences(make_batch(validate, process)))


# ---------------------------------------------------------------------------------------------
# many worker processes: a real VERL job's AgentLoopWorkers are Ray actors, one process each
# ---------------------------------------------------------------------------------------------


def run_processes(backend: str, project: str, model_dir: Path, env: dict[str, str | None], n: int = PROCESSES,
                  timeout_s: float = 300) -> list[dict[str, Any]]:
    """Runs the workload in ``n`` worker processes at once (``python -m tests.verl_parity_workload``),
    each VERL's own ``AgentLoopWorker`` tracing with ``trace.backend=backend`` into ``project``, with
    its own dataset indices; ``env`` is set (None: unset) on top of this process's environment.
    Returns each process's report (for tracecar: its client's stats)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TRACECAR_")}
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.verl_parity_workload", backend, project, str(model_dir), str(k)],
                              cwd=root, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(n)]
    reports, deadline = [], time.monotonic() + timeout_s
    try:
        for k, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise AssertionError(f"{backend} worker process {k} timed out:\n{err[-4000:]}") from None
            assert proc.returncode == 0, f"{backend} worker process {k} failed:\n{err[-4000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert sorted(r["process"] for r in reports) == list(range(n)) and len({r["pid"] for r in reports}) == n
    return reports


def _worker_main(backend: str, project: str, model_dir: Path, process: int) -> dict[str, Any]:
    """One worker process: VERL's agent loops traced by ``backend``, flushed before it exits."""
    from transformers import AutoTokenizer
    from verl.utils import rollout_trace as verl_rt

    from tests.test_verl_adapter import verl_config

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = verl_config(model_dir, backend=backend)
    config.trainer.project_name = project  # trace.project_name follows it
    report: dict[str, Any] = {"process": process, "pid": os.getpid()}
    if backend == "tracecar":
        import tracecar.client.verl as tv
        from tracecar.client import get_tracer, tracer

        assert tv.install()
        run_workload(config, tokenizer, process)
        active = get_tracer()
        assert active and active.flush(60), "tracecar did not deliver"
        report["client"] = active.stats()
        tracer.shutdown(5)
    elif backend == "weave":
        import weave

        run_workload(config, tokenizer, process)
        client = verl_rt.RolloutTraceConfig.get_client()
        assert client is not None, "VERL did not initialise weave"
        client.flush()
        weave.finish()
        from opentelemetry import trace as otel  # weave.init installs a global OTel provider: flush it

        provider = otel.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()
    else:
        import mlflow

        run_workload(config, tokenizer, process)
        assert verl_rt.RolloutTraceConfig.get_client() is mlflow, "VERL did not initialise mlflow"
    return report


if __name__ == "__main__":
    print(json.dumps(_worker_main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))), flush=True)


class Env:
    """Sets environment variables for a block, restoring them after."""

    def __init__(self, **values: str | None) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_collector(data_dir: Path, **settings: Any) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    from tests.support import free_port, wait_ready
    from tracecar.collector.service.app import create_app
    from tracecar.collector.service.server import _DrainingServer
    from tracecar.collector.settings import CollectorSettings

    port = free_port()
    s = CollectorSettings(host="127.0.0.1", port=port, data_dir=data_dir, **settings)
    app = create_app(s)
    server = _DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                            lifespan="on"), app.state.collector, 0.0)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    return url, server, thread


_UUID = re.compile(r"^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
TIMING_KEYS = frozenset({"generate_sequences", "tool_calls"})  # AgentLoopMetrics: seconds, differ run to run


def normalized(value: Any, key: str | None = None) -> Any:
    """A value with what differs from run to run blanked: ids VERL draws (request and tool
    instance uuids), object addresses in reprs, measured durations."""
    if isinstance(value, dict):
        return {k: normalized(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, str):
        return "<id>" if _UUID.match(value) else _ADDRESS.sub(" at 0x…", value)
    if isinstance(value, float) and key in TIMING_KEYS:
        return "<seconds>"
    return value



def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Readable differences between two JSON-like values (first few per branch)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in VERL's" for k in a if k not in b] + [f"{path}.{k}: only in tracecar's" for k in b if k not in a]
        if list(k for k in a if k in b) != list(k for k in b if k in a):
            out.append(f"{path}: key order {list(a)} vs {list(b)}")
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:200]!r} vs {str(b)[:200]!r}"]
