"""OTLP/HTTP protobuf transport: the ``otlp`` sink, and its ``mlflow`` flavour.

Translation lives in :mod:`.otlp_translate`; this module only pushes a batch and classifies the
answer the way the Forwarder needs it (every span id delivered, retryable or rejected):
408/429/5xx and connection errors are retryable (Retry-After honoured), other 4xx reject the
batch with the server's reason, and a 2xx ``partial_success`` with rejected spans dead-letters
the batch's spans with the server's message (OTLP does not say which spans it refused).

The ``mlflow`` flavour posts to MLflow's OTLP endpoint (``<tracking uri>/v1/traces``, MLflow ≥
3.6) with ``x-mlflow-experiment-id`` (per span project, as VERL's ``mlflow.set_experiment``), and
adds the attributes MLflow's UI reads, with the values JSON-encoded as MLflow's own SDK writes
them (``mlflow.tracing.constant.SpanAttributeKey``): ``mlflow.spanInputs`` / ``mlflow.spanOutputs``
(like VERL's mlflow backend's ``span.set_inputs`` / ``set_outputs``), ``mlflow.spanType``,
``mlflow.spanLogLevel`` and, on the trajectory root, ``mlflow.traceTag.*`` (VERL's trace tags).

Header values (tokens) never reach logs: errors name the status and the server's reason only.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..shape import is_engine
from .forward import RawJSON, SendResult, translating
from .otlp_translate import engine_io, role_of, to_otlp_request

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
    genai = True  # OpenTelemetry GenAI conventions (gen_ai.*) on every span
    ok_status = False  # OTel's rule: a span that did not fail stays UNSET
    openinference = True  # OpenInference's kind, input/output and token counts (Phoenix's columns)
    engine_resource = True  # engine spans under their own resource and scope

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
                                  extra=self.extra_attributes, genai=self.genai,
                                  ok_status=self.ok_status, openinference=self.openinference,
                                  engine_resource=self.engine_resource)
        return gzip.compress(request.SerializeToString(), compresslevel=5)

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        if not spans:
            return SendResult()
        return await self._post(spans)

    async def _post(self, spans: Sequence[Mapping[str, Any]], headers: Mapping[str, str] | None = None) -> SendResult:
        """One export request for ``spans``; the answer classified per span id."""
        ids = [s["span_id"] for s in spans]
        with translating():  # a span it cannot take is isolated and dead-lettered by the forwarder
            body = self.encode(spans)
        try:
            response = await self.client.post(self.endpoint, content=body, headers=headers)
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
    """MLflow's SpanType for a tracecar span (``TRACECAR_MLFLOW_SPAN_TYPES=typed``): AGENT
    (trajectory, an agent loop's run), LLM (also one that raised), TOOL (real tool calls only),
    else CHAIN for a call with children and UNKNOWN for a leaf or an engine span."""
    if is_engine(dict(span)):
        return "UNKNOWN"
    role = role_of(span, aggregates)
    if role == "CHAIN" and not aggregates:
        return "UNKNOWN"
    return role


# VERL's rollout_trace_attr attributes, which its mlflow backend sets as trace tags (str(value))
VERL_TRACE_TAGS = ("sample_index", "step", "rollout_n", "validate", "experiment_name")
# MLflow's SpanLogLevel: what MLflow's SDK stamps on an UNKNOWN span, and on one with an exception
_LOG_DEBUG, _LOG_ERROR = 10, 40
DEFAULT_EXPERIMENT = "tracecar"


class MlflowSink(OtlpSink):
    """OTLP to MLflow's ``/v1/traces`` with the experiment header and MLflow's span attributes.

    The attributes reproduce what VERL's own mlflow backend (``verl/utils/rollout_trace.py``)
    makes MLflow show: a trajectory root without inputs/outputs whose VERL attributes become
    trace tags (``mlflow.traceTag.<key>``, read by MLflow's OTLP ingest), ops with the bound
    arguments as inputs and the return value as outputs (none when it raised), every span type
    ``UNKNOWN`` (``span_types="typed"`` types them AGENT/LLM/TOOL/CHAIN instead).

    The experiment is ``experiment_id`` when given, else the one named ``experiment_name``, else
    the one named by each span's project, as VERL's ``mlflow.set_experiment(project_name)``
    does; names are resolved (created when missing) through MLflow's REST API, once each.
    """

    name = "mlflow"
    ok_status = True  # MLflow's SDK ends a span that returned with status OK
    openinference = False  # MLflow translates OpenInference attributes into its own: VERL's view has none
    engine_resource = False  # MLflow makes trace tags of a resource: tracecar's, whichever span comes first

    def __init__(self, tracking_uri: str, experiment_id: str | None = None, *, experiment_name: str | None = None,
                 span_types: str = "verl", headers: Mapping[str, str] | None = None, timeout_s: float = 10.0,
                 max_content_chars: int = 1_000_000, client: httpx.AsyncClient | None = None) -> None:
        self.max_content_chars = max_content_chars
        self.tracking_uri = tracking_uri.rstrip("/")
        self.experiment_id, self.experiment_name, self.span_types = experiment_id, experiment_name, span_types
        self._experiments: dict[str, str] = {}  # name -> id
        self.genai = span_types == "typed"  # VERL's view has no sessions or token usage
        super().__init__(self.tracking_uri + "/v1/traces", headers=headers, content=False, timeout_s=timeout_s,
                         client=client)

    def _json(self, value: Any) -> str:
        text = orjson.dumps(plain_objects(value), default=repr, option=orjson.OPT_NON_STR_KEYS).decode()
        limit = self.max_content_chars
        return text if len(text) <= limit else orjson.dumps(text[:limit] + f"…[truncated by tracecar: {len(text) - limit} chars]").decode()

    def extra_attributes(self, span: Mapping[str, Any], aggregates: bool) -> Mapping[str, Any]:
        failed = bool(span.get("exception"))
        typed = self.span_types == "typed"
        out: dict[str, Any] = {"mlflow.spanType": orjson.dumps(mlflow_span_type(span, aggregates) if typed else "UNKNOWN").decode()}
        if not typed:
            out["mlflow.spanLogLevel"] = _LOG_ERROR if failed else _LOG_DEBUG
        if span.get("kind") == "trajectory":  # VERL's root: no inputs/outputs, its attributes as trace tags
            attributes = span.get("attributes") or {}
            out["mlflow.traceTag.mlflow.traceName"] = orjson.dumps(str(span.get("name", ""))).decode()
            for key in VERL_TRACE_TAGS:
                if attributes.get(key) is not None:
                    out[f"mlflow.traceTag.{key}"] = orjson.dumps(_verl_str(attributes[key])).decode()
            return out
        if is_engine(dict(span)):  # vLLM's llm_request: its gen_ai.* request and response values, not {} / null
            inputs, outputs = engine_io(span)
            out["mlflow.spanInputs"], out["mlflow.spanOutputs"] = self._json(inputs), self._json(outputs)
            return out
        if span.get("inputs") is not None:
            out["mlflow.spanInputs"] = self._json(span.get("inputs"))
        if not failed:
            out["mlflow.spanOutputs"] = self._json(span.get("output"))
        return out

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        """One request per experiment the batch's spans go to."""
        groups: dict[str, list[Mapping[str, Any]]] = {}
        for span in spans:
            groups.setdefault(self.experiment_name or str(span.get("project") or DEFAULT_EXPERIMENT), []).append(span)
        result = SendResult()
        for experiment, group in groups.items():
            try:
                experiment_id = self.experiment_id or await self._experiment_id(experiment)
            except ExperimentError as exc:
                part = SendResult(rejected={s["span_id"]: str(exc) for s in group})
            except httpx.HTTPError as exc:
                part = SendResult(retryable=[s["span_id"] for s in group],
                                  retry_reason=f"mlflow: {type(exc).__name__} resolving experiment {experiment!r}")
            else:
                part = await self._post(group, {"x-mlflow-experiment-id": experiment_id})
            result = _combined(result, part)
        return result

    async def _experiment_id(self, name: str) -> str:
        known = self._experiments.get(name)
        if known is None:
            known = self._experiments[name] = await resolve_experiment_id_async(self.client, self.tracking_uri, name)
        return known


_ENVELOPE = ("_type", "_class_name", "_bases")


def plain_objects(value: Any, depth: int = 0) -> Any:
    """Values without weave's object envelope (``_type``/``_class_name``/``_bases``, which the
    client keeps for Weave): a pydantic model or dataclass as its fields, as MLflow's
    ``TraceJSONEncoder`` (``model_dump()``) writes it."""
    if depth > 64:
        return value
    if isinstance(value, dict):
        envelope = "_class_name" in value and "_bases" in value and value.get("_type") == value.get("_class_name")
        return {k: plain_objects(v, depth + 1) for k, v in value.items() if not (envelope and k in _ENVELOPE)}
    if isinstance(value, list):
        return [plain_objects(v, depth + 1) for v in value]
    return value


def _combined(a: SendResult, b: SendResult) -> SendResult:
    """Two requests' results as one: id lists and maps joined, counts added, the largest
    Retry-After, the latest reason (field by field, so new SendResult fields combine too)."""
    out = {}
    for f in dataclasses.fields(SendResult):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, list):
            out[f.name] = x + y
        elif isinstance(x, dict):
            out[f.name] = {**x, **y}
        elif f.name == "retry_after":
            out[f.name] = y if x is None else x if y is None else max(x, y)
        elif isinstance(x, int) and isinstance(y, int) and not isinstance(x, bool):
            out[f.name] = x + y
        else:
            out[f.name] = y if y is not None else x
    return SendResult(**out)


def _verl_str(value: Any) -> str:
    """``str(value)`` as VERL's ``mlflow.set_trace_tag(trace_id, key, str(value))`` writes it."""
    return str(value)


class ExperimentError(RuntimeError):
    """MLflow refused to find or create an experiment (a 4xx): retrying will not help."""


_EXPERIMENTS_API = "/api/2.0/mlflow/experiments"


async def resolve_experiment_id_async(client: httpx.AsyncClient, tracking_uri: str, name: str) -> str:
    """An MLflow experiment id from its name, created when missing (as ``mlflow.set_experiment``).

    Raises ``httpx.HTTPError`` for what may pass (connection, 5xx), ``ExperimentError`` for a refusal.
    """
    base = tracking_uri.rstrip("/") + _EXPERIMENTS_API
    for _ in range(2):  # a concurrent creator may win the create: look again once
        got = await client.get(base + "/get-by-name", params={"experiment_name": name})
        if got.status_code == 200:
            return str(got.json()["experiment"]["experiment_id"])
        if got.status_code >= 500:
            got.raise_for_status()
        made = await client.post(base + "/create", json={"name": name}, headers={"content-type": "application/json"})
        if made.status_code == 200:
            return str(made.json()["experiment_id"])
        if made.status_code >= 500:
            made.raise_for_status()
        if "RESOURCE_ALREADY_EXISTS" not in made.text:
            break
    raise ExperimentError(f"mlflow: cannot find or create experiment {name!r}: HTTP {made.status_code}: "
                          f"{made.text[:_MAX_REASON]}")


def resolve_experiment_id(tracking_uri: str, name: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> str:
    """An MLflow experiment id from its name (created when missing), through MLflow's REST API."""
    base = tracking_uri.rstrip("/") + _EXPERIMENTS_API
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
    """The ``mlflow`` sink from settings; a configured experiment name is resolved to its id at startup
    (a wrong server fails the start); without one, each span's project names its experiment."""
    uri = settings.mlflow_tracking_uri
    if not uri or not uri.startswith(("http://", "https://")):
        raise RuntimeError("backend=mlflow needs TRACECAR_MLFLOW_TRACKING_URI (http(s) URL of an MLflow >= 3.6 server)")
    headers = parse_headers(settings.otlp_headers.get_secret_value() if settings.otlp_headers else None)
    experiment = settings.mlflow_experiment_id or (
        resolve_experiment_id(uri, settings.mlflow_experiment_name, headers, settings.otlp_timeout_s)
        if settings.mlflow_experiment_name else None)
    return MlflowSink(uri, experiment, span_types=settings.mlflow_span_types, headers=headers,
                      timeout_s=settings.otlp_timeout_s)
