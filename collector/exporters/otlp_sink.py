"""OTLP/HTTP protobuf transport: the ``otlp`` sink, and its ``mlflow`` flavour.

Translation lives in :mod:`.otlp_translate`; this module only pushes a batch and classifies the
answer the way the Forwarder needs it (every span id delivered, retryable or rejected):
408/429/5xx and connection errors are retryable (Retry-After honoured), other 4xx reject the
batch with the server's reason, and a 2xx ``partial_success`` with rejected spans dead-letters
the batch's spans with the server's message (OTLP does not say which spans it refused).

The ``mlflow`` flavour posts to MLflow's OTLP endpoint (``<tracking uri>/v1/traces``, MLflow ≥
3.6) with ``x-mlflow-experiment-id``, and adds the attributes MLflow's UI reads, with the
values JSON-encoded as MLflow's own SDK writes them (``mlflow.tracing.constant.SpanAttributeKey``):
``mlflow.spanInputs`` / ``mlflow.spanOutputs`` (the span's inputs and output, like VERL's mlflow
backend's ``span.set_inputs`` / ``set_outputs``) and ``mlflow.spanType``.

Header values (tokens) never reach logs: errors name the status and the server's reason only.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..shape import is_tool, token_output
from .forward import RawJSON, SendResult
from .otlp_translate import to_otlp_request

log = logging.getLogger("tracecar.collector.otlp_sink")

_RETRYABLE = frozenset({408, 429})
_MAX_REASON = 300


def parse_headers(raw: str | None) -> dict[str, str]:
    """``k1=v1,k2=v2`` (the OTEL_EXPORTER_OTLP_HEADERS form) as a dict; a part without ``=`` is refused."""
    out: dict[str, str] = {}
    for number, part in enumerate((raw or "").split(","), 1):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():  # the part itself may be a bare token: never echo it
            raise ValueError(f"part {number} has no 'name=value' (expected k1=v1,k2=v2)")
        out[key.strip()] = value.strip()
    return out


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


def _plain(span: Mapping[str, Any]) -> dict[str, Any]:
    """A spooled span with its raw-JSON inputs/output parsed (the translation reads them)."""
    out = dict(span)
    for key in ("inputs", "output"):
        if isinstance(out.get(key), RawJSON):
            out[key] = out[key].parse()
    return out


class OtlpSink:
    """Pushes spans as one OTLP/HTTP protobuf request per batch (gzip)."""

    name = "otlp"

    def __init__(self, endpoint: str, *, headers: Mapping[str, str] | None = None, content: bool = False,
                 timeout_s: float = 10.0, service_name: str = "tracecar", client: httpx.AsyncClient | None = None) -> None:
        self.endpoint = endpoint
        self.content = content
        self.service_name = service_name
        base = {"content-type": "application/x-protobuf", "content-encoding": "gzip", **(headers or {})}
        self.client = client or httpx.AsyncClient(timeout=timeout_s, headers=base)

    def extra_attributes(self, span: Mapping[str, Any], aggregates: bool) -> Mapping[str, Any]:
        """Destination-specific attributes added to each span (none for plain OTLP)."""
        return {}

    def encode(self, spans: Sequence[Mapping[str, Any]]) -> bytes:
        request = to_otlp_request([_plain(s) for s in spans], service_name=self.service_name, content=self.content,
                                  extra=self.extra_attributes)
        return gzip.compress(request.SerializeToString(), compresslevel=5)

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        ids = [s["span_id"] for s in spans]
        if not ids:
            return SendResult()
        body = self.encode(spans)
        try:
            response = await self.client.post(self.endpoint, content=body)
        except httpx.HTTPError as exc:
            return SendResult(retryable=ids, retry_reason=f"{self.name}: {type(exc).__name__} posting to the OTLP endpoint")
        status = response.status_code
        if status in _RETRYABLE or status >= 500:
            return SendResult(retryable=ids, retry_after=_retry_after(response),
                              retry_reason=f"{self.name}: HTTP {status} {response.reason_phrase}")
        if status >= 400:
            reason = f"{self.name}: HTTP {status}: {response.text[:_MAX_REASON]}"
            return SendResult(rejected={i: reason for i in ids})
        return self._partial(response, ids)

    def _partial(self, response: httpx.Response, ids: list[str]) -> SendResult:
        """A 2xx answer; ``partial_success.rejected_spans`` > 0 dead-letters the batch with its message."""
        answer = ExportTraceServiceResponse()
        try:
            if response.content and "json" not in response.headers.get("content-type", ""):
                answer.ParseFromString(response.content)
        except Exception:  # an unparsable 2xx body is still an acceptance
            return SendResult(delivered=ids)
        rejected = answer.partial_success.rejected_spans
        if rejected <= 0:
            return SendResult(delivered=ids)
        reason = (f"{self.name}: partial success, {rejected} of {len(ids)} spans rejected: "
                  f"{answer.partial_success.error_message[:_MAX_REASON]}")
        if rejected >= len(ids):
            return SendResult(rejected={i: reason for i in ids}, refused=rejected, refused_reason=reason)
        # OTLP does not name the refused spans: keep them all delivered; the forwarder counts and logs the refusal
        return SendResult(delivered=ids, refused=rejected, refused_reason=reason)

    async def aclose(self) -> None:
        await self.client.aclose()


def mlflow_span_type(span: Mapping[str, Any], aggregates: bool) -> str:
    """MLflow's SpanType for a tracecar span: AGENT (trajectory), LLM, TOOL, else CHAIN."""
    kind, name, output = span.get("kind", ""), span.get("name", ""), span.get("output")
    if kind == "trajectory":
        return "AGENT"
    if token_output(kind, output) and not aggregates:
        return "LLM"
    if is_tool(kind, name, output):
        return "TOOL"
    return "CHAIN" if aggregates else "UNKNOWN"


class MlflowSink(OtlpSink):
    """OTLP to MLflow's ``/v1/traces`` with the experiment header and MLflow's span attributes."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment_id: str, *, headers: Mapping[str, str] | None = None,
                 timeout_s: float = 10.0, max_content_chars: int = 1_000_000, client: httpx.AsyncClient | None = None) -> None:
        self.max_content_chars = max_content_chars
        super().__init__(tracking_uri.rstrip("/") + "/v1/traces", headers={**(headers or {}), "x-mlflow-experiment-id": experiment_id},
                         content=False, timeout_s=timeout_s, client=client)

    def _json(self, value: Any) -> str:
        text = orjson.dumps(value, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()
        limit = self.max_content_chars
        return text if len(text) <= limit else orjson.dumps(text[:limit] + f"…[truncated by tracecar: {len(text) - limit} chars]").decode()

    def extra_attributes(self, span: Mapping[str, Any], aggregates: bool) -> Mapping[str, Any]:
        out = {"mlflow.spanType": orjson.dumps(mlflow_span_type(span, aggregates)).decode(),
               "mlflow.spanInputs": self._json(span.get("inputs")),
               "mlflow.spanOutputs": self._json(span.get("output"))}
        if span.get("kind") == "trajectory":  # VERL's mlflow backend sets its attributes as trace tags
            out["mlflow.spanFunctionName"] = orjson.dumps(span.get("name", "")).decode()
        return out


def resolve_experiment_id(tracking_uri: str, name: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> str:
    """An MLflow experiment id from its name (created when missing), through MLflow's REST API."""
    base = tracking_uri.rstrip("/") + "/api/2.0/mlflow/experiments"
    with httpx.Client(timeout=timeout_s, headers=dict(headers)) as client:
        got = client.get(base + "/get-by-name", params={"experiment_name": name})
        if got.status_code == 200:
            return str(got.json()["experiment"]["experiment_id"])
        made = client.post(base + "/create", json={"name": name})
        if made.status_code != 200:
            raise RuntimeError(f"backend=mlflow: cannot find or create experiment {name!r} at {tracking_uri}: "
                               f"HTTP {made.status_code}: {made.text[:_MAX_REASON]}")
        return str(made.json()["experiment_id"])


def make_otlp_sink(settings: Any, metrics: Any = None, spool: Any = None) -> OtlpSink:
    """The ``otlp`` sink from settings (the fan-out registry's factory signature)."""
    if not settings.otlp_endpoint:
        raise RuntimeError("backend=otlp needs TRACECAR_OTLP_ENDPOINT (the full /v1/traces URL)")
    headers = parse_headers(settings.otlp_headers.get_secret_value() if settings.otlp_headers else None)
    return OtlpSink(settings.otlp_endpoint, headers=headers, content=settings.otlp_content, timeout_s=settings.otlp_timeout_s)


def make_mlflow_sink(settings: Any, metrics: Any = None, spool: Any = None) -> MlflowSink:
    """The ``mlflow`` sink from settings; an experiment name is resolved to its id at startup."""
    uri = settings.mlflow_tracking_uri
    if not uri or not uri.startswith(("http://", "https://")):
        raise RuntimeError("backend=mlflow needs TRACECAR_MLFLOW_TRACKING_URI (http(s) URL of an MLflow >= 3.6 server)")
    headers = parse_headers(settings.otlp_headers.get_secret_value() if settings.otlp_headers else None)
    experiment = settings.mlflow_experiment_id or resolve_experiment_id(
        uri, settings.mlflow_experiment_name or "tracecar", headers, settings.otlp_timeout_s)
    return MlflowSink(uri, experiment, headers=headers, timeout_s=settings.otlp_timeout_s)
