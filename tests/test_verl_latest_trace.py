"""The VERL adapter against VERL's newest ``verl/utils/rollout_trace.py`` (the one with ``trackio``).

tests/test_verl_adapter.py runs the adapter against the released verl 0.9.1 wheel. This test
loads the newest module's source (verl-project/verl, see tests/fixtures/verl_latest/SOURCE.md; or
the checkout named by ``TRACECAR_VERL_SOURCE``) as ``verl.utils.rollout_trace``, with the one
import it needs from the rest of VERL (``verl.utils.ray_utils.get_event_loop``) stubbed. The agent
loop code around it is a small stand-in with the newest VERL's shapes: ``AgentLoopWorker``'s
``generate_sequences`` (index column, ``global_steps`` / ``validate`` meta, ``trace=`` per sample,
``rollout_trace_attr(..., name="agent_loop")``), ``_compute_score(outputs, kwargs=...)`` writing
``reward_score``, ``ToolAgentLoop.run`` / ``LLMServerClient.generate`` / ``BaseTool.execute``
decorated with VERL's own ``rollout_trace_op`` at import time, and the fully-async
``max_global_steps`` output column. Spans go over HTTP to a real collector on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from tracecar.collector.processors.sampling import sample_hash

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).parent / "fixtures" / "verl_latest" / "rollout_trace.py"
EXPERIMENT, PROJECT = "exp-latest", "proj-latest"


def rollout_trace_source() -> Path:
    given = os.environ.get("TRACECAR_VERL_SOURCE")
    if not given:
        return FIXTURE
    path = Path(given)
    return path / "verl" / "utils" / "rollout_trace.py" if path.is_dir() else path


# The stand-in for verl/experimental/agent_loop/agent_loop.py (+ llm_server.py, tools): the shapes
# the adapter relies on, as in the newest VERL; everything tracing-related is VERL's own module.
AGENT_LOOP_SOURCE = '''
import asyncio
import uuid
from typing import Any, Optional

from pydantic import BaseModel

from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op


class DataProto:
    def __init__(self, non_tensor_batch: dict, meta_info: dict) -> None:
        self.non_tensor_batch, self.meta_info = non_tensor_batch, meta_info

    def __len__(self) -> int:
        return len(next(iter(self.non_tensor_batch.values())))


class TokenOutput(BaseModel):
    token_ids: list[int]
    extra_fields: dict[str, Any] = {}


class AgentLoopOutput(BaseModel):
    prompt_ids: list[int]
    response_ids: list[int]
    num_turns: int = 0
    reward_score: Optional[float] = None
    extra_fields: dict[str, Any] = {}


class LLMServerClient:
    def __init__(self) -> None:
        self.global_steps = None  # what the rollout server reports (set on weight sync in fully-async)

    @rollout_trace_op
    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:
        await asyncio.sleep(0)
        return TokenOutput(token_ids=prompt_ids[::-1], extra_fields={"global_steps": self.global_steps})


class BaseTool:
    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple:
        if parameters.get("fail"):
            raise ValueError("tool failed")
        return ("ok", 0.0, {})


class ToolAgentLoop:
    def __init__(self, server_manager: LLMServerClient, tool: BaseTool) -> None:
        self.server_manager, self.tool = server_manager, tool

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        out = await self.server_manager.generate(uuid.uuid4().hex, prompt_ids=[1, 2, 3], sampling_params=sampling_params)
        try:
            await self.tool.execute("t", {"fail": kwargs.get("fail", False)})
        except ValueError:
            pass
        version = out.extra_fields.get("global_steps")
        return AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=out.token_ids, num_turns=2,
                               extra_fields={"min_global_steps": version, "max_global_steps": version})


class AgentLoopWorker:
    def __init__(self, trace: dict[str, Any]) -> None:
        self.llm_client, self.tool = LLMServerClient(), BaseTool()
        RolloutTraceConfig.init(trace["project_name"], trace["experiment_name"], trace.get("backend"),
                                trace.get("token2text", False), trace.get("max_samples_per_step_per_worker", None))

    async def generate_sequences(self, batch: DataProto) -> DataProto:
        validate = batch.meta_info.get("validate", False)
        index = batch.non_tensor_batch.get("index", list(range(len(batch))))
        max_samples_per_worker = RolloutTraceConfig.get_instance().max_samples_per_step_per_worker
        if max_samples_per_worker is not None:
            unique = sorted(set(index), key=str)
            selected = set(unique[:max_samples_per_worker])  # VERL draws with np.random.choice
            traced_indices = set(i for i in range(len(batch)) if index[i] in selected)
        else:
            traced_indices = set(range(len(batch)))
        trajectory_info = await get_trajectory_info(batch.meta_info.get("global_steps", -1), list(index), validate)
        tasks = []
        for i in range(len(batch)):
            kwargs = {k: v[i] for k, v in batch.non_tensor_batch.items()}
            tasks.append(asyncio.create_task(
                self._run_agent_loop({"temperature": 1.0}, trajectory_info[i], trace=i in traced_indices, **kwargs)))
        outputs = await asyncio.gather(*tasks)
        return DataProto({"max_global_steps": [o.extra_fields.get("max_global_steps") for o in outputs]}, {})

    async def _run_agent_loop(self, sampling_params, trajectory, *, trace: bool = True, **kwargs) -> AgentLoopOutput:
        with rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                rollout_n=trajectory["rollout_n"], validate=trajectory["validate"],
                                name="agent_loop", trace=trace):
            output = await ToolAgentLoop(self.llm_client, self.tool).run(sampling_params, **kwargs)
            await self._compute_score([output], kwargs=kwargs)
            return output

    async def _compute_score(self, outputs, kwargs: dict) -> None:
        outputs[-1].reward_score = 0.5 if kwargs.get("fail") else 1.0


async def get_trajectory_info(step, index, validate):
    trajectory_info, rollout_n = [], 0
    for i in range(len(index)):
        rollout_n = rollout_n + 1 if i > 0 and index[i - 1] == index[i] else 0
        trajectory_info.append({"step": step, "sample_index": index[i], "rollout_n": rollout_n, "validate": validate})
    return trajectory_info
'''


@pytest.fixture
def verl_latest(monkeypatch: pytest.MonkeyPatch) -> Any:
    """(rollout_trace module, agent_loop stand-in, adapter) loaded under VERL's module names."""
    source = rollout_trace_source()
    if not source.is_file():
        pytest.skip(f"VERL's newest rollout_trace.py not found at {source}: set TRACECAR_VERL_SOURCE to a "
                    "verl-project/verl checkout (or restore tests/fixtures/verl_latest/)")
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test (a real verl may be loaded)

    def package(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)
        return module

    for name in ("verl", "verl.utils", "verl.experimental", "verl.experimental.agent_loop"):
        package(name)
    ray_utils = types.ModuleType("verl.utils.ray_utils")

    def get_event_loop() -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.new_event_loop()

    ray_utils.get_event_loop = get_event_loop  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verl.utils.ray_utils", ray_utils)
    spec = importlib.util.spec_from_file_location("verl.utils.rollout_trace", source)
    assert spec is not None and spec.loader is not None
    rt = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "verl.utils.rollout_trace", rt)
    spec.loader.exec_module(rt)
    agent_loop = types.ModuleType("verl.experimental.agent_loop.agent_loop")
    monkeypatch.setitem(sys.modules, agent_loop.__name__, agent_loop)
    exec(compile(AGENT_LOOP_SOURCE, "<verl agent_loop stand-in>", "exec"), agent_loop.__dict__)

    from tracecar.client import tracer as tracer_module
    from tracecar.client import verl as adapter

    adapter.uninstall()
    rt.RolloutTraceConfig.reset()
    yield rt, agent_loop, adapter
    adapter.uninstall()
    rt.RolloutTraceConfig.reset()
    tracer_module.shutdown(5)


def trace_config(backend: str = "tracecar", max_samples: int | None = None) -> dict[str, Any]:
    return {"project_name": PROJECT, "experiment_name": EXPERIMENT, "backend": backend, "token2text": True,
            "max_samples_per_step_per_worker": max_samples}


def roots(url: str, **params: Any) -> list[dict[str, Any]]:
    page = httpx.get(url + "/v1/trajectories", params={"limit": 1000, **params}).json()
    return page["trajectories"]


def flush() -> None:
    from tracecar.client import tracer as tracer_module

    tracer = tracer_module.get_tracer()
    assert tracer and tracer.flush(30)


def test_the_fetched_module_is_the_newest_shape(verl_latest):
    rt, _, _ = verl_latest
    source = Path(rt.__file__).read_text()
    assert 'backend == "trackio"' in source and "_add_token2text" in source
    assert {"init", "get_backend", "reset"} <= set(vars(rt.RolloutTraceConfig))


def test_adapter_routes_the_newest_verl_module_to_the_collector(verl_latest, start_collector, monkeypatch):
    rt, al, adapter = verl_latest
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    monkeypatch.setenv("TRACECAR_WORKER_ID", "agent-loop-worker-0")
    assert adapter.install() is True
    worker = al.AgentLoopWorker(trace_config(max_samples=2))
    assert adapter.is_active() and rt.RolloutTraceConfig.get_backend() == "tracecar"
    # the budget went to the collector; VERL traces every sample (its own pre-selection is off)
    assert rt.RolloutTraceConfig.get_instance().max_samples_per_step_per_worker is None

    uuids = [f"u-{i:02d}-5f0e" for i in range(4)]
    train = al.DataProto({"index": [u for u in uuids for _ in range(2)], "fail": [False, True] * 4},
                         {"global_steps": 6})
    asyncio.run(worker.generate_sequences(train))
    val = al.DataProto({"index": [0, 1, 2]}, {"global_steps": 6, "validate": True})
    asyncio.run(worker.generate_sequences(val))
    flush()

    kept = roots(col.url, step=6, validate=False)
    expected = set(sorted(uuids, key=lambda u: sample_hash(0, EXPERIMENT, 6, u))[:2])
    assert {t["sample_index"] for t in kept} == expected  # the seeded choice over the announced list
    assert sorted((t["sample_index"], t["rollout_n"]) for t in kept) == sorted((u, n) for u in expected for n in (0, 1))
    for summary in kept:
        tree = httpx.get(col.url + f"/v1/trajectories/{summary['trace_id']}").json()
        root = tree["root"]
        assert root["attributes"] == {"sample_index": summary["sample_index"], "step": 6,
                                      "rollout_n": summary["rollout_n"], "validate": False, "experiment_name": EXPERIMENT}
        [run] = root["children"]
        assert run["name"] == "ToolAgentLoop.run"
        names = sorted(c["name"] for c in run["children"])
        assert names == ["BaseTool.execute", "LLMServerClient.generate"]
        execute = next(c for c in run["children"] if c["name"] == "BaseTool.execute")
        assert (execute["exception"] is not None) == (summary["rollout_n"] == 1)  # the failing tool of rollout 1
        assert [a["attributes"]["reward"] for a in tree["annotations"]] == [0.5 if summary["rollout_n"] == 1 else 1.0]
    val_kept = {t["sample_index"] for t in roots(col.url, step=6, validate=True)}
    assert val_kept == set(sorted(range(3), key=lambda i: sample_hash(0, EXPERIMENT, 6, i))[:2])  # budgeted apart
    metrics = httpx.get(col.url + "/metrics").text
    assert "tracecar_memberships_received_total 2.0" in metrics  # the training call and the validation call


def test_fully_async_rollouts_carry_the_policy_version(verl_latest, start_collector, monkeypatch):
    rt, al, adapter = verl_latest
    col = start_collector(max_samples_per_step_per_worker=1)
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker = al.AgentLoopWorker(trace_config())
    versions_seen = []
    for version, sample in ((3, "a"), (3, "b"), (4, "c"), (4, "d"), (4, "e")):
        worker.llm_client.global_steps = version  # the rollout server's weights (fully-async: step -1)
        batch = al.DataProto({"index": [sample, sample]}, {})  # one sample, rollout_n 2, no global_steps
        asyncio.run(worker.generate_sequences(batch))
        versions_seen.append(adapter._state.policy_version)
    flush()
    assert versions_seen == [3, 3, 4, 4, 4]
    trees = [httpx.get(col.url + f"/v1/trajectories/{t['trace_id']}").json() for t in roots(col.url, step=-1)]
    by_version: dict[Any, set] = {}
    for tree in trees:
        attrs = tree["root"]["attributes"]
        by_version.setdefault(attrs.get("policy_version"), set()).add(attrs["sample_index"])
    # A trajectory is stamped with the newest version the worker's finished calls reported when it
    # starts: the first call ran before any was known; "c" started before a call reported 4.
    # Then one sample per version and worker.
    assert by_version == {None: {"a"}, 3: {"b"}, 4: {"d"}}
    assert "tracecar_memberships_received_total 0.0" in httpx.get(col.url + "/metrics").text


def test_trace_false_and_the_trackio_backend_are_left_to_verl(verl_latest, start_collector, monkeypatch):
    rt, al, adapter = verl_latest
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    logged: list[Any] = []
    trackio = types.ModuleType("trackio")
    context_vars = types.ModuleType("trackio.context_vars")

    class _Run:
        def get(self) -> Any:
            return object()  # a run is already open: VERL does not call trackio.init

    context_vars.current_run = _Run()  # type: ignore[attr-defined]
    trackio.context_vars = context_vars  # type: ignore[attr-defined]
    trackio.Trace = lambda messages, metadata: {"messages": messages, "metadata": metadata}  # type: ignore[attr-defined]
    trackio.log = lambda data, step=None: logged.append((data, step))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    monkeypatch.setitem(sys.modules, "trackio.context_vars", context_vars)

    adapter.install()
    worker = al.AgentLoopWorker(trace_config(backend="trackio"))
    assert not adapter.is_active() and rt.RolloutTraceConfig.get_backend() == "trackio"
    asyncio.run(worker.generate_sequences(al.DataProto({"index": [7]}, {"global_steps": 2})))
    keys = sorted({key for data, _ in logged for key in data})
    assert keys == ["rollout_trace/BaseTool.execute", "rollout_trace/LLMServerClient.generate",
                    "rollout_trace/ToolAgentLoop.run"]
    assert {step for _, step in logged} == {2}
    assert roots(col.url) == []  # tracecar took nothing

    # and with backend=tracecar, VERL's trace=False samples are never sent
    rt.RolloutTraceConfig.reset()
    worker = al.AgentLoopWorker(trace_config(max_samples=None))
    assert adapter.is_active()

    async def untraced() -> None:
        with rt.rollout_trace_attr(sample_index=1, step=2, trace=False):
            await al.ToolAgentLoop(worker.llm_client, worker.tool).run({})

    asyncio.run(untraced())
    flush()
    assert roots(col.url) == []
