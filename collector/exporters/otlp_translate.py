"""tracecar spans → OTLP spans with OpenTelemetry GenAI semantic conventions (translation only).

The push (HTTP, retries, a delivery cursor) is the exporter's transport and lives apart, as
the OpenTelemetry Collector's exporterhelper keeps senders apart from the translation; this
module is pure data work so any OTLP destination (Phoenix, Langfuse, Tempo, MLflow, Weave's
``/otel/v1/traces``) can share it and tests can read what it makes.

Ids. The trace id is the 32-hex tracecar trace id as 16 bytes (a trajectory's root span id: the
worker process's 64-bit random prefix and a counter). Every span id that leaves, tracecar's
own and an OTLP span's alike, is ``BLAKE2b-64(trace id, full tracecar span id)``
(:func:`span_id_bytes`): the full id holds the process's random prefix (a v3 short id is
expanded before anything reads it), so ids from different worker processes, hosts and
collectors never collide, as W3C asks and as backends that keep one span per span id
(Phoenix, Tempo, ClickHouse schemas) need; and it is a pure function of the stored ids, so a
resend, a restart or another collector maps the same span to the same id (no table anywhere).
A parent goes through the same function, so an engine span whose ``traceparent`` named its
``generate`` (stored as that span's full id by the receiver) points at the ``generate`` that
left. An OTLP span's own OTel span id therefore does not leave as it came (its kind, status,
resource and scope do); a counter alone, as sent before, repeats in every process.

GenAI conventions (``gen_ai.*``, the names of semantic-conventions 1.37):

* a trajectory root is ``invoke_agent``; an LLM call (an op whose output carries generated
  tokens and that aggregates no other call, the viewer's rule) is ``chat`` with
  ``gen_ai.usage.input_tokens`` / ``output_tokens`` from its token ids; a tool call is
  ``execute_tool`` with ``gen_ai.tool.name``;
* every span carries ``gen_ai.conversation.id`` = the trajectory id;
* content (``gen_ai.input.messages`` / ``gen_ai.output.messages`` for LLM calls: the whole
  conversation the model read, system, user, assistant and tool turns, in the conventions'
  parts shape (genai_messages.py); and the span's inputs and output as ``tracecar.inputs`` /
  ``tracecar.output`` JSON) only when asked.

tracecar's own attributes go under ``tracecar.`` (``tracecar.step``, ``tracecar.reward``...),
nested values as OTLP arrays and key-value lists.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from tracecar.client.tracing import MARK  # the collector's place mark: internal, never exported

from ..shape import call_role, token_counts
from .genai_messages import input_messages, openinference_messages, output_messages

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_KINDS = frozenset({"UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"})  # SpanKind names minus SPAN_KIND_
_STATUS = frozenset({"UNSET", "OK", "ERROR"})  # StatusCode names minus STATUS_CODE_
SCOPE_NAME = "tracecar"
_MAX_DEPTH = 16


_UINT64_MAX = 2**64 - 1


def unix_nano(seconds: Any) -> int:
    """Seconds since the epoch as OTLP's uint64 nanoseconds, clamped to that range (validation keeps
    span times well inside it; an event's time from a stored ``attributes.otel`` may be anything)."""
    try:
        ns = int(float(seconds) * 1e9)
    except (TypeError, ValueError, OverflowError):  # not a number, NaN, inf
        return 0
    return min(max(ns, 0), _UINT64_MAX)


def trace_id_bytes(trace_id: str) -> bytes:
    """A tracecar trace id as an OTLP trace id (16 bytes)."""
    return bytes.fromhex(trace_id) if _HEX32.match(trace_id) else _hash(trace_id, 16)


def span_id_bytes(span_id: str, trace_id: str) -> bytes:
    """A tracecar span id as an OTLP span id: 8 non-zero bytes of BLAKE2b over the trace id and
    the full span id (globally unique because the full id carries the worker process's random
    prefix; deterministic, so a resend maps to the same id)."""
    return _hash(f"{trace_id}/{span_id}", 8)


def _hash(value: str, size: int) -> bytes:
    digest = hashlib.blake2b(value.encode(), digest_size=size).digest()
    return digest if any(digest) else b"\x01" * size


def any_value(value: Any, depth: int = 0) -> AnyValue:
    """Plain JSON data as an OTLP ``AnyValue`` (nesting bounded; anything else as its repr)."""
    out = AnyValue()
    if value is None:
        return out
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            out.int_value = value
        else:
            out.string_value = str(value)
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, (bytes, bytearray)):
        out.bytes_value = bytes(value)
    elif depth >= _MAX_DEPTH:
        out.string_value = repr(value)[:4096]
    elif isinstance(value, (list, tuple)):
        out.array_value.values.extend(any_value(v, depth + 1) for v in value)
    elif isinstance(value, dict):
        out.kvlist_value.values.extend(KeyValue(key=str(k), value=any_value(v, depth + 1)) for k, v in value.items())
    else:
        out.string_value = repr(value)[:4096]
    return out


def _key_values(attributes: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attributes.items() if v is not None]


def _own_children(span_id: str, children: Mapping[str, list[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    return [c for c in children.get(span_id, ()) if not isinstance((c.get("attributes") or {}).get("otel"), dict)]


def role_of(span: Mapping[str, Any], aggregates: bool) -> str:
    """AGENT / LLM / TOOL / CHAIN (:func:`tracecar.collector.shape.call_role`)."""
    return call_role(span.get("kind", ""), span.get("name", ""), span.get("output"), aggregates=aggregates,
                     failed=bool(span.get("exception")))


def genai_attributes(span: Mapping[str, Any], *, aggregates: bool, content: bool,
                     max_content_chars: int = 1_000_000) -> dict[str, Any]:
    """The ``gen_ai.*`` attributes of one tracecar span (``aggregates``: it has tracecar children)."""
    kind, name, output = span.get("kind", ""), span.get("name", ""), span.get("output")
    out: dict[str, Any] = {"gen_ai.conversation.id": span.get("trace_id")}
    role = role_of(span, aggregates)
    if kind == "trajectory":
        out["gen_ai.operation.name"] = "invoke_agent"
        out["gen_ai.agent.name"] = name
    elif role == "LLM" and not isinstance(output, dict):  # an LLM call that raised: a chat all the same
        out["gen_ai.operation.name"] = "chat"
        messages = input_messages(span.get("inputs"), None, max_content_chars) if content else None
        if messages is not None:  # the messages it was given, when it was given messages (no decoded prompt)
            out["gen_ai.input.messages"] = orjson.dumps(messages, default=str).decode()
    elif role == "LLM" and isinstance(output, dict):
        out["gen_ai.operation.name"] = "chat"
        prompt_tokens, response_tokens = token_counts(dict(span))
        if prompt_tokens is not None:
            out["gen_ai.usage.input_tokens"] = prompt_tokens
        if response_tokens is not None:
            out["gen_ai.usage.output_tokens"] = response_tokens
        stop = output.get("stop_reason", output.get("finish_reason"))
        if isinstance(stop, str):
            out["gen_ai.response.finish_reasons"] = [stop]
        if content:  # the conversation the model read and what it wrote (genai_messages.py)
            messages = input_messages(span.get("inputs"), output.get("prompt_text"), max_content_chars)
            if messages is not None:
                out["gen_ai.input.messages"] = orjson.dumps(messages, default=str).decode()
            answer = output_messages(output.get("response_text"), stop, max_content_chars)
            if answer is not None:
                out["gen_ai.output.messages"] = orjson.dumps(answer, default=str).decode()
    elif role == "TOOL":
        out["gen_ai.operation.name"] = "execute_tool"
        out["gen_ai.tool.name"] = tool_name(name)
    return out


def tool_name(name: str) -> str:
    """``CalculatorTool.execute`` -> ``CalculatorTool``; a free function -> its name."""
    owner, _, method = name.rpartition(".")
    return (owner or method).rsplit(".", 1)[-1]


# OpenInference (Arize Phoenix, and the backends that read its names): what fills Phoenix's
# span kind, input, output and token count columns (openinference-semantic-conventions 0.1.42)
OI_KIND, OI_JSON = "openinference.span.kind", "application/json"
OI_PROJECT = "openinference.project.name"  # a resource attribute: the Phoenix project (tracecar's project)
TRAJECTORY_INPUTS = ("experiment_name", "step", "sample_index", "rollout_n", "validate")
ENGINE_INPUT_PREFIXES = ("gen_ai.request.", "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens", "gen_ai.system",
                         "gen_ai.operation.", "gen_ai.prompt")
ENGINE_OUTPUT_PREFIXES = ("gen_ai.response.", "gen_ai.usage.", "gen_ai.latency.", "gen_ai.completion")


def trajectory_io(span: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trajectory root's input (VERL's ``rollout_trace_attr`` values) and output (its status, the
    error that ended it, its reward when known by the time it leaves): what Phoenix lists as the
    trace's input and output."""
    attrs = span.get("attributes") or {}
    inputs = {k: attrs[k] for k in TRAJECTORY_INPUTS if attrs.get(k) is not None}
    output: dict[str, Any] = {"status": "ERROR" if span.get("exception") else "OK"}
    if span.get("exception"):
        output["error"] = str(span["exception"]).partition("\n")[0]
    if attrs.get("reward") is not None:
        output["reward"] = attrs["reward"]
    return inputs, output


def engine_io(span: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An engine span's (vLLM's ``llm_request``) ``gen_ai.*`` values as inputs (the request:
    id, sampling parameters, prompt tokens) and outputs (the response: usage, finish reasons,
    latencies), ``gen_ai.`` left off the names; an error status adds ``error``."""
    attrs = span.get("attributes") or {}
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for key, value in attrs.items():
        if not key.startswith("gen_ai.") or key == "gen_ai.conversation.id":
            continue
        if key.startswith(ENGINE_INPUT_PREFIXES):
            inputs[key[len("gen_ai."):]] = value
        elif key.startswith(ENGINE_OUTPUT_PREFIXES):
            outputs[key[len("gen_ai."):]] = _json_list(value)
        else:
            inputs[key[len("gen_ai."):]] = value
    if span.get("exception"):
        outputs["error"] = str(span["exception"]).partition("\n")[0]
    return inputs, outputs


def _json_list(value: Any) -> Any:
    """vLLM writes ``finish_reasons`` as JSON text (``'["stop"]'``): shown as the list it is."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def openinference_attributes(span: Mapping[str, Any], *, aggregates: bool, engine: bool, content: bool,
                             max_content_chars: int) -> dict[str, Any]:
    """OpenInference's span kind, input/output (JSON) and LLM token counts for one span.

    An engine span is a ``CHAIN`` under its ``generate`` (the LLM call, which carries the same
    tokens: counting them twice would double Phoenix's per-trace totals); its input and output
    are its ``gen_ai.*`` values (structure and usage, so sent with content off too)."""
    if engine:
        request, response = engine_io(span)
        return {OI_KIND: "CHAIN", "input.value": _json(request, max_content_chars), "input.mime_type": OI_JSON,
                "output.value": _json(response, max_content_chars), "output.mime_type": OI_JSON}
    role = role_of(span, aggregates)
    out: dict[str, Any] = {OI_KIND: role}
    if role == "LLM":
        prompt_tokens, response_tokens = token_counts(dict(span))
        if prompt_tokens is not None:
            out["llm.token_count.prompt"] = prompt_tokens
        if response_tokens is not None:
            out["llm.token_count.completion"] = response_tokens
        if prompt_tokens is not None and response_tokens is not None:
            out["llm.token_count.total"] = prompt_tokens + response_tokens
        raw = span.get("output")
        result: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
        if content:  # the conversation, as Phoenix's LLM view lists it
            asked = input_messages(span.get("inputs"), result.get("prompt_text"), max_content_chars)
            answer = output_messages(result.get("response_text"), result.get("stop_reason", result.get("finish_reason")),
                                     max_content_chars)
            out.update(openinference_messages("llm.input_messages", asked or []))
            out.update(openinference_messages("llm.output_messages", answer or []))
    elif role == "TOOL":
        out["tool.name"] = tool_name(span.get("name", ""))
    if content:
        inputs: Any
        output: Any
        if span.get("kind") == "trajectory":
            inputs, output = trajectory_io(span)
        else:
            inputs = span.get("inputs")
            exception = span.get("exception")
            output = {"error": str(exception).partition("\n")[0]} if exception and span.get("output") is None \
                else span.get("output")
        out.update({"input.value": _json(inputs, max_content_chars), "input.mime_type": OI_JSON,
                    "output.value": _json(output, max_content_chars), "output.mime_type": OI_JSON})
    return out


def _exception_event(text: str, at_ns: int, info: Any = None) -> tuple[str, trace_pb2.Span.Event]:
    first, _, trace = text.partition("\n")
    kind, sep, message = first.partition(": ")
    attrs = {"exception.type": kind if sep else "Exception", "exception.message": message if sep else first}
    stacktrace = trace or _stacktrace(info, first)
    if stacktrace:
        attrs["exception.stacktrace"] = stacktrace
    return first, trace_pb2.Span.Event(name="exception", time_unix_nano=at_ns, attributes=_key_values(attrs))


def _stacktrace(info: Any, last_line: str) -> str | None:
    """The client's traceback frames (``exception_info``) in Python's own traceback text."""
    frames = info.get("traceback") if isinstance(info, Mapping) else None
    if not isinstance(frames, list) or not frames:
        return None
    lines = ["Traceback (most recent call last):"]
    for f in frames:
        if isinstance(f, Mapping):
            lines.append(f'  File "{f.get("filename")}", line {f.get("line_number")}, in {f.get("function_name")}')
            if f.get("text"):
                lines.append(f"    {f['text']}")
    lines.append(last_line)
    return "\n".join(lines)


def _json(value: Any, limit: int) -> str:
    text = orjson.dumps(value, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()
    return text if len(text) <= limit else text[:limit] + f"…[truncated by tracecar: {len(text) - limit} chars]"


def to_otlp_span(span: Mapping[str, Any], *, aggregates: bool = False, content: bool = False,
                 max_content_chars: int = 1_000_000, genai: bool = True, ok_status: bool = False,
                 openinference: bool = False) -> trace_pb2.Span:
    """One stored tracecar span (not an annotation) as an OTLP span (``genai``: with ``gen_ai.*``;
    ``ok_status``: a call that returned is ``STATUS_CODE_OK``, as MLflow's SDK marks it, not UNSET;
    ``openinference``: with OpenInference's kind, input/output and token counts, what Phoenix shows)."""
    trace_id, span_id, parent = span["trace_id"], span["span_id"], span.get("parent_id")
    attrs = dict(span.get("attributes") or {})
    otel = attrs.pop("otel", None)
    attrs.pop(MARK, None)  # the collector's place mark (where a span sits in Weave's tree): internal
    start_ns = unix_nano(span["start_time"])
    end = span.get("end_time")
    out = trace_pb2.Span(trace_id=trace_id_bytes(trace_id), name=span["name"], start_time_unix_nano=start_ns,
                         end_time_unix_nano=unix_nano(end) if isinstance(end, (int, float)) else start_ns)
    if isinstance(otel, dict):  # came in over OTLP: its own ids, kind and status go back out
        out.span_id = span_id_bytes(span_id, trace_id)  # the same derivation as tracecar's own: parents resolve
        out.parent_span_id = span_id_bytes(parent, trace_id) if parent else b""
        out.kind = trace_pb2.Span.SpanKind.Value("SPAN_KIND_" + str(otel.get("kind"))) if str(otel.get("kind")) in _KINDS \
            else trace_pb2.Span.SPAN_KIND_INTERNAL
        status = otel.get("status") or {}
        code = str(status.get("code"))
        out.status.code = (trace_pb2.Status.StatusCode.Value("STATUS_CODE_" + code) if code in _STATUS
                           else trace_pb2.Status.STATUS_CODE_UNSET)
        out.status.message = str(status.get("message") or "")
        if isinstance(otel.get("trace_state"), str):
            out.trace_state = otel["trace_state"]
        for event in otel.get("events") or ():
            if isinstance(event, dict):
                out.events.append(trace_pb2.Span.Event(name=str(event.get("name", "")),
                                                       time_unix_nano=unix_nano(event.get("time") or 0),
                                                       attributes=_key_values(event.get("attributes") or {})))
        engine_values = {**attrs, "gen_ai.conversation.id": trace_id} if genai else attrs
        if openinference:
            engine_values.update(openinference_attributes(span, aggregates=False, engine=True, content=content,
                                                          max_content_chars=max_content_chars))
        out.attributes.extend(_key_values(engine_values))
        return out
    out.span_id = span_id_bytes(span_id, trace_id)
    if parent:
        out.parent_span_id = span_id_bytes(parent, trace_id)
    out.kind = trace_pb2.Span.SPAN_KIND_INTERNAL
    exception = span.get("exception")
    if ok_status and not exception:
        out.status.code = trace_pb2.Status.STATUS_CODE_OK
    if isinstance(exception, str) and exception:
        message, event = _exception_event(exception, out.end_time_unix_nano, span.get("exception_info"))
        out.status.code, out.status.message = trace_pb2.Status.STATUS_CODE_ERROR, message
        out.events.append(event)
    values: dict[str, Any] = (genai_attributes(span, aggregates=aggregates, content=content, max_content_chars=max_content_chars)
                              if genai else {})
    values.update({f"tracecar.{k}": v for k, v in attrs.items()})
    for key in ("worker", "project", "kind"):
        if span.get(key) is not None:
            values[f"tracecar.span_{key}" if key == "kind" else f"tracecar.{key}"] = span[key]
    if openinference:
        values.update(openinference_attributes(span, aggregates=aggregates, engine=False, content=content,
                                               max_content_chars=max_content_chars))
    out.attributes.extend(_key_values(values))
    return out


def to_otlp_request(spans: Iterable[Mapping[str, Any]], *, service_name: str = "tracecar", content: bool = False,
                    max_content_chars: int = 1_000_000,
                    extra: Callable[[Mapping[str, Any], bool], Mapping[str, Any]] | None = None,
                    genai: bool = True, ok_status: bool = False, openinference: bool = False,
                    engine_resource: bool = True) -> ExportTraceServiceRequest:
    """Stored spans as one export request: tracecar's under one resource, OTLP ones under their own
    (``engine_resource=False``: under tracecar's too, their resource and scope as the span
    attributes ``tracecar.engine.resource`` / ``tracecar.engine.scope``: MLflow makes a trace's
    tags of the resource of whichever span it sees first).

    Annotations are not spans (rewards merge into the trajectory upstream) and are left out.
    Whether an LLM call aggregates others is judged among the spans given (a whole trajectory
    is the unit the spool forwards). ``extra(span, aggregates)`` adds a destination's own
    attributes (MLflow's ``mlflow.span*``) to each span; ``genai=False`` leaves the ``gen_ai.*``
    conventions out (MLflow reads them into sessions and token usage VERL's backend never shows);
    ``openinference`` adds OpenInference's attributes (:func:`openinference_attributes`).
    """
    rewards = {s["trace_id"]: s["attributes"]["reward"] for s in spans if s.get("kind") == "annotation"
               and type((s.get("attributes") or {}).get("reward")) in (int, float)}  # the latest of the batch wins
    spans = [_with_reward(s, rewards) for s in spans if s.get("kind") != "annotation"]
    children: dict[str, list[Mapping[str, Any]]] = {}
    for s in spans:
        if s.get("parent_id"):
            children.setdefault(s["parent_id"], []).append(s)
    request = ExportTraceServiceRequest()
    groups: dict[bytes, Any] = {}
    for s in spans:
        otel = (s.get("attributes") or {}).get("otel")
        if isinstance(otel, dict) and engine_resource:
            resource = otel.get("resource") or {}
            scope = otel.get("scope") or {}
        else:
            resource, scope = {"service.name": service_name}, {"name": SCOPE_NAME}
        if openinference and s.get("project"):  # Phoenix files a trace under the project of its first span
            resource = {**resource, OI_PROJECT: s["project"]}
        key = orjson.dumps([resource, scope], option=orjson.OPT_SORT_KEYS, default=repr)
        scope_spans = groups.get(key)
        if scope_spans is None:
            rs = request.resource_spans.add()
            rs.resource.attributes.extend(_key_values(resource))
            scope_spans = rs.scope_spans.add()
            scope_spans.scope.name = str(scope.get("name") or "")
            scope_spans.scope.version = str(scope.get("version") or "")
            scope_spans.scope.attributes.extend(_key_values(scope.get("attributes") or {}))
            groups[key] = scope_spans
        aggregates = bool(_own_children(s["span_id"], children))
        out = to_otlp_span(s, aggregates=aggregates, content=content, max_content_chars=max_content_chars, genai=genai,
                           ok_status=ok_status, openinference=openinference)
        if isinstance(otel, dict) and not engine_resource:
            out.attributes.extend(_key_values({"tracecar.engine.resource": otel.get("resource") or None,
                                               "tracecar.engine.scope": (otel.get("scope") or {}).get("name") or None}))
        if extra is not None:
            out.attributes.extend(_key_values(extra(s, aggregates)))
        scope_spans.spans.append(out)
    return request


def _with_reward(span: Mapping[str, Any], rewards: Mapping[str, Any]) -> Mapping[str, Any]:
    """A trajectory root with the reward an annotation of the same batch gave it (when it has none)."""
    reward = rewards.get(span.get("trace_id", "")) if span.get("kind") == "trajectory" else None
    attrs = span.get("attributes") or {}
    if reward is None or attrs.get("reward") is not None:
        return span
    return {**span, "attributes": {**attrs, "reward": reward}}
