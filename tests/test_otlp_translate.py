"""Unit tests of the OTLP → tracecar translation, the client's traceparent and the Weave mapping of OTLP roots."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from tracecar.collector.exporters.weave_sink import SpanError, to_weave_call
from tracecar.collector.processors.validate import SpanIn, validate_batch
from tracecar.collector.receivers.otlp_translate import OtlpSpanIn, any_value, hex_ids_to_base64, translate

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
SPAN = bytes.fromhex("b7ad6b7169203331")


def _one(**fields) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    ss = rs.scope_spans.add()
    ss.spans.append(trace_pb2.Span(**fields))
    return req


def test_any_value_covers_every_kind():
    value = AnyValue()
    value.kvlist_value.values.add(key="s").value.string_value = "x"
    value.kvlist_value.values.add(key="i").value.int_value = -7
    value.kvlist_value.values.add(key="d").value.double_value = 0.5
    value.kvlist_value.values.add(key="b").value.bool_value = True
    value.kvlist_value.values.add(key="raw").value.bytes_value = b"\x00\xff"
    arr = value.kvlist_value.values.add(key="a").value.array_value
    arr.values.add().int_value = 1
    arr.values.add()  # an empty AnyValue
    assert any_value(value) == {"s": "x", "i": -7, "d": 0.5, "b": True, "raw": "AP8=", "a": [1, None]}


def test_ids_events_links_status_and_scope_are_kept():
    req = _one(trace_id=TRACE, span_id=SPAN, parent_span_id=bytes.fromhex("00f067aa0ba902b7"), name="llm_request",
               kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=1_500_000_000, end_time_unix_nano=2_500_000_000,
               trace_state="tracecar=1",
               status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR, message="boom"))
    span = req.resource_spans[0].scope_spans[0].spans[0]
    event = span.events.add(name="exception", time_unix_nano=2_000_000_000)
    event.attributes.add(key="exception.type").value.string_value = "ValueError"
    event.attributes.add(key="exception.message").value.string_value = "bad"
    event.attributes.add(key="exception.stacktrace").value.string_value = "Traceback ..."
    span.links.add(trace_id=TRACE, span_id=bytes.fromhex("1111111111111111"))
    span.attributes.add(key="gen_ai.usage.prompt_tokens").value.int_value = 4
    req.resource_spans[0].resource.attributes.add(key="service.name").value.string_value = "vllm"
    req.resource_spans[0].scope_spans[0].scope.name = "vllm.llm_engine"
    out = translate(req)
    assert out.rejected == [] and out.services == ["vllm"] and out.locations == ["resourceSpans[0].scopeSpans[0].spans[0]"]
    [s] = out.spans
    assert s["trace_id"] == TRACE.hex() and s["span_id"] == TRACE.hex()[:16] + SPAN.hex()
    assert s["parent_id"] == TRACE.hex()[:16] + "00f067aa0ba902b7"
    assert (s["start_time"], s["end_time"]) == (1.5, 2.5) and s["kind"] == "op"
    assert s["exception"] == "ValueError: bad\nTraceback ..."
    otel = s["attributes"]["otel"]
    assert s["attributes"]["gen_ai.usage.prompt_tokens"] == 4
    assert otel["kind"] == "SERVER" and otel["status"] == {"code": "ERROR", "message": "boom"} and otel["trace_state"] == "tracecar=1"
    assert otel["events"][0]["time"] == 2.0 and otel["links"] == [{"trace_id": TRACE.hex(), "span_id": "1111111111111111", "attributes": {}}]
    assert otel["resource"] == {"service.name": "vllm"} and otel["scope"]["name"] == "vllm.llm_engine"


@pytest.mark.parametrize("fields, where", [
    ({"trace_id": b"\x00" * 16, "span_id": SPAN}, "traceId"),
    ({"trace_id": TRACE[:8], "span_id": SPAN}, "traceId"),
    ({"trace_id": TRACE, "span_id": b""}, "spanId"),
    ({"trace_id": TRACE, "span_id": SPAN, "parent_span_id": b"\x00" * 8}, "parentSpanId"),
    ({"trace_id": TRACE, "span_id": SPAN, "parent_span_id": b"\x01\x02"}, "parentSpanId"),
])
def test_unusable_ids_are_rejected_by_their_otlp_field(fields, where):
    out = translate(_one(name="x", start_time_unix_nano=1, **fields))
    assert out.spans == [] and out.total == 1
    [rejection] = out.rejected
    assert rejection.index == 0 and rejection.field == f"spans[0].{where}" and out.locations == ["resourceSpans[0].scopeSpans[0].spans[0]"]


def test_ill_typed_tracecar_attributes_and_long_names_are_kept_with_a_warning():
    req = _one(trace_id=TRACE, span_id=SPAN, name="n" * 600, start_time_unix_nano=1)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.add(key="step").value.string_value = "retrieve"
    span.attributes.add(key="validate").value.int_value = 1
    span.attributes.add(key="sample_index").value.int_value = 4  # the right type: stays
    span.attributes.add(key="otel").value.string_value = "mine"
    out = translate(req)
    [s] = out.spans
    assert len(s["name"]) == 512 and s["attributes"]["sample_index"] == 4
    assert "step" not in s["attributes"] and "validate" not in s["attributes"]
    otel = s["attributes"]["otel"]
    assert otel["set_aside"] == {"step": "retrieve", "validate": 1} and otel["attribute"] == "mine"
    notes = out.warnings[s["span_id"]]
    assert [n.split(":")[0] for n in notes] == ["attributes.step", "attributes.validate", "attributes.otel", "name"]
    validated = validate_batch({"worker": "w", "spans": out.spans}, 10, span_model=OtlpSpanIn)
    assert validated.rejected == [] and len(validated.spans) == 1


def test_an_otlp_root_may_keep_its_own_ids_but_a_tracecar_root_may_not():
    root = {"span_id": "a" * 32, "trace_id": "b" * 32, "name": "agent.run", "start_time": 1.0}
    assert validate_batch({"worker": "w", "spans": [root]}, 10, span_model=OtlpSpanIn).rejected == []
    [rejection] = validate_batch({"worker": "w", "spans": [root]}, 10).rejected
    assert rejection.field == "spans[0].trace_id"
    assert SpanIn.model_validate({**root, "trace_id": "a" * 32}).trace_id == "a" * 32
    with pytest.raises(ValueError):
        OtlpSpanIn.model_validate({**root, "end_time": 0.5})


def test_json_hex_ids_become_protobuf_base64():
    body = {"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": TRACE.hex(), "spanId": SPAN.hex(), "parentSpanId": "", "links": [{"traceId": TRACE.hex(), "spanId": "zz"}]}]}]}]}
    span = hex_ids_to_base64(body)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == "CvdlGRbNQ92ESOshHIAxnA==" and span["spanId"] == "t61rcWkgMzE=" and span["parentSpanId"] == ""
    assert span["links"][0]["spanId"] == ""  # not hex: left for translate() to reject
    assert hex_ids_to_base64([1]) == [1]


def test_weave_takes_an_otlp_root_with_its_own_ids_and_still_refuses_a_tracecar_one():
    otlp_root = {"span_id": "a" * 32, "trace_id": "b" * 32, "parent_id": None, "name": "agent.run", "kind": "op",
                 "start_time": 1.0, "end_time": 2.0, "attributes": {"otel": {"span_id": "a" * 16}}}
    call = to_weave_call(otlp_root, "ent", "proj")
    assert call["parent_id"] is None and call["id"] != call["trace_id"]
    with pytest.raises(SpanError):
        to_weave_call({**otlp_root, "attributes": {}}, "ent", "proj")
