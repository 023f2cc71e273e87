"""A real ``mlflow server`` (SQLite backend) on 127.0.0.1 for the MLflow tests, and the read-back.

The server runs from MLflow's own venv (``TRACECAR_MLFLOW_SERVER_PYTHON``; tests/run.sh makes
``.venv-mlflow`` under ``TRACECAR_TEST_OTLP_SERVERS=1``), as does the read-back, which uses MLflow's
own client (``mlflow.search_traces`` / ``get_trace``) and returns what a user sees of every trace of
an experiment: its info (tags, metadata, state, previews) and its spans.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support import free_port

MLFLOW_PYTHON = os.environ.get("TRACECAR_MLFLOW_SERVER_PYTHON", "")
# MLflow reports usage to its telemetry service unless told not to: tests talk to 127.0.0.1 only
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}

READ_BACK = """
import json, sys, mlflow
mlflow.set_tracking_uri(sys.argv[1])
exp = mlflow.get_experiment_by_name(sys.argv[2])
traces = [] if exp is None else mlflow.search_traces(locations=[exp.experiment_id], return_type="list")
out = []
for t in traces:
    full = mlflow.get_trace(t.info.trace_id)
    info = full.info
    out.append({"trace_id": info.trace_id, "experiment_id": exp.experiment_id, "state": str(info.state),
                "tags": dict(info.tags), "metadata": dict(info.trace_metadata),
                "request_preview": info.request_preview, "response_preview": info.response_preview,
                "spans": [
        {"name": s.name, "span_id": s.span_id, "parent_id": s.parent_id, "span_type": s.span_type,
         "status": str(s.status.status_code), "status_message": s.status.description,
         "inputs": s.inputs, "outputs": s.outputs, "attributes": {k: v for k, v in s.attributes.items()},
         "start_ns": s.start_time_ns,
         "events": [{"name": e.name, "attributes": dict(e.attributes)} for e in s.events]}
        for s in full.data.spans]})
print(json.dumps(out, default=repr))
"""


def have_mlflow() -> bool:
    return bool(MLFLOW_PYTHON and Path(MLFLOW_PYTHON).exists())


@contextmanager
def mlflow_server(work: Path) -> Iterator[str]:
    """``mlflow server`` with a SQLite store in ``work``; yields its URL, stops it after."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "mlflow.log"
    bin_dir = Path(MLFLOW_PYTHON).parent
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{work}/mlflow.db", "--default-artifact-root", str(work / "artifacts")],
            cwd=work, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_TRACKING_URI": "", **NO_TELEMETRY})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        try:
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("mlflow server did not start: " + log_path.read_text()[-3000:])
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def read_back(url: str, experiment: str) -> list[dict[str, Any]]:
    """Every trace of an experiment (by name) as MLflow's client returns it, as plain data."""
    done = subprocess.run([MLFLOW_PYTHON, "-c", READ_BACK, url, experiment], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **NO_TELEMETRY})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
