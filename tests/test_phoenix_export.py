"""OTLP out, against a real Arize Phoenix (``phoenix serve``, SQLite in a temp dir) on 127.0.0.1.

One shared workload for the module (tests/engine_workload.py): three worker processes, each the
real client plus a vLLM-shaped engine exporting ``llm_request`` spans (some before anything of
their trajectory), into one collector process run with ``TRACECAR_WORKERS=2`` (decoding in
worker processes) and ``backend=otlp`` pointed at Phoenix's ``/v1/traces``. Read back through
Phoenix's own APIs: the REST spans API (every span, tree, project) and the GraphQL API its UI
reads (span kind, input, output, token counts). Phoenix runs in its own venv
(``TRACECAR_PHOENIX_SERVER_PYTHON``, made by tests/run.sh under ``TRACECAR_TEST_OTLP_SERVERS=1``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests import engine_workload as workload
from tests.support import free_port, start_service
from tests.support.collector import scrape_metric

PHOENIX_PYTHON = os.environ.get("TRACECAR_PHOENIX_SERVER_PYTHON", "")
WORKERS = 3
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (PHOENIX_PYTHON and Path(PHOENIX_PYTHON).exists()),
                       reason="needs Phoenix's venv: TRACECAR_PHOENIX_SERVER_PYTHON (tests/run.sh makes .venv-phoenix "
                              "with TRACECAR_TEST_OTLP_SERVERS=1)"),
]
# what Phoenix must show as each span's kind (OpenInference)
KINDS = {"agent_loop": "AGENT", "ToolAgentLoop.run": "AGENT", "LLMServerClient.generate": "LLM",
         "SearchTool.execute": "TOOL", "SearchTool.lookup": "CHAIN", "ToolAgentLoop.format_tool_response": "CHAIN",
         "HermesToolParser.extract_tool_calls": "CHAIN", "llm_request": "CHAIN"}


def start_phoenix(work: Path) -> Any:
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(work), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(free_port()), "PHOENIX_TELEMETRY_ENABLED": "false"}
    return start_service("phoenix", [str(Path(PHOENIX_PYTHON).parent / "phoenix"), "serve"],
                         f"http://127.0.0.1:{port}/healthz", work / "phoenix.log", timeout=120, poll_s=0.5,
                         stdout_to_log=True, cwd=work, env=env)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Phoenix may nest dotted attribute names; compare on the dotted form."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def rest_spans(url: str, project: str) -> list[dict[str, Any]]:
    """Every span of a Phoenix project through its REST API (cursor pages)."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        r = httpx.get(f"{url}/v1/projects/{project}/spans", params=params, timeout=30)
        if r.status_code == 404:
            return []
        assert r.status_code == 200, r.text[:2000]
        body = r.json()
        out.extend(body.get("data", []))
        cursor = body.get("next_cursor")
        if not cursor:
            return out


GRAPHQL = """
query {
  projects { edges { node { name
    spans(first: 1000) { edges { node {
      name spanKind statusCode parentId context { spanId traceId } attributes
      input { value mimeType } output { value mimeType }
      tokenCountPrompt tokenCountCompletion tokenCountTotal
    } } }
  } } }
}
"""


def oi_messages(attributes: dict[str, Any], which: str) -> list[dict[str, Any]]:
    """OpenInference's ``llm.<which>.<i>.message.*`` (what Phoenix's LLM view lists), nested or flat."""
    def flat(value: Any, prefix: str = "") -> dict[str, Any]:  # lists by index too (Phoenix nests indexed names)
        if isinstance(value, list):
            value = {str(i): v for i, v in enumerate(value)}
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}" if prefix else key).items()}

    nested = (attributes.get("llm") or {}).get(which)
    if isinstance(nested, list):
        return [flat(m.get("message", m)) for m in nested]
    flat_attributes, out = flat(attributes), []
    while f"llm.{which}.{len(out)}.message.role" in flat_attributes:
        head = f"llm.{which}.{len(out)}.message."
        out.append({k[len(head):]: v for k, v in flat_attributes.items() if k.startswith(head)})
    return out


def graphql_spans(url: str, project: str) -> list[dict[str, Any]]:
    """The spans of a project as Phoenix's UI reads them (its GraphQL API)."""
    r = httpx.post(url + "/graphql", json={"query": GRAPHQL}, timeout=60)
    assert r.status_code == 200 and not r.json().get("errors"), r.text[:2000]
    for edge in r.json()["data"]["projects"]["edges"]:
        if edge["node"]["name"] == project:
            return [e["node"] for e in edge["node"]["spans"]["edges"]]
    return []


@pytest.fixture(scope="module")
def phoenix_run(tmp_path_factory: pytest.TempPathFactory, deepseek_tokenizer_path: str) -> Any:
    """Phoenix, a collector with 2 worker processes exporting to it, and three worker processes' rollouts."""
    work = tmp_path_factory.mktemp("phoenix-run")
    phoenix = start_phoenix(work / "phoenix")
    col = workload.collector_process(work / "collector", backend="otlp", otlp_endpoint=phoenix.url + "/v1/traces",
                                     otlp_content=True, workers=2, token2text=True, tokenizer=deepseek_tokenizer_path)
    try:
        deadline = time.monotonic() + 90  # the pool warm, so batches really go through worker processes
        while scrape_metric(col.url, "tracecar_workers") < 2:
            assert time.monotonic() < deadline, col.log_text()[-3000:]
            time.sleep(0.2)
        manifest = workload.run_workers(col.url, WORKERS, work / "workers")
        expected = len(manifest) * workload.SPANS_PER_TRAJECTORY
        workload.wait_delivered(col.url, expected)
        workload.assert_engine_spans_came_first(col.url)
        by_project: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + 90  # Phoenix inserts from a queue
        while True:
            by_project = {p: rest_spans(phoenix.url, p) for p in (*workload.PROJECTS, "default")}
            if sum(len(v) for v in by_project.values()) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        yield {"url": phoenix.url, "manifest": manifest, "spans": by_project, "collector": col,
               "batches_in_workers": scrape_metric(col.url, "tracecar_batches_parsed_total", where="worker")}
    finally:
        if col.proc is not None and col.proc.poll() is None:
            col.terminate()
        phoenix.stop(30)


def test_every_span_of_every_worker_process_reaches_phoenix_in_its_project(phoenix_run):
    manifest, by_project = phoenix_run["manifest"], phoenix_run["spans"]
    assert phoenix_run["batches_in_workers"] > 0  # TRACECAR_WORKERS=2 did the work
    assert by_project["default"] == []  # no span without its destination: not even an engine span that came first
    for project in workload.PROJECTS:
        spans = by_project[project]
        mine = [t for t in manifest if t["project"] == project]
        assert len(spans) == len(mine) * workload.SPANS_PER_TRAJECTORY  # 100 %: none dropped as a duplicate id
        assert {s["context"]["trace_id"] for s in spans} == {t["trace_id"] for t in mine}  # each in its project
        ids = [s["context"]["span_id"] for s in spans]
        assert len(set(ids)) == len(ids)
        by_id = {s["context"]["span_id"]: s for s in spans}
        for s in spans:  # no orphans: every parent is there, in the same trace
            if s.get("parent_id"):
                assert by_id[s["parent_id"]]["context"]["trace_id"] == s["context"]["trace_id"], s
        engines = [s for s in spans if s["name"] == "llm_request"]
        assert len(engines) == len(mine) * workload.ENGINE_SPANS_PER_TRAJECTORY
        for e in engines:  # every engine span under its generate, the first ones included
            assert by_id[e["parent_id"]]["name"] == "LLMServerClient.generate"
        roots = [s for s in spans if not s.get("parent_id")]
        assert sorted(s["context"]["trace_id"] for s in roots) == sorted(t["trace_id"] for t in mine)
        errors = [s for s in spans if s["status_code"] == "ERROR"]
        failed = sum(t["failed_turn"] for t in mine)
        assert sorted(s["name"] for s in errors) == sorted(["LLMServerClient.generate", "llm_request"] * failed)
        for s in spans:
            s["attributes"] = _flat(s.get("attributes") or {})
        for s in roots:
            assert s["attributes"]["gen_ai.operation.name"] == "invoke_agent"
        turns = [s for s in spans if s["name"] == "LLMServerClient.generate" and s["status_code"] != "ERROR"]
        assert all(s["attributes"]["gen_ai.usage.output_tokens"] == 3 for s in turns)
        assert all(orjson.loads(s["attributes"]["gen_ai.output.messages"])[0]["role"] == "assistant" for s in turns)
        for s in spans:  # the collector's place mark is internal
            assert not any(k == "tracecar" or k.startswith(("tracecar.tracecar", "tracecar.root", "tracecar.turn"))
                           for k in s["attributes"]), s["attributes"]


def test_phoenix_ui_fields_are_filled_for_every_span_kind(phoenix_run):
    """What Phoenix's UI shows (its GraphQL API): span kind, input and output (JSON), token counts."""
    manifest = phoenix_run["manifest"]
    for project in workload.PROJECTS:
        spans = graphql_spans(phoenix_run["url"], project)
        assert len(spans) == sum(t["project"] == project for t in manifest) * workload.SPANS_PER_TRAJECTORY
        assert {s["name"]: s["spanKind"].upper() for s in spans} == KINDS
        for s in spans:
            for part in ("input", "output"):
                assert s[part] and s[part]["value"] and s[part]["mimeType"] == "json", (s["name"], part, s[part])
                orjson.loads(s[part]["value"])
        llm = [s for s in spans if s["spanKind"].upper() == "LLM"]
        assert llm and all(s["tokenCountPrompt"] in (4, 8) for s in llm)
        ok = [s for s in llm if s["statusCode"] != "ERROR"]
        assert all(s["tokenCountCompletion"] == 3 and s["tokenCountTotal"] == s["tokenCountPrompt"] + 3 for s in ok)
        for s in ok:  # the conversation each turn read, as Phoenix's LLM view lists it: gen_ai.input.messages'
            attributes = orjson.loads(s["attributes"])  # (here one user turn: token2text decodes the ids again)
            asked = oi_messages(attributes, "input_messages")
            genai = orjson.loads(_flat(attributes)["gen_ai.input.messages"])
            assert asked and [m["role"] for m in asked] == [m["role"] for m in genai]
            assert [m.get("content") for m in asked] == ["\n".join(p["content"] for p in m["parts"]) for m in genai]
        failed = [s for s in llm if s["statusCode"] == "ERROR"]
        assert failed and all(orjson.loads(s["output"]["value"]) == {"error": "RuntimeError: engine dead"} for s in failed)
        roots = [s for s in spans if s["name"] == "agent_loop"]
        assert {orjson.loads(s["input"]["value"])["step"] for s in roots} == {1}
        assert {orjson.loads(s["output"]["value"])["status"] for s in roots} == {"OK"}
        engines = [orjson.loads(s["input"]["value"]) for s in spans if s["name"] == "llm_request"]
        assert all(e["request.id"].startswith("req-") and e["usage.prompt_tokens"] in (4, 8) for e in engines)
        tools = [orjson.loads(s["input"]["value"]) for s in spans if s["name"] == "SearchTool.execute"]
        assert all(t["parameters"] == {"q": "four"} for t in tools)
