"""MLflow out, against a real ``mlflow server`` (SQLite backend) started on 127.0.0.1.

One shared workload for the module (tests/engine_workload.py): three worker processes, each the
real client plus a vLLM-shaped engine exporting ``llm_request`` spans (some before anything of
their trajectory), into one collector process with ``backend=mlflow`` (typed span types; no
experiment configured, so each trajectory goes to the experiment its project names, as VERL's
``mlflow.set_experiment(project_name)``). Read back with MLflow's own client
(``mlflow.search_traces`` / ``get_trace``) in MLflow's venv (``TRACECAR_MLFLOW_SERVER_PYTHON``,
made by tests/run.sh under ``TRACECAR_TEST_OTLP_SERVERS=1``). VERL's own view (every span
``UNKNOWN``) is tests/test_mlflow_parity.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests import engine_workload as workload
from tests.mlflow_kit import have_mlflow
from tests.mlflow_kit import mlflow_server as start_mlflow_server
from tests.mlflow_kit import read_back as _read_back

WORKERS = 3
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not have_mlflow(),
                       reason="needs MLflow's venv: TRACECAR_MLFLOW_SERVER_PYTHON (tests/run.sh makes .venv-mlflow "
                              "with TRACECAR_TEST_OTLP_SERVERS=1)"),
]
TYPES = {"agent_loop": "AGENT", "ToolAgentLoop.run": "AGENT", "LLMServerClient.generate": "LLM",
         "SearchTool.execute": "TOOL", "SearchTool.lookup": "UNKNOWN", "ToolAgentLoop.format_tool_response": "UNKNOWN",
         "HermesToolParser.extract_tool_calls": "UNKNOWN", "llm_request": "UNKNOWN"}


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Any:
    """A real ``mlflow server`` for one test (tests/test_all_backends.py stops and starts its own)."""
    with start_mlflow_server(tmp_path / "mlflow") as url:
        yield url


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An MLflow server, a collector exporting to it, and three worker processes' rollouts, read back per experiment."""
    work = tmp_path_factory.mktemp("mlflow-run")
    with start_mlflow_server(work / "mlflow") as url:
        col = workload.collector_process(work / "collector", backend="mlflow", mlflow_tracking_uri=url,
                                         mlflow_span_types="typed")
        try:
            manifest = workload.run_workers(col.url, WORKERS, work / "workers")
            workload.wait_delivered(col.url, len(manifest) * workload.SPANS_PER_TRAJECTORY)
            workload.assert_engine_spans_came_first(col.url)
        finally:
            col.terminate()
        deadline = time.monotonic() + 90
        while True:
            experiments = {name: _read_back(url, name) for name in (*workload.PROJECTS, "tracecar", "Default")}
            spans = sum(len(t["spans"]) for traces in experiments.values() for t in traces)
            if spans >= len(manifest) * workload.SPANS_PER_TRAJECTORY or time.monotonic() > deadline:
                break
            time.sleep(1)
        yield {"manifest": manifest, "experiments": experiments}


def test_every_trajectory_of_every_worker_process_is_whole_in_its_projects_experiment(mlflow_run):
    manifest, experiments = mlflow_run["manifest"], mlflow_run["experiments"]
    assert experiments["tracecar"] == [] and experiments["Default"] == []  # nothing misfiled, engine spans first included
    for project in workload.PROJECTS:
        traces = experiments[project]
        mine = {t["trace_id"]: t for t in manifest if t["project"] == project}
        assert len(traces) == len(mine)
        for trace in traces:
            [trace_id] = [t for t in mine if t in trace["trace_id"]]  # MLflow's id holds the OTLP trace id
            spans = trace["spans"]
            assert len(spans) == workload.SPANS_PER_TRAJECTORY, [s["name"] for s in spans]
            by_id = {s["span_id"]: s for s in spans}
            assert len(by_id) == len(spans)
            assert all(s["parent_id"] is None or s["parent_id"] in by_id for s in spans)  # no orphans
            engines = [s for s in spans if s["name"] == "llm_request"]
            assert len(engines) == workload.ENGINE_SPANS_PER_TRAJECTORY
            assert all(by_id[e["parent_id"]]["name"] == "LLMServerClient.generate" for e in engines)
            assert {s["name"]: s["span_type"] for s in spans} == TYPES
            tags = trace["tags"]  # VERL's trace tags, and nothing from an engine's resource
            assert {k: tags.get(k) for k in ("mlflow.traceName", "step", "sample_index", "rollout_n", "validate")} == {
                "mlflow.traceName": "agent_loop", "step": "1", "sample_index": str(mine[trace_id]["sample_index"]),
                "rollout_n": "0", "validate": "False"}
            assert not [k for k in {**tags, **trace["metadata"]} if k.startswith("vllm.") or k == "service.instance.id"]
            assert tags["service.name"] == "tracecar"  # the documented tag, not the engine's unknown_service:python
            for e in engines:  # the engine's request and response, not {} / null
                assert e["inputs"]["request.id"].startswith("req-") and e["inputs"]["usage.prompt_tokens"] in (4, 8)
                assert e["outputs"]["usage.completion_tokens"] == 3
                assert e["outputs"]["latency.time_to_first_token"] == pytest.approx(0.031)
                assert e["attributes"]["tracecar.engine.resource"]["vllm.instrumenting_module_name"] == "vllm.llm_engine"
            for s in spans:  # the collector's place mark is internal
                assert "tracecar" not in s["attributes"] and "tracecar.tracecar" not in s["attributes"], s["attributes"]
            run = next(s for s in spans if s["name"] == "ToolAgentLoop.run")
            assert run["inputs"]["sampling_params"] == {"temperature": 0.7} and run["outputs"]["num_turns"] == 3
            [tool] = [s for s in spans if s["span_type"] == "TOOL"]
            assert tool["inputs"]["parameters"] == {"q": "four"}
            failed = [s for s in spans if s["status"].endswith("ERROR")]
            expected = ["LLMServerClient.generate", "llm_request"] if mine[trace_id]["failed_turn"] else []
            assert sorted(s["name"] for s in failed) == expected
