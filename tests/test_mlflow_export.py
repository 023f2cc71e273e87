"""MLflow out, against a real ``mlflow server`` (SQLite backend) started on 127.0.0.1.

The collector runs with ``backend=mlflow`` (experiment resolved by name through MLflow's REST
API, as VERL's ``mlflow.set_experiment(project_name)`` would make it); a VERL-shaped rollout
with vLLM-shaped engine spans is traced once, and read back with MLflow's own client
(``mlflow.search_traces`` / ``get_trace``) in MLflow's venv (``TRACECAR_MLFLOW_SERVER_PYTHON``,
made by tests/run.sh under ``TRACECAR_TEST_OTLP_SERVERS=1``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.mlflow_kit import have_mlflow
from tests.mlflow_kit import mlflow_server as start_mlflow_server
from tests.mlflow_kit import read_back as _read_back
from tests.test_otlp_export import verl_rollout
from tests.test_otlp_receiver import VllmEngine

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not have_mlflow(),
                       reason="needs MLflow's venv: TRACECAR_MLFLOW_SERVER_PYTHON (tests/run.sh makes .venv-mlflow "
                              "with TRACECAR_TEST_OTLP_SERVERS=1)"),
]


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Any:
    with start_mlflow_server(tmp_path / "mlflow") as url:
        yield url


def test_verl_rollout_with_engine_spans_reads_back_from_mlflow(mlflow_server, start_collector, tracer_to):
    # typed span types here; VERL's own view (every span UNKNOWN) is tests/test_mlflow_parity.py's
    col = start_collector(backend="mlflow", mlflow_tracking_uri=mlflow_server, mlflow_experiment_name="verl_project",
                          mlflow_span_types="typed")
    tracer = tracer_to(col.url)
    engine = VllmEngine(col.url + "/v1/traces")
    trace_id = verl_rollout(engine)
    assert tracer.flush(10)
    engine.flush()
    engine.close()

    deadline = time.monotonic() + 90
    while True:
        traces = _read_back(mlflow_server, "verl_project")
        spans = [s for t in traces for s in t["spans"]]
        if len(spans) >= 7 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(traces) == 1 and trace_id in traces[0]["trace_id"], traces
    tags = traces[0]["tags"]  # VERL's rollout_trace_attr attributes, as its mlflow backend tags the trace
    assert {k: tags.get(k) for k in ("mlflow.traceName", "step", "sample_index", "rollout_n", "validate")} == {
        "mlflow.traceName": "agent_loop", "step": "5", "sample_index": "3", "rollout_n": "0", "validate": "False"}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"].rsplit(".", 1)[-1], []).append(s)
    [root] = by_name["agent_loop"]
    assert root["parent_id"] is None and root["span_type"] == "AGENT"
    [run] = by_name["run"]
    assert run["parent_id"] == root["span_id"]
    assert run["inputs"] == {"sampling_params": {"temperature": 0.7}}  # VERL's set_inputs: bound args without self
    assert run["outputs"]["num_turns"] == 3
    generates = by_name["generate"]
    assert len(generates) == 2 and all(g["span_type"] == "LLM" and g["parent_id"] == run["span_id"] for g in generates)
    assert {g["outputs"]["response_text"] for g in generates} == {"4"}
    engines = by_name["llm_request"]
    assert sorted(e["parent_id"] for e in engines) == sorted(g["span_id"] for g in generates)  # joined
    [tool] = by_name["execute"]
    assert tool["span_type"] == "TOOL" and tool["inputs"]["parameters"] == {"expr": "2+2"}
