"""OTLP out: the ``otlp`` backend pushes the joined rollout tree to a real OTLP/HTTP server.

The destination is a second tracecar collector's own ``/v1/traces`` receiver (a real OTLP
server on 127.0.0.1, read back through its HTTP API); the answer classification is checked
against a loopback HTTP server that answers what real servers answer (503 + Retry-After, 400,
``partial_success``), and a closed port.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tests import engine_workload as workload
from tests.support import free_port
from tests.test_otlp_receiver import VllmEngine, _walk
from tracecar.client import rollout_trace_attr, rollout_trace_op, trace_headers
from tracecar.collector.exporters.otlp_sink import MlflowSink, OtlpSink, parse_headers
from tracecar.collector.exporters.otlp_translate import span_id_bytes

pytestmark = pytest.mark.timeout(120)


def verl_rollout(engine: VllmEngine) -> str:
    """A VERL-shaped trajectory: agent_loop root, ToolAgentLoop.run, two generate calls (each
    causing one vLLM ``llm_request`` span through its traceparent) and one tool call."""

    class AsyncLLMServerManager:
        @rollout_trace_op
        async def generate(self, request_id: str, prompt_ids: list[int]) -> dict[str, Any]:
            engine.request(trace_headers(), request_id, len(prompt_ids), 3, arrival=time.time())
            return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9], "prompt_text": "2+2?", "response_text": "4"}

    class Calculator:
        @rollout_trace_op
        async def execute(self, instance_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
            return {"text": "4"}

    class ToolAgentLoop:
        @rollout_trace_op
        async def run(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
            server = AsyncLLMServerManager()
            await server.generate("req-1", [1, 2, 3, 4])
            await Calculator().execute("t-1", {"expr": "2+2"})
            await server.generate("req-2", [1, 2, 3, 4, 7, 8, 9, 5])
            return {"prompt_ids": [1, 2, 3, 4], "response_ids": [7, 8, 9, 5, 7, 8, 9], "num_turns": 3}

    async def trajectory() -> str:
        with rollout_trace_attr(sample_index=3, step=5, rollout_n=0, name="agent_loop") as root:
            await ToolAgentLoop().run({"temperature": 0.7})
        return root.span_id

    return asyncio.run(trajectory())


def _wait(url: str, trace_id: str, count: int, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/v1/trajectories/{trace_id}", timeout=10)
        if r.status_code == 200 and r.json()["span_count"] >= count:
            return r.json()
        if time.monotonic() > deadline:
            raise AssertionError(f"trace {trace_id} at {url}: {r.status_code} {r.text[:500]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def otlp_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A destination collector (a real OTLP/HTTP server, tracecar's own receiver), a source collector
    exporting to it over OTLP, and three worker processes' rollouts (tests/engine_workload.py)."""
    work = tmp_path_factory.mktemp("otlp-run")
    destination = workload.collector_process(work / "destination")
    source = workload.collector_process(work / "source", backend="otlp", otlp_endpoint=destination.url + "/v1/traces",
                                        otlp_headers="x-test-token=s3cret-value", otlp_content=True)
    try:
        manifest = workload.run_workers(source.url, 3, work / "workers")
        workload.wait_delivered(source.url, len(manifest) * workload.SPANS_PER_TRAJECTORY)
        workload.assert_engine_spans_came_first(source.url)
        yield {"manifest": manifest, "destination": destination, "source": source}
    finally:
        for col in (source, destination):
            if col.proc is not None and col.proc.poll() is None:
                col.terminate()


def test_otlp_backend_delivers_every_worker_process_s_joined_tree_with_genai_conventions(otlp_run):
    destination, manifest = otlp_run["destination"], otlp_run["manifest"]
    exported_ids: list[str] = []
    for entry in manifest:
        trace_id = entry["trace_id"]
        tree = _wait(destination.url, trace_id, workload.SPANS_PER_TRAJECTORY)
        spans = list(_walk(tree["root"]))
        assert tree["span_count"] == len(spans) == workload.SPANS_PER_TRAJECTORY  # 100 %, one tree
        exported_ids += [s["attributes"]["otel"]["span_id"] for s in spans]
        by_name: dict[str, list[dict[str, Any]]] = {}
        for s in spans:
            by_name.setdefault(s["name"], []).append(s)
        root = tree["root"]
        assert root["name"] == "agent_loop" and root["attributes"]["gen_ai.operation.name"] == "invoke_agent"
        [run] = by_name["ToolAgentLoop.run"]
        assert run["parent_id"] == root["span_id"]
        generates = by_name["LLMServerClient.generate"]
        assert len(generates) == 2
        for generate in generates:
            attrs = generate["attributes"]
            assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.conversation.id"] == trace_id
            assert attrs["openinference.span.kind"] == "LLM"
            [engine_span] = generate["children"]  # the join survives the export, engine spans first included
            assert engine_span["name"] == "llm_request" and engine_span["parent_id"] == generate["span_id"]
            assert engine_span["attributes"]["gen_ai.latency.time_to_first_token"] == pytest.approx(0.031)
            assert engine_span["attributes"]["otel"]["resource"]["vllm.instrumenting_module_name"] == "vllm.llm_engine"
        ok = [g for g in generates if not g["exception"]]
        assert all(g["attributes"]["gen_ai.usage.output_tokens"] == 3 for g in ok)
        for g in ok:  # content on: the whole conversation each turn read, in the semconv parts shape
            asked = orjson.loads(g["attributes"]["gen_ai.input.messages"])
            second = len(asked) > 2
            assert [m["role"] for m in asked] == (["system", "user", "assistant", "tool"] if second else ["system", "user"])
            assert asked[1]["parts"] == [{"type": "text", "content": "2+2?"}]
            if second:
                assert asked[2]["parts"] == [{"type": "tool_call", "name": "search", "arguments": {"q": "four"}}]
                assert asked[3]["parts"] == [{"type": "tool_call_response", "response": "four-0, four-1"}]
            [answer] = orjson.loads(g["attributes"]["gen_ai.output.messages"])
            assert answer["parts"] == ([{"type": "text", "content": "4"}] if second else
                                       [{"type": "tool_call", "name": "search", "arguments": {"q": "four"}}])
        assert len(ok) == (1 if entry["failed_turn"] else 2)
        [tool] = by_name["SearchTool.execute"]
        assert tool["attributes"]["gen_ai.operation.name"] == "execute_tool"
        assert "gen_ai.operation.name" not in by_name["SearchTool.lookup"][0]["attributes"]  # a helper, no tool call
        assert root["attributes"]["tracecar.project"] == entry["project"]
    assert len(set(exported_ids)) == len(exported_ids) == len(manifest) * workload.SPANS_PER_TRAJECTORY
    metrics = httpx.get(otlp_run["source"].url + "/metrics", timeout=10).text
    assert "s3cret-value" not in metrics and "s3cret-value" not in otlp_run["source"].log_text()


class AnsweringServer:
    """A loopback HTTP server answering each POST (or GET) with the next scripted (status, headers, body)."""

    def __init__(self, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.answers = answers
        self.requests: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.requests.append(({k.lower(): v for k, v in self.headers.items()}, raw))
                status, headers, body = outer.answers.pop(0)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _spans(n: int = 2) -> list[dict[str, Any]]:
    trace = "ab" * 16
    root = {"trace_id": trace, "span_id": trace, "parent_id": None, "kind": "trajectory", "name": "agent_loop",
            "start_time": 1.0, "end_time": 2.0, "inputs": {}, "output": None, "attributes": {"step": 1}}
    ops = [{"trace_id": trace, "span_id": trace[:16] + f"{i + 1:016x}", "parent_id": trace, "kind": "op",
            "name": "ToolAgentLoop.run", "start_time": 1.1, "end_time": 1.9, "inputs": {"x": i},
            "output": {"num_turns": 2}, "attributes": {}} for i in range(n - 1)]
    return [root, *ops]


def test_otlp_sink_classifies_answers_like_the_forwarder_needs():
    partial = ExportTraceServiceResponse()
    partial.partial_success.rejected_spans = 2
    partial.partial_success.error_message = "spans too old"
    server = AnsweringServer([
        (503, {"retry-after": "7"}, b""),
        (429, {}, b""),
        (400, {}, b"bad span: missing name"),
        (200, {"content-type": "application/x-protobuf"}, partial.SerializeToString()),
        (200, {"content-type": "application/x-protobuf"}, b""),
    ])
    sink = OtlpSink(server.url, headers={"authorization": "Bearer tok"}, content=False)
    spans = _spans()
    ids = [s["span_id"] for s in spans]

    async def go() -> list[Any]:
        try:
            return [await sink.send(spans) for _ in range(5)]
        finally:
            await sink.aclose()

    try:
        busy, limited, bad, refused, ok = asyncio.run(go())
    finally:
        server.close()
    assert busy.retryable == ids and busy.retry_after == 7 and not busy.delivered
    assert limited.retryable == ids and not limited.rejected
    assert set(bad.rejected) == set(ids) and "HTTP 400: bad span: missing name" in bad.rejected[ids[0]]
    assert set(refused.rejected) == set(ids) and "spans too old" in refused.rejected[ids[0]]
    assert ok.delivered == ids
    headers, raw = server.requests[0]
    assert headers["content-encoding"] == "gzip" and headers["authorization"] == "Bearer tok"
    request = ExportTraceServiceRequest.FromString(gzip.decompress(raw))
    sent = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(sent) == 2
    assert not any(a.key == "tracecar.inputs" for s in sent for a in s.attributes)  # content off

    closed = OtlpSink(f"http://127.0.0.1:{free_port()}/v1/traces")
    down = asyncio.run(closed.send(spans))
    asyncio.run(closed.aclose())
    assert down.retryable == ids and "ConnectError" in (down.retry_reason or "")


def test_mlflow_sink_sends_experiment_header_and_mlflow_span_attributes():
    server = AnsweringServer([(200, {}, b"{}")])
    sink = MlflowSink(server.url.removesuffix("/v1/traces"), "42")
    try:
        result = asyncio.run(sink.send(_spans()))
        asyncio.run(sink.aclose())
    finally:
        server.close()
    assert len(result.delivered) == 2
    headers, raw = server.requests[0]
    assert headers["x-mlflow-experiment-id"] == "42"
    request = ExportTraceServiceRequest.FromString(gzip.decompress(raw))
    sent = {s.name: {a.key: a.value.string_value for a in s.attributes}
            for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert sent["agent_loop"]["mlflow.spanType"] == '"UNKNOWN"'  # as VERL's own mlflow backend types every span
    assert "mlflow.spanInputs" not in sent["agent_loop"]  # VERL's root has no inputs: its attributes are trace tags
    assert sent["agent_loop"]["mlflow.traceTag.mlflow.traceName"] == '"agent_loop"'
    assert sent["ToolAgentLoop.run"]["mlflow.spanInputs"] == '{"x":0}'
    assert sent["ToolAgentLoop.run"]["mlflow.spanOutputs"] == '{"num_turns":2}'
    assert not any(k.startswith("gen_ai.") for attrs in sent.values() for k in attrs)  # no sessions VERL never shows


def test_mlflow_sink_names_the_experiment_by_the_project_unless_told():
    """Without an experiment setting, each span's project names its experiment (created once)."""
    from tracecar.collector.exporters.otlp_sink import MlflowSink

    server = AnsweringServer([
        (404, {"content-type": "application/json"}, b'{"error_code": "RESOURCE_DOES_NOT_EXIST"}'),
        (200, {"content-type": "application/json"}, b'{"experiment_id": "7"}'),
        (200, {}, b""),
        (200, {}, b""),
    ])
    sink = MlflowSink(server.url.removesuffix("/v1/traces"), span_types="typed")
    spans = [{**s, "project": "verl_project"} for s in _spans()]
    try:
        first = asyncio.run(sink.send(spans))
        second = asyncio.run(sink.send(spans))  # the id is remembered: no second lookup
        asyncio.run(sink.aclose())
    finally:
        server.close()
    assert len(first.delivered) == len(second.delivered) == 2
    assert len(server.requests) == 4
    headers, raw = server.requests[2]
    assert headers["x-mlflow-experiment-id"] == "7" and server.requests[3][0]["x-mlflow-experiment-id"] == "7"
    request = ExportTraceServiceRequest.FromString(gzip.decompress(raw))
    types = {s.name: {a.key: a.value.string_value for a in s.attributes}["mlflow.spanType"]
             for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert types["agent_loop"] == '"AGENT"'  # span_types="typed"


def test_mlflow_sink_sends_one_request_per_experiment_and_joins_the_answers():
    """Two projects in one batch: two experiments, two requests; one busy, one accepted."""
    from tracecar.collector.exporters.otlp_sink import MlflowSink

    server = AnsweringServer([
        (200, {"content-type": "application/json"}, b'{"experiment": {"experiment_id": "1"}}'),
        (503, {"retry-after": "3"}, b""),
        (200, {"content-type": "application/json"}, b'{"experiment": {"experiment_id": "2"}}'),
        (200, {}, b""),
    ])
    root, op = _spans()
    other = {**op, "span_id": op["span_id"][:-1] + "9", "project": "b"}
    sink = MlflowSink(server.url.removesuffix("/v1/traces"))
    try:
        result = asyncio.run(sink.send([{**root, "project": "a"}, {**op, "project": "a"}, other]))
        asyncio.run(sink.aclose())
    finally:
        server.close()
    assert sorted(result.retryable) == sorted([root["span_id"], op["span_id"]]) and result.retry_after == 3
    assert result.delivered == [other["span_id"]] and not result.rejected
    assert [h.get("x-mlflow-experiment-id") for h, _ in server.requests] == [None, "1", None, "2"]


def test_mlflow_attributes_of_a_failed_op_and_of_a_pydantic_output():
    """VERL's backend: a raised op has no outputs, status ERROR, log level ERROR and a stack trace;
    a returned one status OK; a model's fields without weave's envelope (MLflow's model_dump())."""
    from tracecar.collector.exporters.otlp_sink import MlflowSink, plain_objects

    root, op = _spans()
    failed = {**op, "span_id": op["span_id"][:-1] + "9", "output": None, "exception": "RuntimeError: boom",
              "exception_info": {"type": "RuntimeError", "message": "boom", "traceback": [
                  {"filename": "tool.py", "line_number": 3, "function_name": "execute", "text": "raise RuntimeError('boom')"}]}}
    model = {"_type": "ToolResponse", "text": "5", "image": None, "_class_name": "ToolResponse", "_bases": ["BaseModel"]}
    returned = {**op, "output": [model, 1.0, {"_type": "not an envelope"}]}
    request = ExportTraceServiceRequest.FromString(gzip.decompress(MlflowSink("http://127.0.0.1:1", "1").encode([root, returned, failed])))
    sent = {s.span_id.hex(): s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    ok, bad = (sent[span_id_bytes(s["span_id"], s["trace_id"]).hex()] for s in (returned, failed))
    attrs = {a.key: a.value for a in bad.attributes}
    assert "mlflow.spanOutputs" not in attrs and attrs["mlflow.spanLogLevel"].int_value == 40
    assert bad.status.code == bad.status.STATUS_CODE_ERROR and bad.status.message == "RuntimeError: boom"
    [event] = bad.events
    stack = {a.key: a.value.string_value for a in event.attributes}["exception.stacktrace"]
    assert stack.startswith("Traceback (most recent call last):\n  File \"tool.py\", line 3, in execute") and stack.endswith("RuntimeError: boom")
    assert ok.status.code == ok.status.STATUS_CODE_OK
    assert {a.key: a.value.string_value for a in ok.attributes}["mlflow.spanOutputs"] == \
        '[{"text":"5","image":null},1.0,{"_type":"not an envelope"}]'
    assert plain_objects({"a": [model]}) == {"a": [{"text": "5", "image": None}]}


def test_otlp_headers_parse_and_refuse_a_part_without_value():
    assert parse_headers("a=1, b = two=2 ,") == {"a": "1", "b": "two=2"}
    with pytest.raises(ValueError, match="part 2 has no 'name=value'") as caught:
        parse_headers("a=1,Bearer s3cret")
    assert "s3cret" not in str(caught.value)


def test_otlp_and_mlflow_misconfiguration_is_one_clear_line():
    from tracecar.collector.service.config_check import ConfigError, check_backend
    from tracecar.collector.settings import CollectorSettings

    with pytest.raises(ConfigError, match="TRACECAR_OTLP_ENDPOINT is not set"):
        check_backend(CollectorSettings(backend="otlp"))
    with pytest.raises(ConfigError, match="TRACECAR_MLFLOW_TRACKING_URI is not an http"):
        check_backend(CollectorSettings(backend="mlflow", mlflow_tracking_uri="sqlite:///x.db"))
    with pytest.raises(ConfigError, match="TRACECAR_OTLP_HEADERS") as caught:
        check_backend(CollectorSettings(backend="otlp", otlp_endpoint="http://127.0.0.1:1/v1/traces",
                                        otlp_headers="Bearer s3cret"))
    assert "s3cret" not in str(caught.value)
    check_backend(CollectorSettings(backend="otlp", otlp_endpoint="http://127.0.0.1:1/v1/traces", otlp_headers="a=b"))
