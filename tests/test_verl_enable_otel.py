"""VERL's ``enable_otel`` drop-in: RL-Insight's discovery answered, engine spans joined by request id.

VERL's ``actor_rollout_ref.rollout.trace.enable_otel`` (verl #8158) makes each rollout replica
ask RL-Insight's server ``GET /api/v1/services`` for an ``otlp_port`` and send vLLM's request
spans there, with resource attributes ``project``, ``experiment_name``, ``replica`` and no parent
context. Pointed at the collector (``RL_INSIGHT_SERVER_URL``), those spans must land under the
``generate`` call that sent each request, in its trajectory's project, whichever arrives first.

Runs where the real ``verl`` and ``rl-insight`` packages are importable (the VERL venv); the
multi-process test also needs MLflow's venv (``TRACECAR_MLFLOW_SERVER_PYTHON``), its exporter.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
pytest.importorskip("rl_insight.server.http_api")

from tests import verl_otel_workload as workload  # noqa: E402
from tests.engine_workload import collector_process, wait_delivered  # noqa: E402
from tests.mlflow_kit import have_mlflow, read_back  # noqa: E402
from tests.mlflow_kit import mlflow_server as start_mlflow_server  # noqa: E402
from tests.support.collector import scrape_metric  # noqa: E402
from tests.test_verl_adapter import hf_tokenizer, model_dir  # noqa: E402,F401  (fixtures)

pytestmark = [pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]
REPLICAS = 3


def test_the_collector_answers_rl_insights_service_discovery_as_rl_insights_server_does(start_collector, monkeypatch,
                                                                                         tmp_path):
    from fastapi.testclient import TestClient
    from rl_insight.server.http_api import create_app, get_server_services
    from rl_insight.server.network import service_url_from_server_url
    from rl_insight.utils.monitor_config_loader import load_server_config_file

    col = start_collector()
    monkeypatch.setenv("RL_INSIGHT_SERVER_URL", col.url + "/")
    ours = get_server_services()  # RL-Insight's own client
    monkeypatch.setenv("HOME", str(tmp_path))  # RL-Insight's server keeps its target file under ~/.rl-insight
    theirs = TestClient(create_app(load_server_config_file())).get("/api/v1/services").json()  # RL-Insight's own server
    assert set(ours) == set(theirs) and ours["status"] == theirs["status"] == "ok"
    assert type(ours["otlp_port"]) is type(theirs["otlp_port"]) is int
    assert ours == {"status": "ok", "otlp_port": int(col.url.rsplit(":", 1)[1]), "prometheus_port": None, "grafana_port": None}
    endpoint = service_url_from_server_url(col.url, ours["otlp_port"], "/v1/traces")
    assert endpoint == col.url + "/v1/traces"  # where the replica's exporter then sends
    mapped = httpx.get(col.url + "/api/v1/services", headers={"Host": "collector.job.svc:4318"}).json()
    assert mapped["otlp_port"] == 4318  # the port the caller reached it on (a Service or proxy mapping ports)
    refused = httpx.post(col.url + "/api/v1/prometheus/targets", json={"targets": ["10.0.0.1:9090"]})
    assert refused.status_code == 501 and "does not scrape" in refused.json()["error"]["reason"]


@pytest.mark.skipif(not have_mlflow(), reason="needs MLflow's venv: TRACECAR_MLFLOW_SERVER_PYTHON")
def test_enable_otel_engine_spans_of_several_replicas_join_their_generate_calls_without_a_parent_context(
        tmp_path, model_dir):  # noqa: F811
    work = tmp_path / "job"
    with start_mlflow_server(work / "mlflow") as mlflow_url:
        col = collector_process(work / "collector", backend="mlflow", mlflow_tracking_uri=mlflow_url,
                                mlflow_span_types="typed")
        try:
            seen = _run_replicas(col.url, model_dir, work / "replicas")
            requests = {s["request_id"]: s for s in seen}
            assert len(requests) == len(seen) == REPLICAS * 6  # 2 tool rollouts x 2 turns + 2 single turns, each
            assert sum(s["first"] for s in seen) >= REPLICAS  # engine spans first, in every replica
            trajectories = _viewer_trajectories(col.url, REPLICAS * 4)
            engine_ids = _check_viewer(col.url, trajectories, requests)
            assert engine_ids == set(requests)
            wait_delivered(col.url, sum(t["span_count"] for t in trajectories))
            joined = scrape_metric(col.url, "tracecar_otlp_request_joins_total", outcome="joined")
            late = scrape_metric(col.url, "tracecar_otlp_request_joins_total", outcome="joined_late")
            assert joined + late == len(requests) and late >= REPLICAS
            assert scrape_metric(col.url, "tracecar_otlp_request_joins_total", outcome="engine_unmatched") == 0
            assert scrape_metric(col.url, "tracecar_otlp_held_spans_waiting") == 0
        finally:
            col.terminate()
        _check_store(work / "collector" / "spool.sqlite3", requests)
        _check_mlflow(mlflow_url, trajectories, requests)


def _run_replicas(url: str, model_dir: Path, work: Path) -> list[dict[str, Any]]:  # noqa: F811
    work.mkdir(parents=True)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("TRACECAR_", "OTEL_", "RL_INSIGHT_"))}
    procs = [(work / f"manifest-{k}.json",
              subprocess.Popen([sys.executable, "-m", "tests.verl_otel_workload", url, str(k), str(model_dir),
                                str(work / f"manifest-{k}.json")], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
             for k in range(REPLICAS)]
    seen: list[dict[str, Any]] = []
    for path, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        seen.extend(json.loads(path.read_text()))
    return seen


def _viewer_trajectories(url: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        page = httpx.get(url + "/ui/api/trajectories", params={"experiment": workload.EXPERIMENT, "limit": 100}).json()
        if len(page["trajectories"]) >= count or time.monotonic() > deadline:
            assert len(page["trajectories"]) == count, page
            return page["trajectories"]
        time.sleep(0.2)


def _spans(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("children", []):
        out.extend(_spans(child))
    return out


def _check_viewer(url: str, trajectories: list[dict[str, Any]], requests: dict[str, Any]) -> set[str]:
    """Through the viewer's API: every generate has its one llm_request child, the one its request id names."""
    engine_ids: set[str] = set()
    deadline = time.monotonic() + 60
    for summary in trajectories:
        while True:
            view = httpx.get(f"{url}/ui/api/trajectories/{summary['trace_id']}").json()
            spans = _spans(view["tree"])
            generates = [s for s in spans if s["name"] == "LLMServerClient.generate"]
            engines = [s for s in spans if s["name"] == "llm_request"]
            if len(engines) == len(generates) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert generates and len(engines) == len(generates), [s["name"] for s in spans]
        for generate in generates:
            [sent] = generate["attributes"]["engine_request_ids"]  # noted by the adapter: VERL's per-turn uuid
            assert sent != generate["inputs"]["request_id"]  # not the agent loop's sticky-session id
            [engine] = [c for c in generate.get("children", []) if c["name"] == "llm_request"]
            attrs = engine["attributes"]
            assert attrs["gen_ai.request.id"] == sent and attrs["otel"]["joined_by"] == "gen_ai.request.id"
            assert attrs["gen_ai.usage.prompt_tokens"] == requests[sent]["prompt_tokens"] == len(generate["inputs"]["prompt_ids"])
            resource = attrs["otel"]["resource"]  # VERL's enable_otel resource, kept
            assert (resource["project"], resource["experiment_name"]) == (workload.PROJECT, workload.EXPERIMENT)
            assert resource["replica"] == str(requests[sent]["replica"])
            assert attrs["step"] == 7 and attrs["experiment_name"] == workload.EXPERIMENT  # the trajectory's budget keys
            assert engine["trace_id"] == summary["trace_id"]
            engine_ids.add(sent)
        turns = view["turns"]  # the conversation view: each turn with its engine's timings
        assert len(turns) == len(generates)
        assert all([e["request_id"] for e in t["engine"]] == [t_gen["attributes"]["engine_request_ids"][0]]
                   for t, t_gen in zip(turns, sorted(generates, key=lambda g: g["start_time"]), strict=True))
    return engine_ids


def _check_store(path: Path, requests: dict[str, Any]) -> None:
    """In the store: every engine span re-keyed into its trajectory, with its worker and project, none waiting."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT s.trace_id, s.worker, s.project, s.state, s.step, g.name, g.worker, g.trace_id"
                          " FROM spans s LEFT JOIN spans g ON g.span_id = s.parent_id WHERE s.name = 'llm_request'").fetchall()
    assert len(rows) == len(requests)
    for trace_id, worker, project, state, step, parent_name, parent_worker, parent_trace in rows:
        assert parent_name == "LLMServerClient.generate" and parent_trace == trace_id
        assert worker == parent_worker and worker.startswith("replica-") and project == workload.PROJECT
        assert state != 4 and step == 7


def _check_mlflow(url: str, trajectories: list[dict[str, Any]], requests: dict[str, Any]) -> None:
    """Through the MLflow exporter: each trajectory whole in its project's experiment, engine spans under their generate."""
    deadline = time.monotonic() + 90
    while True:
        traces = read_back(url, workload.PROJECT)
        elsewhere = read_back(url, "Default") + read_back(url, "tracecar")
        if len(traces) >= len(trajectories) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert elsewhere == []  # no engine span filed on its own, in the default experiment
    assert len(traces) == len(trajectories)
    engines = 0
    for trace in traces:
        by_id = {s["span_id"]: s for s in trace["spans"]}
        for span in trace["spans"]:
            if span["name"] == "llm_request":
                engines += 1
                assert by_id[span["parent_id"]]["name"] == "LLMServerClient.generate"
                assert span["inputs"]["request.id"] in requests
    assert engines == len(requests)
