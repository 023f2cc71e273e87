"""MLflow out, against a real ``mlflow server`` (SQLite backend) started on 127.0.0.1.

The collector runs with ``backend=mlflow`` (experiment resolved by name through MLflow's REST
API, as VERL's ``mlflow.set_experiment(project_name)`` would make it); a VERL-shaped rollout
with vLLM-shaped engine spans is traced once, and read back with MLflow's own client
(``mlflow.search_traces`` / ``get_trace``) in MLflow's venv (``TRACECAR_MLFLOW_SERVER_PYTHON``,
made by tests/run.sh under ``TRACECAR_TEST_OTLP_SERVERS=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port, start_service
from tests.test_otlp_export import verl_rollout
from tests.test_otlp_receiver import VllmEngine

MLFLOW_PYTHON = os.environ.get("TRACECAR_MLFLOW_SERVER_PYTHON", "")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (MLFLOW_PYTHON and Path(MLFLOW_PYTHON).exists()),
                       reason="needs MLflow's venv: TRACECAR_MLFLOW_SERVER_PYTHON (tests/run.sh makes .venv-mlflow "
                              "with TRACECAR_TEST_OTLP_SERVERS=1)"),
]

READ_BACK = """
import json, sys, mlflow
mlflow.set_tracking_uri(sys.argv[1])
exp = mlflow.get_experiment_by_name(sys.argv[2])
traces = mlflow.search_traces(locations=[exp.experiment_id], return_type="list")
out = []
for t in traces:
    full = mlflow.get_trace(t.info.trace_id)
    out.append({"trace_id": full.info.trace_id, "spans": [
        {"name": s.name, "span_id": s.span_id, "parent_id": s.parent_id, "span_type": s.span_type,
         "inputs": s.inputs, "outputs": s.outputs, "attributes": {k: v for k, v in s.attributes.items()}}
        for s in full.data.spans]})
print(json.dumps(out, default=repr))
"""


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Any:
    port = free_port()
    work = tmp_path / "mlflow"
    work.mkdir()
    bin_dir = Path(MLFLOW_PYTHON).parent
    service = start_service(
        "mlflow server",
        [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{work}/mlflow.db", "--default-artifact-root", str(work / "artifacts")],
        f"http://127.0.0.1:{port}/health", tmp_path / "mlflow.log", timeout=120, poll_s=0.5, stdout_to_log=True,
        cwd=work, env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    yield service.url
    service.stop(30)


def _read_back(url: str, experiment: str) -> list[dict[str, Any]]:
    done = subprocess.run([MLFLOW_PYTHON, "-c", READ_BACK, url, experiment], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_verl_rollout_with_engine_spans_reads_back_from_mlflow(mlflow_server, start_collector, tracer_to):
    col = start_collector(backend="mlflow", mlflow_tracking_uri=mlflow_server, mlflow_experiment_name="verl_project")
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
