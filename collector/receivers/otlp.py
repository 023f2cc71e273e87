"""OTLP/HTTP receiver: ``POST /v1/traces`` from vLLM, SGLang or any OpenTelemetry SDK.

Spans go through the same pipeline as tracecar's own (validated one by one, sampled, spooled,
acknowledged only once durable, 503 + Retry-After under backpressure, the same token), so
every guarantee of ``/v1/spans`` holds. What differs is the edge, which follows the OTLP/HTTP
specification: protobuf (``application/x-protobuf``) or OTLP/JSON (``application/json``, ids
in hex), gzip/deflate/zstd; the answer is an ``ExportTraceServiceResponse`` in the request's
encoding, whose ``partial_success`` counts the rejected spans and names why; errors carry a
``google.rpc.Status``. An empty request is 200, an unparsable one 400, another type 415.

A span that joins a tracecar trajectory (see :mod:`.otlp_translate` for the ids) takes the
trajectory's worker, project and budget attributes (experiment, step, sample_index,
rollout_n, validate; :mod:`.joins`), so sampling keeps or drops it with its trajectory and it
is exported to the same project.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tracecar.client.redact import REDACTED, RedactKeys
from tracecar.client.traceparent import TRACESTATE_KEY
from tracecar.client.tracing import MARK  # the place mark the Weave sink reads

from ..metrics import Metrics
from ..processors.validate import EnvelopeError, Rejection, Validated, validate_batch
from ..types import Span
from . import agent_loop, receive
from .engine_hold import EngineHold
from .joins import OTLP_WORKER_PREFIX, TrajectoryContext, TrajectoryContexts, rekey, request_id_of
from .otlp_translate import OtlpSpanIn, Translated, hex_ids_to_base64, translate
from .otlp_wire import WireError, count_spans
from .pipeline import Backpressure, IngestResult
from .receive import BodyError

PROTOBUF = "application/x-protobuf"
_PLACE = re.compile(r"top|[0-9a-f]{32}(\.[0-9a-f]{32})?")
JSON = "application/json"
_PROTOBUF_TYPES = frozenset({PROTOBUF, "application/protobuf", "application/vnd.google.protobuf"})
_JSON_TYPES = frozenset({JSON, "text/json"})
_MAX_MESSAGES = 10  # rejections spelled out in partial_success.error_message
_SPAN_FIELD = re.compile(r"^spans\[(\d+)\]")
# gRPC status codes for google.rpc.Status bodies
_CODES = {400: 3, 401: 16, 413: 8, 415: 3, 422: 3, 503: 14}


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def too_many_spans(count: int | str, max_batch_spans: int) -> BodyError:
    """More spans than TRACECAR_MAX_BATCH_SPANS: a size bound, 413 (as on /v1/spans), so an exporter splits."""
    return BodyError(413, "resourceSpans", f"{count} spans exceed TRACECAR_MAX_BATCH_SPANS={max_batch_spans}; split the batch")


def parse_request(body: bytes | bytearray, content_type: str | None, max_batch_spans: int | None = None,
                  containers: int | None = None) -> Any:
    """The body as an ``ExportTraceServiceRequest``; 415 for another type, 400 when unparsable.

    With ``max_batch_spans``, a protobuf body's spans are counted on the wire before it is parsed
    (:mod:`.otlp_wire`) and more than that many are a 413; with ``containers``, an OTLP/JSON body
    is refused (413) before parsing when it may hold more objects and arrays (receive.parse's rule).
    """
    media = media_type(content_type)
    request = ExportTraceServiceRequest()
    if media in _PROTOBUF_TYPES:
        if max_batch_spans is not None:
            try:
                count = count_spans(body, max_batch_spans)
            except WireError as exc:
                raise BodyError(400, "body", f"invalid OTLP protobuf: {exc}") from None
            if count > max_batch_spans:
                raise too_many_spans(f"more than {max_batch_spans}", max_batch_spans)
        try:
            request.ParseFromString(body)  # type: ignore[arg-type]  # any buffer; the stubs say bytes
        except (DecodeError, ValueError) as exc:
            raise BodyError(400, "body", f"invalid OTLP protobuf: {exc}") from None
        return request
    if media in _JSON_TYPES:
        if containers is not None:
            receive.check_json_containers(body, containers)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BodyError(400, "body", f"invalid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BodyError(400, "body", f"expected an ExportTraceServiceRequest object, got {type(data).__name__}")
        try:
            json_format.ParseDict(hex_ids_to_base64(data), request, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, TypeError) as exc:
            raise BodyError(400, "body", f"invalid OTLP/JSON: {_without_values(str(exc))}") from None
        return request
    raise BodyError(415, "Content-Type", f"unsupported content type {media or None!r}; OTLP/HTTP takes {PROTOBUF} or {JSON}")


_PARSED_FIELD = re.compile(r"Failed to parse (\w+) field")
_AT_PATH = re.compile(r" at (ExportTraceServiceRequest[\w.\[\]]*)")


def _without_values(message: str) -> str:
    """protobuf's parse error as the field it failed on and where, never the value (its messages quote
    a client's value, and an attribute's value may be a secret: an answer never echoes one)."""
    fields = _PARSED_FIELD.findall(message)
    at = _AT_PATH.search(message)
    where = f" at {at.group(1).rstrip('.')}" if at is not None else ""
    if not fields:
        return f"not an ExportTraceServiceRequest{where} (the value is not echoed)"
    return f"field {'.'.join(fields)}{where}: a value of the wrong type or form (not echoed)"


class OtlpRequest:
    """One request's receive stage: parse, translate, validate, join to stored trajectories.

    Kept per request so that the answer can name each rejected span by its place in the
    request (``resourceSpans[0].scopeSpans[0].spans[3]``) and its OTel span id.
    """

    def __init__(self, contexts: TrajectoryContexts, metrics: Metrics, max_decompressed_bytes: int, max_batch_spans: int,
                 redact: RedactKeys, hold: EngineHold | None = None) -> None:
        self.contexts = contexts
        self.hold = hold
        self.redact = redact  # the collector's redact keys: OTLP attributes may carry secrets too
        self.metrics = metrics
        self.max_decompressed_bytes = max_decompressed_bytes
        self.max_batch_spans = max_batch_spans
        self.translated = Translated()
        self.held_requests: dict[str, str] = {}  # own trace id -> request id of parentless engine spans that wait
        self.protocol: dict[str, tuple[str | None, str]] = {}  # RL-Insight agent-loop spans: span id -> (project, worker)

    def __call__(self, body: bytes, content_type: str | None, content_encoding: str | None) -> Validated:
        data = receive.decompress(body, content_encoding, self.max_decompressed_bytes)
        request = parse_request(data, content_type, self.max_batch_spans, receive.max_containers(self.max_decompressed_bytes))
        spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        if spans > self.max_batch_spans:  # OTLP/JSON (protobuf was counted on the wire): still before translating
            raise too_many_spans(spans, self.max_batch_spans)
        self.translated = translated = translate(request)
        for raw_span in translated.spans:
            redact_dotted(raw_span.get("attributes"), self.redact)
        self.protocol = agent_loop.adapt(translated)  # RL-Insight's agent-loop spans: tracecar trajectories
        # the bound was checked on the request's own spans; the reward annotations adapt() added come on top
        validated = validate_batch({"worker": OTLP_WORKER_PREFIX.rstrip(":"), "spans": translated.spans},
                                   max(self.max_batch_spans, len(translated.spans)), self.redact, span_model=OtlpSpanIn)
        positions = translated.indices  # validated indices -> positions in the request
        for rejection in validated.rejected:
            rejection.index = positions[rejection.index]
        validated.rejected = translated.rejected + validated.rejected
        for span_id, notes in translated.warnings.items():
            if span_id in validated.index_of:
                validated.warnings.setdefault(span_id, []).extend(notes)
        validated.index_of = {sid: positions[i] for sid, i in validated.index_of.items()}
        services = {translated.spans[i]["span_id"]: translated.services[i] for i in range(len(translated.spans))}
        for span in validated.spans:
            own = self.protocol.get(span["span_id"])
            if own is not None:  # a trajectory of its own making: its project, one worker for its budget
                span["project"], span["worker"] = own[0], own[1][:256]
                continue
            service = services.get(span["span_id"])
            span["worker"] = (OTLP_WORKER_PREFIX + service)[:256] if service else OTLP_WORKER_PREFIX.rstrip(":")
        self._join(validated)
        return validated

    def _join(self, validated: Validated) -> None:
        """Spans of a tracecar trajectory take its worker, project and budget attributes; a span
        whose trajectory is not known yet waits for it (:mod:`.engine_hold`). A parentless engine
        span that names its request (``gen_ai.request.id``) is first put under the call that sent
        it (:func:`.joins.rekey`), or waits for that call."""
        found: dict[str, tuple[TrajectoryContext | None, str]] = {}
        joined: dict[str, int] = {}
        self.held_requests = {}
        requests = self.contexts.requests
        protocol = self.protocol
        for span in validated.spans:
            if span.get("parent_id") is not None or span["span_id"] in protocol or (request_id := request_id_of(span)) is None:
                continue
            call = requests.lookup(request_id)
            if call is not None:
                rekey(span, call)
                self.metrics.otlp_request_joins.labels(outcome="joined").inc()
            elif self.hold is not None and self.hold.should_hold_request(span):
                validated.awaiting.add(span["span_id"])
                self.held_requests[span["trace_id"]] = request_id
        validated.foreign_roots = {s["trace_id"] for s in validated.spans if s.get("parent_id") is None
                                   and s["trace_id"] not in self.held_requests and s["span_id"] not in protocol}
        for span in validated.spans:
            if span["span_id"] in protocol:  # RL-Insight's agent loop: it carries its own trajectory's attributes
                continue
            if span["trace_id"] in self.held_requests:
                place_in_weave_tree(span)
                continue
            trace_id = span["trace_id"]
            if trace_id not in found:
                found[trace_id] = self.contexts.lookup(trace_id)
            context, source = found[trace_id]
            joined[source] = joined.get(source, 0) + 1
            if context is not None:
                context.apply(span)
            elif self.hold is not None and self.hold.should_hold(span, False, validated.foreign_roots):
                validated.awaiting.add(span["span_id"])
            place_in_weave_tree(span)  # the trace state says where it goes, even before its trajectory is seen
        for source, count in joined.items():
            self.metrics.otlp_spans.labels(joined=source).inc(count)

    def describe(self, rejection: Rejection) -> str:
        """One rejection in the request's own terms."""
        t = self.translated
        where = t.locations[rejection.index] if 0 <= rejection.index < t.total else f"span {rejection.index}"
        otel_id = t.otel_ids[rejection.index] if 0 <= rejection.index < t.total else None
        field = _SPAN_FIELD.sub("", rejection.field).lstrip(".")  # "spans[3].end_time" -> "end_time"
        head = f"{where} (spanId {otel_id})" if otel_id else where
        return f"{head}: {field + ': ' if field else ''}{rejection.reason}"


def export_response(result: IngestResult, request: OtlpRequest) -> ExportTraceServiceResponse:
    response = ExportTraceServiceResponse()
    if result.rejected:
        messages = [request.describe(r) for r in result.rejected[:_MAX_MESSAGES]]
        more = len(result.rejected) - len(messages)
        response.partial_success.rejected_spans = len(result.rejected)
        response.partial_success.error_message = "; ".join(messages) + (f"; and {more} more" if more > 0 else "")
    return response


def encode(message: Any, content_type: str | None, status: int, headers: dict[str, str] | None = None) -> Response:
    """The message in the request's encoding (JSON unless the request was protobuf)."""
    if media_type(content_type) in _PROTOBUF_TYPES:
        return Response(message.SerializeToString(), status_code=status, headers=headers, media_type=PROTOBUF)
    body = orjson.dumps(json_format.MessageToDict(message))
    return Response(body, status_code=status, headers=headers, media_type=JSON)


def status_response(status: int, message: str, content_type: str | None, headers: dict[str, str] | None = None) -> Response:
    return encode(status_pb2.Status(code=_CODES.get(status, 2), message=message), content_type, status, headers)


def build_router(collector: Any, auth: Callable[..., Any], read_body: Callable[[Request, int], Awaitable[bytes | bytearray]]) -> APIRouter:
    """``POST /v1/traces`` on ``collector``'s pipeline, behind the same token as ``/v1/spans``."""
    router = APIRouter()

    @router.post("/v1/traces", dependencies=[Depends(auth)])
    async def otlp_traces(request: Request) -> Response:
        """OTLP/HTTP trace export (protobuf or JSON)."""
        started = time.perf_counter()
        try:
            response = await _export(request, collector, read_body)
        except Exception:
            collector.metrics.requests.labels(status="500").inc()  # a bug answered 500 by the server: counted too
            raise
        collector.metrics.requests.labels(status=str(response.status_code)).inc()
        collector.metrics.ingest_seconds.observe(time.perf_counter() - started)
        return response

    return router


async def _export(request: Request, collector: Any, read_body: Callable[[Request, int], Awaitable[bytes | bytearray]]) -> Response:
    settings, metrics = collector.settings, collector.metrics
    content_type = request.headers.get("content-type")
    retry = {"Retry-After": str(settings.retry_after_s)}
    if not collector.ready:
        return status_response(503, "collector is not ready (starting or draining)", content_type, retry)
    otlp = OtlpRequest(collector.pipeline.contexts, metrics, settings.max_decompressed_bytes, settings.max_batch_spans,
                       collector.pipeline.redact_keys, collector.pipeline.hold)
    try:
        collector.pipeline.check_capacity()
        async with collector.pipeline.permit():  # before the body is read, as on /v1/spans: that is what bounds memory
            body = await read_body(request, settings.max_body_bytes)
            if not body:
                return encode(ExportTraceServiceResponse(), content_type, 200)
            result = await collector.pipeline.ingest(body, content_type, request.headers.get("content-encoding"),
                                                     receiver=otlp)
    except Backpressure as exc:
        metrics.backpressure.labels(bound=exc.bound).inc()
        return status_response(503, str(exc), content_type, retry)
    except BodyError as exc:
        metrics.batches_rejected.labels(reason=exc.field.lower()).inc()
        return status_response(exc.status, f"{exc.field}: {exc.reason}", content_type)
    except EnvelopeError as exc:
        metrics.batches_rejected.labels(reason="envelope").inc()
        return status_response(400, f"{exc.field}: {exc.reason}", content_type)
    return encode(export_response(result, otlp), content_type, 200)


def place_in_weave_tree(span: Span) -> None:
    """An engine span of a tracecar trajectory gets the client's place mark from its trace state.

    ``trace_headers()`` put ``tracecar=top|<root>|<root>.<turn>`` in the W3C tracestate, which the
    engine's SDK copied onto its span: the Weave sink then roots and threads the span as VERL's
    tree has it (under the same top-level call as its ``generate`` parent). No entry: the span
    keeps no mark and is sent as before.
    """
    otel = span["attributes"].get("otel")
    state = otel.get("trace_state") if isinstance(otel, dict) else None
    if not isinstance(state, str):
        return
    entry = next((item.strip()[len(TRACESTATE_KEY) + 1:] for item in state.split(",")
                  if item.strip().startswith(TRACESTATE_KEY + "=")), None)
    if not entry or not _PLACE.fullmatch(entry):
        return
    if entry == "top":
        mark: dict[str, Any] = {"top": True}
    elif "." in entry:
        root, turn = entry.split(".", 1)
        mark = {"root": root, "turn": turn}
    else:
        mark = {"root": entry, "turn": span["span_id"]}  # under a top-level call: a turn of its own
    span["attributes"][MARK] = mark


def redact_dotted(attrs: Any, redact: RedactKeys) -> None:
    """OpenTelemetry names attributes with dots (``http.request.header.authorization``,
    ``llm.api_key``): a name whose last segment is a redact key has its value replaced, at any
    depth of the span's attributes, and so of everything kept under ``otel`` (resource, scope,
    events, links, set-aside and the span's own ``otel`` attribute, nested key-value lists).
    Free text a producer may have formatted a secret into (the status message, an ``exception``
    event's message and stack trace) is scrubbed as an exception's text is."""
    _redact_dotted(attrs, redact, 0)
    otel = attrs.get("otel") if isinstance(attrs, dict) else None
    if not isinstance(otel, dict):
        return
    status = otel.get("status")
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        status["message"] = redact.scrub_text(status["message"])
    for event in otel.get("events") or ():
        event_attrs = event.get("attributes") if isinstance(event, dict) else None
        if isinstance(event_attrs, dict):
            for key in ("exception.message", "exception.stacktrace"):
                if isinstance(event_attrs.get(key), str):
                    event_attrs[key] = redact.scrub_text(event_attrs[key])


def _redact_dotted(value: Any, redact: RedactKeys, depth: int) -> None:
    if depth > _MAX_REDACT_DEPTH:  # deeper values are refused by validation (the store keeps 254 levels)
        return
    if isinstance(value, dict):
        for key in list(value):
            if isinstance(key, str) and key.rsplit(".", 1)[-1] in redact:
                value[key] = REDACTED
            else:
                _redact_dotted(value[key], redact, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _redact_dotted(item, redact, depth + 1)


_MAX_REDACT_DEPTH = 256
