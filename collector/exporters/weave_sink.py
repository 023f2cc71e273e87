"""Forward finished spans to W&B Weave the way weave 0.54's own client does, without its cost.

Weave's client sends finished calls in batches to ``POST /v2/{entity}/{project}/calls/complete``
(``RemoteHTTPTraceServer._send_calls_complete_to_server``) with the body ``{"batch": [call, ...]}``,
each call shaped like ``weave.vendor.weave_server_sdk.types.v2_call_complete_params.Batch``.
Its binding spends ~200 µs a call re-encoding through pydantic and the generated client, so this
sink builds the same dicts directly (typed against weave's ``Batch``; tests validate them with
weave's own models), encodes each call once with orjson, packs calls into requests under the
31 MiB limit weave uses, and posts them on one pooled ``httpx.AsyncClient``.

For ops given by name, weave's client publishes an anonymous op (``/file/create`` of a stub
``obj.py`` and ``/obj/create``) and uses its ref URI as ``op_name``; ``publish_ops=True``
(the default) does the same once per (project, op), so the Weave UI lists and filters the ops as
it does for VERL's in-process tracing. ``publish_ops=False`` sends plain names, which the server
also accepts (its OTel ingest does that).

VERL's weave backend makes no call for ``rollout_trace_attr`` (it only sets weave attributes),
so a trajectory root span (kind ``trajectory``, no parent, marked by tracecar's client
``attributes.tracecar.trajectory``) is not sent: its top-level calls,
which tracecar's client marks (``attributes.tracecar.top``), go as trace roots (no parent,
``trace_id`` = their own id), and their descendants name that root as their trace
(``attributes.tracecar.root``). Those descendants carry the trajectory as ``thread_id`` and the
top-level call's child they belong to as ``turn_id``, as if the agent loop ran its body inside
``weave.thread(trajectory id)``. Rewards (annotations) become feedback on the top-level calls,
and tail sampling's ``kept_because`` an attribute of them. Each call names the trainer's W&B run
(``wb_run_id`` ``entity/project/run_id``, ``wb_run_step`` = the trajectory's step) when the
client or the collector knows it.

Nothing here is retried: :meth:`WeaveSink.send` reports each span as delivered, retryable (with
the server's Retry-After) or rejected (with a reason), and the caller's spool decides.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import functools
import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import orjson
import pydantic_core

from tracecar.client.redact import RedactKeys
from tracecar.client.retry_after import parse_retry_after
from tracecar.client.tracing import ENGINE_REQUESTS, MARK  # the client's place mark on a span's attributes

from ..loudness import RateLimited
from .forward import RawJSON, SendResult

if TYPE_CHECKING:  # weave's request model; importing weave at runtime costs ~1.5 s
    from weave.vendor.weave_server_sdk.types.v2_call_complete_params import Batch as WeaveCall
else:
    WeaveCall = dict

logger = logging.getLogger(__name__)

#: weave's REMOTE_REQUEST_BYTES_LIMIT (trace_server_bindings/http_utils.py): 32 MiB less 1 MiB.
DEFAULT_MAX_REQUEST_BYTES = 31 * 2**20
MAX_OP_NAME_LENGTH = 128  # server-side op_name limit (trace_server/constants.py in weave 0.52)
MAX_OBJECT_NAME_LENGTH = 128  # weave/trace/constants.py
MAX_REASON_CHARS = 500
# 401: the key itself is refused, never one span's fault: keep spans pending until it is fixed
RETRYABLE_STATUS = frozenset({401, 408, 429})
# weave splits a batch rejected as too large / invalid; 400 too, so one bad call fails alone
SPLIT_STATUS = frozenset({400, 413, 422})

# The code weave's client stores for an op it only knows by name (weave_client._build_anonymous_op).
ANONYMOUS_OP_CODE = (
    "import weave\n\n@weave.op\ndef op_fn(*args, **kwargs):  # type: ignore\n"
    "    # Code-capture unavailable for this op\n    pass\n"
)


def file_digest(content: bytes) -> str:
    """weave's compute_file_digest (trace/serialization/digest.py), shared with the server."""
    b64 = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).decode()
    return b64.replace("-", "X").replace("_", "Y").rstrip("=")


ANONYMOUS_OP_FILE_DIGEST = file_digest(ANONYMOUS_OP_CODE.encode())

# A datetime in a call's inputs or output is weave's custom type, whose ``load_op`` is the ref of
# the op that loads it, published in the call's project the first time one is sent: the client
# writes the value (tracecar.client.wire.weave_datetime), the sink adds the ref. The op's code is
# what weave 0.54's client stores for its DateTime handler's ``load`` (so the digest, hence the
# ref, is the one weave's own client makes; tests/test_weave_values.py checks it against weave).
LOAD_DATETIME_OP = "load_datetime.datetime"
LOAD_DATETIME_CODE = (
    "import weave\nfrom weave.trace.serialization.mem_artifact import MemTraceFilesArtifact\nfrom typing import Any\n"
    "import datetime\n\n@weave.op\ndef load(artifact: MemTraceFilesArtifact, name: str, val: Any) -> datetime.datetime:\n"
    '    """Deserialize an ISO format string back to a datetime object with timezone."""\n'
    "    return datetime.datetime.fromisoformat(val)\n"
)
_DATETIME_VALUE = b'"weave_type":{"type":"datetime.datetime"},"val":'

_BATCH_HEAD = b'{"batch":['
_BATCH_TAIL = b"]}"
_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
_EXC_RE = re.compile(r"^([A-Za-z_][\w.]*): ?(.*)$", re.DOTALL)
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


MAX_REMEMBERED_TRAJECTORIES = 1 << 16


class SpanError(ValueError):
    """A span that can never become a Weave call (rejected permanently)."""


class TrajectoryLookup(Protocol):
    """What the sink asks the spool about trajectories (see forward.SpoolTrajectories)."""

    def kept_because(self, trace_ids: list[str]) -> dict[str, str]: ...

    def top_calls(self, trace_ids: list[str]) -> dict[str, list[str]]: ...

    def marks(self, span_ids: list[str]) -> dict[str, dict[str, Any]]: ...


def is_elided(span: Mapping[str, Any]) -> bool:
    """A marked trajectory root: tracecar's unit, not a Weave call (VERL's weave backend makes
    none). Unmarked ones (clients before the marks) are sent as calls, with their children under
    them, so their trees stay whole."""
    return span.get("kind") == "trajectory" and span.get("parent_id") is None and _mark(span).get("trajectory") is True


def _mark(span: Mapping[str, Any]) -> dict[str, Any]:
    mark = (span.get("attributes") or {}).get(MARK)
    return mark if isinstance(mark, dict) else {}


def is_top_call(span: Mapping[str, Any]) -> bool:
    """A call directly under a trajectory root: a trace root in Weave."""
    return _mark(span).get("top") is True and span.get("parent_id") == span.get("trace_id")


def needs_placement(span: Mapping[str, Any]) -> bool:
    """An OTLP span joined under a tracecar call (a vLLM ``llm_request`` under ``generate``):
    it carries no place mark, so its Weave trace follows its parent's (:func:`placed_under`)."""
    attrs = span.get("attributes") or {}
    parent = span.get("parent_id")
    return (isinstance(attrs.get("otel"), dict) and MARK not in attrs and isinstance(parent, str)
            and parent != span.get("trace_id"))


def placed_under(span: Mapping[str, Any], parent_id: str, parent_mark: Mapping[str, Any]) -> dict[str, Any] | None:
    """The place mark a span takes from its parent's: under a top-level call, that call is its
    Weave root and the span is a turn of its own; deeper, the parent's root and turn."""
    if parent_mark.get("top") is True:
        return {"root": parent_id, "turn": span.get("span_id")}
    root = parent_mark.get("root")
    if isinstance(root, str) and root:
        turn = parent_mark.get("turn")
        return {"root": root, "turn": turn if isinstance(turn, str) and turn else parent_id}
    return None


def wb_run_id_for(run: str | None, project_id: str) -> str | None:
    """weave's ``entity/project/run_id`` form; a bare run id is placed in the call's project.

    weave's client refuses a run of another project (check_wandb_run_matches), so a full path
    naming another project keeps only its run id.
    """
    if not run:
        return None
    return f"{project_id}/{run.rsplit('/', 1)[-1]}"


# ---------------------------------------------------------------------------------- ids ----
def weave_call_id(span_id: str, start_time: float | None = None) -> str:
    """The Weave call id for ``span_id``: a canonical lowercase UUID string.

    Derived from ``span_id`` alone (``start_time`` is accepted and ignored) because a child
    names its parent and trace only by span id, so time bits taken from a start time would
    not match. A span id that already is a UUIDv7 in hex is used as is (real time bits);
    any other is hashed (BLAKE2b) into a version-8 UUID. Version 8, not 7: the bits hold no
    time, and weave's server notes a plan to read time ranges out of UUIDv7 ids. The server
    accepts any UUID that round-trips through ``uuid.UUID`` (validation.call_id_validator).
    """
    return _call_id(span_id)


@functools.lru_cache(maxsize=1 << 16)  # trace and parent ids repeat across a batch
def _call_id(span_id: str) -> str:
    if _HEX32.match(span_id) and span_id[12] == "7" and span_id[16] in "89ab":
        h = span_id
    else:
        b = bytearray(hashlib.blake2b(span_id.encode(), digest_size=16).digest())
        b[6] = (b[6] & 0x0F) | 0x80  # version 8
        b[8] = (b[8] & 0x3F) | 0x80  # RFC 9562 variant
        h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# ---------------------------------------------------------------------------- mapping ----
def project_id_for(span: Mapping[str, Any], entity: str, project: str) -> str:
    """``entity/project`` for a span, its own ``entity``/``project`` overriding the defaults.

    A span project given as ``entity/project`` carries its entity, as in ``weave.init``.
    """
    proj = span.get("project") or project
    ent = span.get("entity") or entity
    if "/" in proj:
        ent, _, proj = proj.partition("/")
    if not ent or not proj or "/" in ent or "/" in proj:
        raise SpanError(f"invalid Weave project {ent!r}/{proj!r}")
    return f"{ent}/{proj}"


def sanitize_object_name(name: str) -> str:
    """weave_client.sanitize_object_name: the object id weave publishes an op under."""
    res = re.sub(r"([._-]{2,})+", "-", re.sub(r"[^\w._]+", "-", name)).strip("-_")
    if not res:
        raise SpanError(f"op name {name!r} has no usable characters")
    return res[:MAX_OBJECT_NAME_LENGTH]


def plain_op_name(name: str) -> str:
    """An op name the server takes as is: under 128 chars, long ones keep a hash suffix."""
    if len(name) < MAX_OP_NAME_LENGTH:
        return name
    return name[: MAX_OP_NAME_LENGTH - 6] + ":" + hashlib.sha256(name.encode()).hexdigest()[:4]


def exception_json(text: str | None, info: Mapping[str, Any] | None = None) -> str | None:
    """weave's exception_to_json_str form, which the UI renders: the client's type, message and
    traceback frames when it sent them, else our ``"Type: message"`` split in two."""
    if text is None:
        return None
    if isinstance(info, Mapping) and "type" in info and "message" in info:
        return json.dumps(dict(info))  # byte-for-byte what weave sends
    if text.startswith("{"):
        return text  # already weave's JSON form
    m = _EXC_RE.match(text)
    kind, msg = (m.group(1), m.group(2)) if m else ("Exception", text)
    return json.dumps({"type": kind, "message": msg})  # byte-for-byte what weave sends


def _iso(ts: float) -> str:
    """UTC ISO 8601 with microseconds and Z, as weave sends datetimes (pydantic's to_json)."""
    us = round(ts * 1_000_000)
    sec, frac = divmod(us, 1_000_000)
    return f"{_iso_second(sec)}.{frac:06d}Z"


@functools.lru_cache(maxsize=4096)  # spans of one batch share their seconds
def _iso_second(sec: int) -> str:
    return _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def status_counts(spans: Iterable[Mapping[str, Any]],
                  prior: Mapping[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """(success, error) per span over its subtree among ``spans``, as weave's client rolls up.

    Weave reports a call whose descendants failed as ``descendant_error`` from these counts.
    ``prior`` adds, per span id, the counts of its children's subtrees sent earlier (children
    end, and so arrive, before their parents, often in an earlier batch); other descendants not
    in ``spans`` are not counted.
    """
    spans = list(spans)
    prior = prior or {}
    own = {}
    for s in spans:
        ok, err = (0, 1) if s.get("exception") else (1, 0)
        p_ok, p_err = prior.get(s["span_id"], (0, 0))
        own[s["span_id"]] = (ok + p_ok, err + p_err)
    children: dict[str, list[str]] = {}
    for s in spans:
        if s.get("parent_id") in own and s["parent_id"] != s["span_id"]:
            children.setdefault(s["parent_id"], []).append(s["span_id"])
    out: dict[str, tuple[int, int]] = {}

    def total(sid: str, depth: int = 0) -> tuple[int, int]:
        if sid in out:
            return out[sid]
        ok, err = own[sid]
        if depth < 500:  # cycles or absurd depth: stop counting, never recurse forever
            out[sid] = (ok, err)
            for c in children.get(sid, ()):
                c_ok, c_err = total(c, depth + 1)
                ok, err = ok + c_ok, err + c_err
        out[sid] = (ok, err)
        return out[sid]

    for sid in own:
        total(sid)
    return out


def to_weave_call(
    span: Mapping[str, Any],
    entity: str,
    project: str,
    *,
    op_name: str | None = None,
    counts: tuple[int, int] | None = None,
    project_id: str | None = None,
    kept_because: str | None = None,
    wb_run_id: str | None = None,
) -> WeaveCall:
    """One stored span as a calls/complete batch item (weave's ``Batch`` shape).

    ``op_name`` overrides the plain name (e.g. a published op's ref URI); ``counts`` is the
    subtree's (success, error) from :func:`status_counts`, else the span's own status;
    ``project_id`` skips re-deriving it from the span; ``kept_because`` (the tail decision's
    rule) goes on a top-level call; ``wb_run_id`` is the run used when the span names none.
    """
    try:
        span_id, trace_id, name = span["span_id"], span["trace_id"], span["name"]
        start, end = span["start_time"], span.get("end_time")
    except KeyError as e:
        raise SpanError(f"span lacks {e.args[0]!r}") from None
    if not isinstance(span_id, str) or not isinstance(trace_id, str) or not span_id or not trace_id:
        raise SpanError("span_id and trace_id must be non-empty strings")
    if not isinstance(name, str) or not name:
        raise SpanError("span name must be a non-empty string")
    if span.get("kind") not in ("op", "trajectory"):
        raise SpanError(f"span kind {span.get('kind')!r} is not forwarded (annotations merge upstream)")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        raise SpanError("unfinished span: calls/complete needs start_time and end_time")
    parent = span.get("parent_id")
    # OTLP roots keep their own ids (trace_id != span_id; tracecar.collector.receivers.otlp_translate)
    otlp_root = parent is None and isinstance((span.get("attributes") or {}).get("otel"), dict)
    if (parent is None) != (span_id == trace_id) and not otlp_root:
        raise SpanError("a trace root must have no parent_id, and a span without one must be its root")
    if is_elided(span):
        raise SpanError("a trajectory root is not a Weave call (its top-level calls are the roots)")
    exc = span.get("exception")
    if counts is None:
        counts = (0, 1) if exc else (1, 0)
    attributes = dict(span.get("attributes") or {})
    mark = attributes.pop(MARK, None)
    mark = mark if isinstance(mark, dict) else {}
    weave_trace, thread_id, turn_id = trace_id, None, None
    if mark.get("top") is True and parent == trace_id:  # a trajectory's top-level call: a root
        parent, weave_trace = None, span_id
        if kept_because is not None:
            attributes["kept_because"] = kept_because
    elif isinstance(mark.get("root"), str) and mark["root"]:  # under a top-level call
        weave_trace, thread_id = mark["root"], trace_id
        turn = mark.get("turn")
        turn_id = weave_call_id(turn) if isinstance(turn, str) and turn else None
    attributes["tracecar"] = {"span_id": span_id, "trace_id": trace_id, "kind": span["kind"], "worker": span.get("worker")}
    requests = attributes.pop(ENGINE_REQUESTS, None)  # the engine requests a call sent: tracecar's join key, not VERL's
    if requests is not None:
        attributes["tracecar"]["engine_request_ids"] = requests
    client = span.get("client")
    if isinstance(client, dict) and "weave" not in attributes:  # weave's capture_info keys, tracecar's values
        attributes["weave"] = {**client, "worker": span.get("worker")}
    inputs = span.get("inputs")
    if inputs is None:
        inputs = {}
    elif not isinstance(inputs, (dict, RawJSON)):  # RawJSON inputs are an object: validated at ingest
        inputs = {"inputs": inputs}
    display_name = None
    if op_name is None:
        op_name = plain_op_name(name)
    elif op_name.startswith("weave:///") and f"/op/{name}:" not in op_name:
        display_name = name[:1024]  # the published name was sanitized: keep the real one visible
    try:
        started_at, ended_at = _iso(start), _iso(max(end, start))
    except (OverflowError, OSError, ValueError) as e:
        raise SpanError(f"unusable start_time/end_time: {e}") from None
    project_id = project_id or project_id_for(span, entity, project)
    run = wb_run_id_for(span.get("wandb_run_id") or wb_run_id, project_id)
    step = (span.get("attributes") or {}).get("step")
    # the trainer logs step N's metrics at W&B step N; fully-async rollouts (step -1) have none
    run_step = step if run is not None and type(step) is int and step >= 0 else None
    return {
        "project_id": project_id,
        "id": weave_call_id(span_id),
        "trace_id": weave_call_id(weave_trace),
        "op_name": op_name,
        "started_at": started_at,
        "ended_at": ended_at,
        "display_name": display_name,
        "parent_id": None if parent is None else weave_call_id(parent),
        "thread_id": thread_id,
        "turn_id": turn_id,
        "attributes": attributes,
        "inputs": inputs,  # type: ignore[typeddict-item]  # or RawJSON: an object already encoded, that orjson writes as is
        "output": span.get("output"),
        "summary": {"status_counts": {"success": counts[0], "error": counts[1]}},
        "otel_dump": None,
        "exception": exception_json(exc, span.get("exception_info")),
        "wb_user_id": None,
        "wb_run_id": run,
        "wb_run_step": run_step,
        "wb_run_step_end": run_step,
    }


def to_weave_calls(spans: Iterable[Mapping[str, Any]], entity: str, project: str) -> list[WeaveCall]:
    """Spans as calls/complete items with plain op names (trajectory roots left out); raises
    :class:`SpanError` on a bad one."""
    spans = list(spans)
    counts = status_counts(s for s in spans if "span_id" in s)
    return [to_weave_call(s, entity, project, counts=counts.get(s.get("span_id", ""))) for s in spans if not is_elided(s)]


def to_weave_feedback(span: Mapping[str, Any], project_id: str, targets: Iterable[str]) -> list[dict[str, Any]]:
    """An annotation span (a reward attached after the trajectory ended) as Weave feedback.

    Weave fixes a call's attributes when it starts, and the reward is computed after VERL's
    ``run`` returns, so rewards go as feedback (``/feedback/batch/create``, the route weave's
    own client batches feedback to) on each of ``targets``: the span ids of the calls a user
    sees as the trajectory (its top-level calls). Ids derive from the annotation's and the
    target's span ids, so a resend is idempotent.
    """
    return [{
        "id": weave_call_id(f"{span['span_id']}>{target}"),
        "project_id": project_id,
        "weave_ref": f"weave:///{project_id}/call/{weave_call_id(target)}",
        "feedback_type": "tracecar.annotation",
        "payload": dict(span.get("attributes") or {}),
    } for target in targets]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    return str(obj)


def encode_call(call: Mapping[str, Any]) -> bytes:
    """JSON for one call; NaN/inf become null as in weave (``to_json(inf_nan_mode="null")``)."""
    raw = {k: call[k] for k in ("inputs", "output") if isinstance(call.get(k), RawJSON)}
    try:  # spooled inputs/output go in as they were stored (orjson.Fragment), not re-encoded
        spliced = {**call, **{k: orjson.Fragment(bytes(v)) for k, v in raw.items()}} if raw else call
        return orjson.dumps(spliced, default=_json_default, option=_ORJSON_OPTS)
    except TypeError:  # e.g. an int beyond 64 bits: the slower encoder copes
        parsed = {**call, **{k: v.parse() for k, v in raw.items()}}
        return pydantic_core.to_json(parsed, inf_nan_mode="null", bytes_mode="base64", fallback=_json_default)


def batch_body(encoded_calls: Iterable[bytes]) -> bytes:
    """The calls/complete request body for already-encoded calls."""
    return _BATCH_HEAD + b",".join(encoded_calls) + _BATCH_TAIL


def pack(sizes: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """Greedy [start, stop) runs of items whose batch body stays within ``max_bytes``.

    An item too big on its own still goes alone, as weave does; the server has the last word.
    """
    runs: list[tuple[int, int]] = []
    start, total = 0, len(_BATCH_HEAD) + len(_BATCH_TAIL)
    for i, n in enumerate(sizes):
        extra = n + (1 if i > start else 0)
        if i > start and total + extra > max_bytes:
            runs.append((start, i))
            start, total, extra = i, len(_BATCH_HEAD) + len(_BATCH_TAIL), n
        total += extra
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


async def resolve_default_entity(api_key: str, wandb_base_url: str = "https://api.wandb.ai", timeout_s: float = 30.0) -> str | None:
    """The account's default entity, asked the way ``weave.init`` does when given only a project.

    Same GraphQL query as weave (compat/wandb/wandb_thin/internal_api.py, DefaultEntity);
    weave first honours ``WANDB_ENTITY``, which is the caller's to read.
    """
    query = "query DefaultEntity { viewer { username defaultEntity { name } } }"
    auth = "Basic " + base64.b64encode(f"api:{api_key}".encode()).decode()
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        r = await client.post(wandb_base_url.rstrip("/") + "/graphql", json={"query": query}, headers={"Authorization": auth})
    if r.status_code != 200:
        return None
    try:
        return ((r.json().get("data") or {}).get("viewer") or {}).get("defaultEntity", {}).get("name")
    except (ValueError, AttributeError):
        return None


# ------------------------------------------------------------------------------- sink ----
LOAD_OP_RETRY_S = 60.0  # after a refused publish of the datetime load op, calls go without it this long
LOAD_OP_RETRY_TRANSIENT_S = 5.0  # after a retryable failure (a 5xx, a timeout): the backend may be back soon
_FREE_TEXT_REDACT = RedactKeys()  # weave's own redact keys and bearer credentials, in reasons


@dataclass
class _Failure:
    retryable: bool
    reason: str
    retry_after: float | None = None
    status: int | None = None


class WeaveSink:
    """Posts spans to one Weave trace server on a pooled async HTTP client."""

    name = "weave"

    def __init__(
        self,
        *,
        api_key: str,
        entity: str,
        project: str,
        server_url: str,
        timeout_s: float = 30.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        publish_ops: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        wb_run_id: str | None = None,
        trajectories: TrajectoryLookup | None = None,
        redact: RedactKeys | None = None,
    ) -> None:
        """``wb_run_id``: the trainer's W&B run for calls whose batch named none
        (``TRACECAR_WANDB_RUN_ID``); ``trajectories``: the spool, asked for tail decisions'
        ``kept_because`` and for the top-level calls an annotation's feedback goes on."""
        if not api_key:
            raise ValueError("api_key is required")
        project_id_for({}, entity, project)  # entity is required: weave addresses entity/project
        self.entity, self.project = entity, project
        self.max_request_bytes = max_request_bytes
        self.publish_ops = publish_ops
        token = base64.b64encode(f"api:{api_key}".encode()).decode()
        self._secrets = [s for s in (api_key, token) if s]
        self._free_text = redact if redact is not None else _FREE_TEXT_REDACT  # reasons scrubbed with the collector's keys
        self._client = httpx.AsyncClient(
            base_url=server_url.rstrip("/"),
            headers={"Authorization": f"Basic {token}", "User-Agent": "tracecar-weave-sink"},
            timeout=timeout_s,
            transport=transport,
        )
        self.wb_run_id = wb_run_id
        self.trajectories = trajectories
        # trace id -> span ids of its top-level calls sent lately (feedback targets, when the
        # spool no longer holds them: keep_forwarded=false)
        self._tops: OrderedDict[str, list[str]] = OrderedDict()
        # span id -> (success, error) of its children's subtrees already sent (weave's rollup)
        self._sent_counts: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._file_digests: dict[tuple[str, str], str] = {}  # (project_id, code) -> the code file's digest
        self._op_refs: dict[tuple[str, str], str] = {}  # (project_id, name) -> op ref URI
        # project id -> (when publishing the datetime load op last failed, how long to wait before the next try):
        # tried again after a while, not once a call; its failures logged at most once a minute a project
        self._load_op_failed: dict[str, tuple[float, float]] = {}
        self._load_op_failures: dict[str, RateLimited] = {}
        # span id -> place mark of calls sent lately: where a joined engine span goes (its parent's trace)
        self._marks: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> WeaveSink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        """Forward ``spans``; every span id ends up in exactly one field of the result.

        After the first retryable failure nothing more is posted in this call: the rest is
        reported retryable too, so a struggling server is not hit again at once.
        """
        result = SendResult()
        groups: dict[str, list[Mapping[str, Any]]] = {}
        notes: dict[str, list[Mapping[str, Any]]] = {}
        elided: list[str] = []
        for s in spans:
            sid = s.get("span_id")
            if not isinstance(sid, str) or not sid:
                result.rejected[str(sid)] = "span_id must be a non-empty string"
                continue
            try:
                pid = project_id_for(s, self.entity, self.project)
            except SpanError as e:
                result.rejected[sid] = str(e)
                continue
            if is_elided(s):  # tracecar's own unit; its calls are the Weave roots
                elided.append(sid)
                continue
            (notes if s.get("kind") == "annotation" else groups).setdefault(pid, []).append(s)
        await self._place_joined(groups)
        counts = status_counts((s for g in groups.values() for s in g), self._sent_counts)
        tops = [s for g in groups.values() for s in g if is_top_call(s) or s.get("parent_id") is None]
        for s in tops:
            self._remember(s["trace_id"], s["span_id"])
        kept: dict[str, str] = {}
        if tops and self.trajectories is not None:
            kept = await asyncio.to_thread(self.trajectories.kept_because, list({s["trace_id"] for s in tops}))
        stop: _Failure | None = None
        op_refs: dict[str, str] = {}
        for pid, group in groups.items():
            if stop is None:
                op_refs, stop = await self._ops_for(pid, group)
            items: list[tuple[str, bytes]] = []
            for s in group:
                sid = s["span_id"]
                if stop is not None:
                    self._mark(result, [sid], stop)
                    continue
                try:
                    op = op_refs.get(s.get("name"))  # type: ignore[arg-type]
                    call = to_weave_call(s, self.entity, self.project, op_name=op, counts=counts[sid], project_id=pid,
                                         kept_because=kept.get(s["trace_id"]), wb_run_id=self.wb_run_id)
                    encoded = encode_call(call)
                    if _DATETIME_VALUE in encoded:
                        encoded = await self._with_load_op(pid, encoded)
                    items.append((sid, encoded))
                except Exception as e:  # noqa: BLE001 - pure data work on this span alone: whatever it raises, it would again
                    why = str(e) if isinstance(e, SpanError) else f"{type(e).__name__}: {e}"
                    result.rejected[sid] = f"unencodable span: {why}"[:MAX_REASON_CHARS]
            entity, project = pid.split("/", 1)
            url = f"/v2/{entity}/{project}/calls/complete"
            for a, b in pack([len(e) for _, e in items], self.max_request_bytes):
                if stop is not None:
                    self._mark(result, [sid for sid, _ in items[a:b]], stop)
                else:
                    stop = await self._deliver(url, items[a:b], result)
        targets = await self._feedback_targets([s["trace_id"] for g in notes.values() for s in g]) if notes else {}
        for pid, group in notes.items():
            items = []
            for s in group:
                if not s.get("attributes") and isinstance(s.get("output"), dict) and "trainer_tokens" in s["output"]:
                    elided.append(s["span_id"])  # the trainer's batch row (issue 29): read by tracecar, no feedback to give
                    continue
                found = targets.get(s["trace_id"])
                if not found:
                    result.rejected[s["span_id"]] = (
                        f"annotation of trajectory {s['trace_id']}: none of its calls is known to this collector "
                        "(not received, or forwarded before a restart with TRACECAR_KEEP_FORWARDED=false)")[:MAX_REASON_CHARS]
                    continue
                # one request item per annotation: the span is delivered only if all its feedback is
                try:
                    items.append((s["span_id"], b",".join(encode_call(f) for f in to_weave_feedback(s, pid, found))))
                except Exception as e:  # noqa: BLE001 - this annotation's payload alone: it would raise again
                    result.rejected[s["span_id"]] = f"unencodable annotation: {type(e).__name__}: {e}"[:MAX_REASON_CHARS]
            for a, b in pack([len(e) for _, e in items], self.max_request_bytes):
                if stop is not None:
                    self._mark(result, [sid for sid, _ in items[a:b]], stop)
                else:
                    stop = await self._deliver("/feedback/batch/create", items[a:b], result)
        if stop is not None:  # nothing to send for them, but they go (and retry) with their batch
            self._mark(result, elided, stop)
        else:
            result.delivered.extend(elided)
        self._roll_up(result.delivered, {s["span_id"]: s for g in groups.values() for s in g}, counts, elided)
        return result

    def _roll_up(self, delivered: list[str], by_id: dict[str, Mapping[str, Any]],
                 counts: Mapping[str, tuple[int, int]], elided: list[str]) -> None:
        """Remembers delivered calls' subtree counts under their parents, for the parents' rollup
        when they come in a later batch (bounded; a parent is forgotten once sent)."""
        done = set(delivered)
        for sid in delivered:
            span = by_id.get(sid)
            if span is None:
                continue
            self._sent_counts.pop(sid, None)
            parent = span.get("parent_id")
            if parent is None or parent in done:
                continue  # a parent in this batch already counted it
            ok, err = counts.get(sid, (0, 0))
            p_ok, p_err = self._sent_counts.get(parent, (0, 0))
            self._sent_counts[parent] = (p_ok + ok, p_err + err)
            self._sent_counts.move_to_end(parent)
        for sid in elided:
            if sid in done:
                self._sent_counts.pop(sid, None)
        while len(self._sent_counts) > MAX_REMEMBERED_TRAJECTORIES:
            self._sent_counts.popitem(last=False)

    # -- trajectories ---------------------------------------------------------------------
    async def _place_joined(self, groups: dict[str, list[Mapping[str, Any]]]) -> None:
        """Gives each joined OTLP span (an engine span under ``generate``) its parent's place in
        Weave, so it lands in the agent loop's trace rather than in a trace of its own; remembers
        every mark sent. The parent is looked up in the batch, in what was sent lately, then in
        the spool; one not found anywhere leaves the span where its own ids put it."""
        spans = [s for g in groups.values() for s in g]
        marks = {s["span_id"]: m for s in spans if (m := _mark(s))}
        wanted = {s["parent_id"] for s in spans if needs_placement(s)}
        missing = [p for p in wanted if p not in marks and p not in self._marks]
        found: dict[str, dict[str, Any]] = {}
        if missing and self.trajectories is not None:
            found = await asyncio.to_thread(self.trajectories.marks, missing)
        for group in groups.values():
            for i, s in enumerate(group):
                if not needs_placement(s):
                    continue
                parent = s["parent_id"]
                parent_mark = marks.get(parent) or self._marks.get(parent) or found.get(parent)
                place = placed_under(s, parent, parent_mark) if parent_mark else None
                if place is not None:
                    group[i] = {**s, "attributes": {**s["attributes"], MARK: place}}
                    marks[s["span_id"]] = place
        for sid, mark in marks.items():
            self._marks[sid] = mark
            self._marks.move_to_end(sid)
        while len(self._marks) > MAX_REMEMBERED_TRAJECTORIES:
            self._marks.popitem(last=False)

    def _remember(self, trace_id: str, span_id: str) -> None:
        known = self._tops.setdefault(trace_id, [])
        if span_id not in known:
            known.append(span_id)
        self._tops.move_to_end(trace_id)
        while len(self._tops) > MAX_REMEMBERED_TRAJECTORIES:
            self._tops.popitem(last=False)

    async def _feedback_targets(self, trace_ids: list[str]) -> dict[str, list[str]]:
        """Span ids of the calls each trajectory's feedback goes on: its top-level calls.

        The spool knows them while it holds the trajectory (always with keep_forwarded, the
        default); calls sent by this sink lately are remembered too. A trace whose root is an
        op (no trajectory) has that root as its top-level call.
        """
        found: dict[str, list[str]] = {}
        if self.trajectories is not None:
            found = await asyncio.to_thread(self.trajectories.top_calls, list(dict.fromkeys(trace_ids)))
        for t in trace_ids:
            for sid in self._tops.get(t, ()):
                if sid not in found.setdefault(t, []):
                    found[t].append(sid)
        return found

    # -- internals ------------------------------------------------------------------------
    async def _deliver(self, url: str, items: list[tuple[str, bytes]], result: SendResult) -> _Failure | None:
        """POST one batch; a batch refused as a whole (SPLIT_STATUS) is split to find why.

        Returns the failure if it was retryable (the caller stops sending), else None.
        """
        r = await self._post_batch(url, items)
        if r is None:
            result.delivered.extend(sid for sid, _ in items)
            return None
        if r.status in SPLIT_STATUS and len(items) > 1:
            return await self._split(url, items, r, result)
        self._mark(result, [sid for sid, _ in items], r)
        return r if r.retryable else None

    async def _split(self, url: str, items: list[tuple[str, bytes]], fail: _Failure, result: SendResult) -> _Failure | None:
        """Find the calls a refusal was about, as weave's http_utils does.

        Each half is sent once. A 413 keeps halving (sizes shrink); for other refusals, both
        halves refused means the refusal is about every call (a field the server rejects, a
        bad project), so all are rejected without splitting item by item.
        """
        mid = len(items) // 2
        halves = (items[:mid], items[mid:])
        refused: list[tuple[list[tuple[str, bytes]], _Failure]] = []
        for i, half in enumerate(halves):
            r = await self._post_batch(url, half)
            if r is None:
                result.delivered.extend(sid for sid, _ in half)
            elif r.retryable:
                self._mark(result, [sid for h in halves[i:] for sid, _ in h], r)
                return r
            elif r.status in SPLIT_STATUS:
                refused.append((half, r))
            else:
                self._mark(result, [sid for sid, _ in half], r)
        every_call = len(refused) == 2 and fail.status != 413
        for j, (half, r) in enumerate(refused):
            if every_call or len(half) == 1:
                self._mark(result, [sid for sid, _ in half], r)
                continue
            retry = await self._split(url, half, r, result)
            if retry is not None:
                self._mark(result, [sid for h, _ in refused[j + 1:] for sid, _ in h], retry)
                return retry
        return None

    async def _post_batch(self, url: str, items: list[tuple[str, bytes]]) -> _Failure | None:
        r = await self._request(url, content=batch_body(e for _, e in items), headers={"Content-Type": "application/json"})
        return r if isinstance(r, _Failure) else None

    async def _request(self, url: str, **kw: Any) -> httpx.Response | _Failure:
        """POST; a 2xx response, or the failure classified as weave's retry policy does."""
        try:
            r = await self._client.post(url, **kw)
        except httpx.TransportError as e:  # refused, reset, timed out: the server may recover
            return _Failure(True, self._redact(f"{type(e).__name__} on {url}: {e}"))
        if 200 <= r.status_code < 300:
            return r
        retryable = r.status_code in RETRYABLE_STATUS or r.status_code >= 500
        reason = self._redact(f"HTTP {r.status_code} from {url}: {r.text}")
        return _Failure(retryable, reason, parse_retry_after(r.headers.get("Retry-After")), r.status_code)

    async def _ops_for(self, pid: str, group: Sequence[Mapping[str, Any]]) -> tuple[dict[str, str], _Failure | None]:
        """Op names for the group's spans, publishing ops not yet published in ``pid``.

        A publish the server refuses for good falls back to the plain name (kept for the
        sink's life, so one op keeps one name); a retryable failure is returned instead.
        """
        refs: dict[str, str] = {}
        if not self.publish_ops:
            return refs, None
        for name in dict.fromkeys(s.get("name") for s in group):
            if not isinstance(name, str) or not name:
                continue
            ref = self._op_refs.get((pid, name))
            if ref is None:
                got = await self._publish_op(pid, name)
                if isinstance(got, _Failure):
                    if got.retryable:
                        return refs, got
                    logger.warning("weave: sending op %r under its plain name: %s", name, got.reason)
                    got = plain_op_name(name)
                ref = self._op_refs[(pid, name)] = got
            refs[name] = ref
        return refs, None

    async def _with_load_op(self, pid: str, encoded: bytes) -> bytes:
        """A call's JSON with weave's ``load_op`` ref on each datetime value; the op is published in
        the project once. If it cannot be published the values go without the ref (weave's client
        still reads them: the type is one it knows), and the publish is tried again after
        LOAD_OP_RETRY_S (LOAD_OP_RETRY_TRANSIENT_S after a retryable failure), not for every call."""
        if not self.publish_ops:  # plain op names: no op objects, no load op either
            return encoded
        ref = self._op_refs.get((pid, LOAD_DATETIME_OP))
        if ref is None:
            loop = asyncio.get_running_loop()
            failed = self._load_op_failed.get(pid)
            if failed is not None and loop.time() - failed[0] < failed[1]:
                return encoded  # it failed lately: these calls go without it
            got = await self._publish_op(pid, LOAD_DATETIME_OP, LOAD_DATETIME_CODE)
            if isinstance(got, _Failure):
                wait = LOAD_OP_RETRY_TRANSIENT_S if got.retryable else LOAD_OP_RETRY_S
                self._load_op_failed[pid] = (loop.time(), wait)  # from the answer: a slow failure waits as long
                count = self._load_op_failures.setdefault(pid, RateLimited(LOAD_OP_RETRY_S)).hit()
                if count is not None:
                    logger.warning("weave: datetime values in %s sent without their load op (%d failed publish(es) "
                                   "since the last line; tried again in %g s): %s", pid, count, wait, got.reason)
                return encoded
            self._load_op_failed.pop(pid, None)
            ref = self._op_refs[(pid, LOAD_DATETIME_OP)] = got
        marked = _DATETIME_VALUE[:-len(b'"val":')] + b'"load_op":' + orjson.dumps(ref) + b',"val":'
        return encoded.replace(_DATETIME_VALUE, marked)

    async def _publish_op(self, pid: str, name: str, code_text: str = ANONYMOUS_OP_CODE) -> str | _Failure:
        """Publish ``name`` as weave's client publishes an op it only knows by name (or, given its
        code, as it publishes that op).

        Same requests as ``WeaveClient.create_call(op="name")``: the stub ``obj.py`` through
        ``/file/create`` (once per project), then the Op object through ``/obj/create``; the
        call's op_name is the ref URI to the digest the server returns.
        """
        try:
            object_id = sanitize_object_name(name)
        except SpanError as e:
            return _Failure(False, str(e))
        digest = self._file_digests.get((pid, code_text))
        if digest is None:
            content = code_text.encode()
            code = ("obj.py", content, "text/x-python")
            form = {"project_id": pid, "expected_digest": file_digest(content)}
            got = await self._digest("/file/create", files={"file": code}, data=form)
            if isinstance(got, _Failure):
                return got
            digest = self._file_digests[(pid, code_text)] = got
        obj = {
            "project_id": pid,
            "object_id": object_id,
            "val": {"_type": "CustomWeaveType", "weave_type": {"type": "Op"}, "files": {"obj.py": digest}},
            "builtin_object_class": None,
            "expected_digest": None,
            "wb_user_id": None,
        }
        got = await self._digest("/obj/create", json={"obj": obj})
        if isinstance(got, _Failure):
            return got
        entity, project = pid.split("/", 1)
        return f"weave:///{entity}/{project}/op/{object_id}:{got}"

    async def _digest(self, url: str, **kw: Any) -> str | _Failure:
        """POST to a create route; the ``digest`` it answers, or the failure."""
        r = await self._request(url, **kw)
        if isinstance(r, _Failure):
            return _Failure(r.retryable, f"publishing an op: {r.reason}", r.retry_after, r.status)
        try:
            return str(r.json()["digest"])
        except (ValueError, KeyError, TypeError):
            return _Failure(True, f"publishing an op: no digest in the answer from {url}")

    def _redact(self, text: str) -> str:
        """A failure's reason (a backend's answer, an error's message) without this sink's key and without
        what reads as a credential or a redact key's value (the answer may quote the request)."""
        text = text[:4 * MAX_REASON_CHARS]  # a large answer is cut before the scrub, which reads it all
        for s in self._secrets:
            text = text.replace(s, "***")
        return self._free_text.scrub_text(text)[:MAX_REASON_CHARS]

    @staticmethod
    def _mark(result: SendResult, sids: list[str], fail: _Failure) -> None:
        if fail.retryable:
            result.retryable.extend(sids)
            result.retry_reason = fail.reason
            if fail.retry_after is not None:
                result.retry_after = max(result.retry_after or 0.0, fail.retry_after)
        else:
            for sid in sids:
                result.rejected[sid] = fail.reason
