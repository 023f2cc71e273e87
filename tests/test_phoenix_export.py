"""OTLP out, against a real Arize Phoenix (``phoenix serve``, SQLite in a temp dir) on 127.0.0.1.

The collector runs with ``backend=otlp`` pointed at Phoenix's ``/v1/traces``; a VERL-shaped
rollout with vLLM-shaped engine spans is traced once and read back through Phoenix's own REST
API (``GET /v1/projects/{project}/spans``): tree, GenAI attributes, content. Phoenix runs in its
own venv (``TRACECAR_PHOENIX_SERVER_PYTHON``, made by tests/run.sh under
``TRACECAR_TEST_OTLP_SERVERS=1``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import free_port, start_service
from tests.test_otlp_export import verl_rollout
from tests.test_otlp_receiver import VllmEngine

PHOENIX_PYTHON = os.environ.get("TRACECAR_PHOENIX_SERVER_PYTHON", "")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (PHOENIX_PYTHON and Path(PHOENIX_PYTHON).exists()),
                       reason="needs Phoenix's venv: TRACECAR_PHOENIX_SERVER_PYTHON (tests/run.sh makes .venv-phoenix "
                              "with TRACECAR_TEST_OTLP_SERVERS=1)"),
]


@pytest.fixture
def phoenix_server(tmp_path: Path) -> Any:
    port = free_port()
    work = tmp_path / "phoenix"
    work.mkdir()
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(work), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(free_port()), "PHOENIX_TELEMETRY_ENABLED": "false"}
    service = start_service("phoenix", [str(Path(PHOENIX_PYTHON).parent / "phoenix"), "serve"],
                            f"http://127.0.0.1:{port}/healthz", tmp_path / "phoenix.log", timeout=120, poll_s=0.5,
                            stdout_to_log=True, cwd=work, env=env)
    yield service.url
    service.stop(30)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Phoenix may nest dotted attribute names; compare on the dotted form."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def test_verl_rollout_with_engine_spans_reads_back_from_phoenix(phoenix_server, start_collector, tracer_to):
    col = start_collector(backend="otlp", otlp_endpoint=phoenix_server + "/v1/traces", otlp_content=True)
    tracer = tracer_to(col.url)
    engine = VllmEngine(col.url + "/v1/traces")
    trace_id = verl_rollout(engine)
    assert tracer.flush(10)
    engine.flush()
    engine.close()

    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(phoenix_server + "/v1/projects/default/spans", params={"limit": 100}, timeout=10)
        spans = r.json().get("data", []) if r.status_code == 200 else []
        if len(spans) >= 7 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text[:2000]
    assert len(spans) == 7, spans
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        s["attributes"] = _flat(s.get("attributes") or {})
        by_name.setdefault(s["name"].rsplit(".", 1)[-1], []).append(s)
    [root] = by_name["agent_loop"]
    assert not root.get("parent_id") and root["attributes"]["gen_ai.operation.name"] == "invoke_agent"
    [run] = by_name["run"]
    assert run["parent_id"] == root["context"]["span_id"]
    generates = by_name["generate"]
    assert len(generates) == 2
    for g in generates:
        assert g["parent_id"] == run["context"]["span_id"]
        assert g["attributes"]["gen_ai.operation.name"] == "chat" and g["attributes"]["gen_ai.usage.output_tokens"] == 3
        assert '"content":"4"' in g["attributes"]["gen_ai.output.messages"]
    engines = by_name["llm_request"]
    assert sorted(e["parent_id"] for e in engines) == sorted(g["context"]["span_id"] for g in generates)  # joined
    [tool] = by_name["execute"]
    assert tool["attributes"]["gen_ai.operation.name"] == "execute_tool"
