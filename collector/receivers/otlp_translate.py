"""OTLP spans → tracecar spans: ids, attributes, status and events, one span at a time.

Pure data work (no I/O), so the receiver can run it in a worker thread and unit tests can
drive it directly.

Ids. Every OTLP span is stored with ``trace_id`` = the OTLP trace id (32 hex) and
``span_id`` = ``trace_id[:16] + span id`` (32 hex), its parent likewise. In a trace that a
tracecar client started, ``trace_id[:16]`` is the trajectory root's process prefix and the
``traceparent`` parent-id the client gave is the counter of a tracecar span
(:mod:`tracecar.client.traceparent`), so the rebuilt parent *is* that span's id: an engine
span lands as a child of the ``generate`` call that caused it, with no lookup. The same rule
keeps OTLP spans of one trace linked to each other, whatever batch they arrive in. The OTel
ids themselves are kept under ``attributes["otel"]``.

A root from another OTLP producer (no parent) keeps its ids, so its ``span_id`` differs from
its ``trace_id``: tracecar's own rule (a root's ``trace_id == span_id``) is relaxed for OTLP
spans only (:class:`OtlpSpanIn`), never for ``/v1/spans``.

Attributes. The span's attributes stay flat under their own keys (``gen_ai.usage.prompt_tokens``);
OTLP-only facts go under ``attributes["otel"]``: ``span_id``, ``parent_span_id``, ``kind``,
``status``, ``trace_state``, ``resource`` (the resource's attributes), ``scope`` (name,
version, attributes), ``events`` and ``links``; an attribute tracecar reads with a type
(``step``, ``sample_index``, ``rollout_n``, ``validate``, ``experiment_name``) that has
another type is set aside under ``set_aside`` with a warning instead of costing the span. An ``ERROR`` status becomes the span's
``exception`` (with the ``exception`` event's type, message and stack trace when there is one).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import model_validator

from ..processors.validate import Rejection, SpanIn

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_MAX_NAME = 512  # SpanIn's bound on names
# attributes tracecar reads with a type (budgets, the store's columns): another type is set aside
_TYPED = {"step": (int,), "sample_index": (int, str), "rollout_n": (int,), "validate": (bool,), "experiment_name": (str,)}


class OtlpSpanIn(SpanIn):
    """A span translated from OTLP: tracecar's checks, except that a root may keep its own ids."""

    @model_validator(mode="after")
    def _links(self) -> OtlpSpanIn:
        if self.parent_id == self.span_id:
            raise ValueError("parent_id: a span cannot be its own parent")
        if self.end_time is not None and self.end_time < self.start_time:
            raise ValueError("end_time: ends before it starts")
        return self


@dataclass
class Translated:
    """Spans in tracecar's wire form, with where each came from in the request."""

    spans: list[dict[str, Any]] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # each span's position in the request
    services: list[str | None] = field(default_factory=list)  # each span's resource service.name
    rejected: list[Rejection] = field(default_factory=list)  # spans with unusable ids ("spans[<position>].spanId")
    warnings: dict[str, list[str]] = field(default_factory=dict)  # by tracecar span id: what was changed to store it
    # per position in the request: "resourceSpans[0].scopeSpans[1].spans[2]" and the OTel span id
    locations: list[str] = field(default_factory=list)
    otel_ids: list[str | None] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.locations)


def any_value(value: Any, depth: int = 0) -> Any:
    """An OTLP ``AnyValue`` as plain JSON data (bytes as base64; nesting bounded)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    if depth >= 32:
        return repr(value)[:1024]
    if which == "array_value":
        return [any_value(v, depth + 1) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    return None


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


def _hex_id(raw: bytes, size: int) -> str | None:
    """The id as lowercase hex, or None when it is not ``size`` bytes or is all zeros."""
    if len(raw) != size or not any(raw):
        return None
    return raw.hex()


def _exception_text(status: Any, events: list[dict[str, Any]]) -> str | None:
    """An error status (and the ``exception`` event, if any) as tracecar's exception string."""
    exc_event = next((e for e in events if e["name"] == "exception"), None)
    if status.code != 2:
        return None
    if exc_event is not None:
        attrs = exc_event["attributes"]
        kind, message = attrs.get("exception.type"), attrs.get("exception.message")
        text = f"{kind}: {message}" if kind else str(message or status.message or "ERROR")
        trace = attrs.get("exception.stacktrace")
        return f"{text}\n{trace}" if isinstance(trace, str) and trace else text
    return status.message or "ERROR"


def iter_spans(request: Any) -> Iterator[tuple[str, Any, Any, Any]]:
    """(location, resource_spans, scope_spans, span) for every span of an export request."""
    for r, rs in enumerate(request.resource_spans):
        for s, ss in enumerate(rs.scope_spans):
            for k, span in enumerate(ss.spans):
                yield f"resourceSpans[{r}].scopeSpans[{s}].spans[{k}]", rs, ss, span


def translate(request: Any) -> Translated:
    """Every span of an ``ExportTraceServiceRequest`` in tracecar's wire form.

    A span whose ids cannot be used is a rejection here (it names the OTLP field); everything
    else is checked afterwards by the same validation as ``/v1/spans``.
    """
    out = Translated()
    resources: dict[int, tuple[dict[str, Any], str | None]] = {}
    scopes: dict[int, dict[str, Any]] = {}
    for location, rs, ss, span in iter_spans(request):
        index = out.total
        trace_id = _hex_id(span.trace_id, 16)
        span_hex = _hex_id(span.span_id, 8)
        out.locations.append(location)
        out.otel_ids.append(span.span_id.hex() or None)
        if trace_id is None or span_hex is None:
            name = "traceId" if trace_id is None else "spanId"
            size = 16 if trace_id is None else 8
            out.rejected.append(Rejection(index, span.span_id.hex() or None, f"spans[{index}].{name}",
                                          f"must be {size} bytes ({2 * size} hex characters), not all zero"))
            continue
        parent_hex = None
        if span.parent_span_id:
            parent_hex = _hex_id(span.parent_span_id, 8)
            if parent_hex is None:
                out.rejected.append(Rejection(index, span_hex, f"spans[{index}].parentSpanId",
                                              "must be empty or 8 bytes (16 hex characters), not all zero"))
                continue
        if id(rs) not in resources:
            res_attrs = attributes(rs.resource.attributes)
            service = res_attrs.get("service.name")
            resources[id(rs)] = (res_attrs, service if isinstance(service, str) else None)
        if id(ss) not in scopes:
            scopes[id(ss)] = {"name": ss.scope.name, "version": ss.scope.version, "attributes": attributes(ss.scope.attributes)}
        res_attrs, service = resources[id(rs)]
        events = [{"name": e.name, "time": e.time_unix_nano / 1e9, "attributes": attributes(e.attributes)} for e in span.events]
        otel: dict[str, Any] = {
            "span_id": span_hex, "parent_span_id": parent_hex, "kind": _KINDS.get(span.kind, str(span.kind)),
            "status": {"code": _STATUS.get(span.status.code, str(span.status.code)), "message": span.status.message},
            "resource": res_attrs, "scope": scopes[id(ss)],
        }
        if span.trace_state:
            otel["trace_state"] = span.trace_state
        if events:
            otel["events"] = events
        if span.links:
            otel["links"] = [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(), "attributes": attributes(link.attributes)}
                             for link in span.links]
        attrs = attributes(span.attributes)
        prefix = trace_id[:16]
        notes: list[str] = []
        for key, types in _TYPED.items():
            value = attrs.get(key)
            if value is not None and (type(value) not in types):
                otel.setdefault("set_aside", {})[key] = attrs.pop(key)
                notes.append(f"attributes.{key}: a {type(value).__name__} is kept as attributes.otel.set_aside.{key} "
                             f"(tracecar reads {key} as {types[0].__name__})")
        if "otel" in attrs:
            otel["attribute"] = attrs.pop("otel")
            notes.append("attributes.otel: the span's own 'otel' attribute is kept as attributes.otel.attribute")
        if "tracecar" in attrs:  # reserved for the place mark tracecar sets itself (never a producer's)
            otel["tracecar_attribute"] = attrs.pop("tracecar")
            notes.append("attributes.tracecar: reserved; the span's own 'tracecar' attribute is kept as attributes.otel.tracecar_attribute")
        attrs["otel"] = otel
        if len(span.name) > _MAX_NAME:
            notes.append(f"name: {len(span.name)} characters cut to {_MAX_NAME}")
        if notes:
            out.warnings[prefix + span_hex] = notes
        out.spans.append({
            "span_id": prefix + span_hex,
            "trace_id": trace_id,
            "parent_id": None if parent_hex is None else prefix + parent_hex,
            "name": span.name[:_MAX_NAME],
            "kind": "op",
            "start_time": span.start_time_unix_nano / 1e9,
            "end_time": span.end_time_unix_nano / 1e9 if span.end_time_unix_nano else None,
            "attributes": attrs,
            "inputs": {},
            "output": None,
            "exception": _exception_text(span.status, events),
        })
        out.indices.append(index)
        out.services.append(service)
    return out


# ---- OTLP/JSON ------------------------------------------------------------------------------
_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def hex_ids_to_base64(body: Any) -> Any:
    """OTLP/JSON writes ids as hex, protobuf's JSON mapping reads bytes as base64: convert.

    An id that is not hex becomes empty, which :func:`translate` then rejects for that span.
    """
    if not isinstance(body, dict):
        return body
    for rs in _list(body.get("resourceSpans", body.get("resource_spans"))):
        for ss in _list(rs.get("scopeSpans", rs.get("scope_spans")) if isinstance(rs, dict) else None):
            for span in _list(ss.get("spans") if isinstance(ss, dict) else None):
                if not isinstance(span, dict):
                    continue
                _convert_ids(span)
                for link in _list(span.get("links")):
                    if isinstance(link, dict):
                        _convert_ids(link)
    return body


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _convert_ids(obj: dict[str, Any]) -> None:
    for key in _ID_KEYS:
        value = obj.get(key)
        if isinstance(value, str):
            try:
                obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                obj[key] = ""
