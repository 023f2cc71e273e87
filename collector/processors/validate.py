"""Validate: check each span of a batch on its own, so one bad span never costs the others.

Every rejection names the field (``spans[3].attributes.step``) and the reason. Values that are
worth keeping but suspicious (a NaN reward, a parent that is not here yet) are stored with a
recorded warning instead of being refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tracecar.client.redact import DEFAULT as DEFAULT_REDACT
from tracecar.client.redact import REDACTED, RedactKeys, redact_span, scrub_exception
from tracecar.client.short_ids import WIRE_VERSION_IDS, expand_wire

from ..types import Span, SpanKind
from .trainer_compare import check as check_trainer_tokens

_ID = Field(pattern=r"^[A-Za-z0-9._:\-]{1,128}$")
_INT_ATTRS = ("step", "rollout_n")
#: VERL passes ``extra_info.index`` through unchanged: an int, or a string (uuid datasets).
MAX_STEP_SAMPLES = 65536  # sample indices one step announcement may carry (a VERL batch per worker is far smaller)
MAX_SAMPLE_INDEX_CHARS = 256
_INT64 = (-(2**63), 2**63 - 1)  # what an SQLite INTEGER column (the store's index) can hold
#: span times (seconds since the epoch) must be before 2300-01-01T00:00:00Z: the narrowest of what the
#: exporters carry (Weave's ClickHouse ``DateTime64`` ends with 2299; OTLP's uint64 nanoseconds in 2554;
#: Python's datetime, which Weave's SDK and SQLite server use, in 9999), so an accepted span is always exportable
MAX_TIME_S = 10_413_792_000.0
#: an annotation's route attribute (client.tracing.ROUTE_ATTR) and its longest accepted text
ROUTE_ATTR = "tracecar_route"
MAX_ROUTE_CHARS = 1024


class StackFrame(BaseModel):
    """One frame of weave's exception shape (``weave.utils.exception.StackFrameDict``)."""

    model_config = ConfigDict(extra="forbid")

    filename: str
    line_number: int | None
    function_name: str
    text: str | None


class ExceptionInfo(BaseModel):
    """weave's ``exception_to_dict``: forwarded as the JSON string weave's UI renders."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(max_length=1024)
    message: str = Field(max_length=1_000_000)
    traceback: list[StackFrame] | None = Field(None, max_length=10_000)


class SpanIn(BaseModel):
    """One span as the client sends it (see tracecar.client.wire for the batch envelope)."""

    model_config = ConfigDict(extra="ignore")

    span_id: str = _ID
    trace_id: str = _ID
    parent_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:\-]{1,128}$")
    name: str = Field(min_length=1, max_length=512)
    kind: SpanKind = "op"
    start_time: float = Field(allow_inf_nan=False, ge=0)
    end_time: float | None = Field(None, allow_inf_nan=False, ge=0)
    attributes: dict[str, Any] = Field(default_factory=dict)
    inputs: dict[str, Any] = Field(default_factory=dict)
    output: Any = None
    exception: str | None = Field(None, max_length=1_000_000)
    exception_info: ExceptionInfo | None = None

    @field_validator("start_time", "end_time")
    @classmethod
    def _exportable_time(cls, value: float | None) -> float | None:
        if value is not None and value >= MAX_TIME_S:
            raise ValueError(f"must be before 2300-01-01 ({MAX_TIME_S:.0f} seconds since the epoch: the latest time "
                             f"Weave and OTLP exporters carry), got {_described(value)}")
        return value

    @field_validator("attributes")
    @classmethod
    def _attribute_types(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        for key in _INT_ATTRS:
            value = attrs.get(key)
            if value is not None and (type(value) is not int):
                raise ValueError(f"attributes.{key} must be an integer, got {type(value).__name__}")
            if value is not None and not _INT64[0] <= value <= _INT64[1]:
                raise ValueError(f"attributes.{key} must fit in a signed 64-bit integer, got {_described(value)}")
        index = attrs.get("sample_index")
        if index is not None:
            if type(index) is str:
                if not 0 < len(index) <= MAX_SAMPLE_INDEX_CHARS:
                    raise ValueError(f"attributes.sample_index must be 1 to {MAX_SAMPLE_INDEX_CHARS} characters, got {len(index)}")
            elif type(index) is not int:
                raise ValueError(f"attributes.sample_index must be an integer or a string, got {type(index).__name__}")
            elif not _INT64[0] <= index <= _INT64[1]:
                raise ValueError(f"attributes.sample_index must fit in a signed 64-bit integer, got {_described(index)}")
        members = attrs.get("sample_indices")
        if members is not None:
            if not isinstance(members, list) or any(type(i) not in (int, str) for i in members):
                raise ValueError("attributes.sample_indices must be a list of integers or strings")
            if len(members) > MAX_STEP_SAMPLES:
                raise ValueError(f"attributes.sample_indices holds {len(members)} indices, more than {MAX_STEP_SAMPLES}")
            for i in members:  # each as sample_index is checked: it becomes a decision row
                if type(i) is str and not 0 < len(i) <= MAX_SAMPLE_INDEX_CHARS:
                    raise ValueError(f"attributes.sample_indices: each string must be 1 to {MAX_SAMPLE_INDEX_CHARS} characters")
                if type(i) is int and not _INT64[0] <= i <= _INT64[1]:
                    raise ValueError("attributes.sample_indices: each integer must fit in a signed 64-bit integer")
        reward = attrs.get("reward")
        if type(reward) is int and not _INT64[0] <= reward <= _INT64[1]:
            raise ValueError(f"attributes.reward must fit in a signed 64-bit integer, got {_described(reward)}")
        if "validate" in attrs and type(attrs["validate"]) is not bool:
            raise ValueError("attributes.validate must be a boolean")
        if "experiment_name" in attrs and attrs["experiment_name"] is not None and not isinstance(attrs["experiment_name"], str):
            raise ValueError("attributes.experiment_name must be a string")
        return attrs

    @model_validator(mode="after")
    def _links(self) -> SpanIn:
        if self.parent_id == self.span_id:
            raise ValueError("parent_id: a span cannot be its own parent")
        if self.parent_id is None and self.kind not in ("annotation", "open") and self.trace_id != self.span_id:
            raise ValueError("trace_id: a root span (no parent_id) must have trace_id == span_id")
        if self.end_time is not None and self.end_time < self.start_time:
            raise ValueError("end_time: ends before it starts")
        if self.kind == "annotation":
            _check_trainer_attributes(self.attributes)
            if isinstance(self.output, dict) and "trainer_tokens" in self.output:  # the trainer's batch row (issue 29)
                try:
                    check_trainer_tokens(self.output["trainer_tokens"])
                except ValueError as exc:
                    raise ValueError(f"output.trainer_tokens: {exc}") from None
        return self


def _described(value: Any) -> str:
    """A refused value in an error: a number as itself, anything else by its type only (error
    bodies are stored and logged by clients, and a misplaced value may hold a secret)."""
    if type(value) in (int, float, bool):
        text = repr(value)
        return text if len(text) <= 40 else f"a number of {len(text)} characters"
    return f"a {type(value).__name__}"


MAX_REWARD_COMPONENTS = 256
_FATE_LIKE = re.compile(r"[a-z]{1,16}")  # a plain lowercase word: what a misspelt fate looks like
FATES = ("trained", "filtered", "evicted")  # what became of a trajectory (issue 29); "never reached the trainer" is no note


def _check_trainer_attributes(attrs: dict[str, Any]) -> None:
    """What the trainer did (client.annotate): typed, because the store filters and indexes them."""
    advantage = attrs.get("advantage")
    if type(advantage) is int:  # its range first: math.isfinite of a huge int raises
        if not _INT64[0] <= advantage <= _INT64[1]:
            raise ValueError(f"attributes.advantage must fit in a signed 64-bit integer, got {_described(advantage)}")
    elif advantage is not None and (type(advantage) is not float or not math.isfinite(advantage)):
        raise ValueError(f"attributes.advantage must be a finite number, got {_described(advantage)}")
    if "trained" in attrs and attrs["trained"] is not None and type(attrs["trained"]) is not bool:
        raise ValueError(f"attributes.trained must be a boolean, got {type(attrs['trained']).__name__}")
    filtered_by = attrs.get("filtered_by")
    if filtered_by is not None and (not isinstance(filtered_by, str) or not 0 < len(filtered_by) <= 256):
        raise ValueError("attributes.filtered_by must be a string of 1 to 256 characters")
    for key in ("policy_version", "trained_on_version"):
        value = attrs.get(key)
        if value is not None and (type(value) is not int or not _INT64[0] <= value <= _INT64[1]):
            raise ValueError(f"attributes.{key} must be a signed 64-bit integer, got {_described(value)}")
    for key in ("min_global_steps", "max_global_steps", "evicted_at_step"):  # policy versions (VERL v1 async)
        value = attrs.get(key)
        if value is not None and (type(value) is not int or not _INT64[0] <= value <= _INT64[1]):
            raise ValueError(f"attributes.{key} must be a signed 64-bit integer, got {_described(value)}")
    fate = attrs.get("fate")
    if fate is not None and fate not in FATES:
        # a plausible misspelling is echoed; any other value (it may be anything, a secret too) only described
        given = repr(fate) if isinstance(fate, str) and _FATE_LIKE.fullmatch(fate) else _described(fate)
        raise ValueError(f"attributes.fate must be one of {', '.join(FATES)}, got {given}")
    for key in ("fate_reason", "refill_of"):
        value = attrs.get(key)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 256):
            raise ValueError(f"attributes.{key} must be a string of 1 to 256 characters")
    extra = attrs.get("reward_extra_info")  # the reward's components (VERL's reward_extra_info; issue 29)
    if extra is not None and (not isinstance(extra, dict) or len(extra) > MAX_REWARD_COMPONENTS):
        raise ValueError(f"attributes.reward_extra_info must be an object of at most {MAX_REWARD_COMPONENTS} components,"
                         f" got {_described(extra) if not isinstance(extra, dict) else f'{len(extra)} components'}")


class BatchIn(BaseModel):
    """The batch envelope; spans are validated one by one afterwards."""

    model_config = ConfigDict(extra="ignore")

    v: int = 1
    worker: str = Field(min_length=1, max_length=256)
    project: str | None = Field(None, max_length=256)
    entity: str | None = Field(None, max_length=256)
    tokenizer: str | None = Field(None, max_length=1024)
    wandb_run_id: Any = None  # checked apart: a bad run id is ignored with a warning, never costs the batch
    token2text: bool | None = None
    max_samples_per_step_per_worker: int | None = Field(None, ge=0)
    client: dict[str, str] | None = Field(None, max_length=32)
    dropped: Any = None  # the sender's drop totals (receivers.client_drops checks it apart: never costs the batch)
    # wire version 3: the prefix a short span id ("~2d") stands for (tracecar.client.short_ids)
    id_prefix: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}$")
    spans: list[Any]


@dataclass
class Rejection:
    index: int
    span_id: str | None
    field: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "span_id": self.span_id, "field": self.field, "reason": self.reason}


@dataclass
class Validated:
    """The outcome of validating one batch: the good spans (as dicts) and each rejection."""

    batch: BatchIn
    spans: list[Span] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    index_of: dict[str, int] = field(default_factory=dict)
    # spans whose inputs.prompt_ids was rebuilt from a reference (tracecar.collector.processors.prompt_refs)
    prompt_bases: dict[Any, Any] = field(default_factory=dict)  # span_id, or (span_id, "output") -> prompt_refs.Base
    # v2: per span, the (part, key) of each list that arrived as a reference (a worker process re-parses the body)
    rebuilt: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    # v2: spans whose prompt context this batch remembered: only their decoded texts are kept for later
    # references (a resend of a known span, stored or in flight, must not change what they rebuild)
    remembered: set[str] = field(default_factory=set)
    # v2: per span, (part, key, ref span, from, n) of each list rebuilt from a reference: stored as one
    # (tracecar.collector.processors.store_refs)
    store_refs: dict[str, list[tuple[str, str, str, int, int]]] = field(default_factory=dict)
    # OTLP: engine spans stored AWAITING their trajectory, and traces whose own root this request brought
    # (tracecar.collector.receivers.engine_hold)
    awaiting: set[str] = field(default_factory=set)
    foreign_roots: set[str] = field(default_factory=set)


class EnvelopeError(Exception):
    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


def validate_batch(raw: Any, max_spans: int, redact: RedactKeys = DEFAULT_REDACT, body: bytes | bytearray | None = None,
                   body_is_json: bool = True, span_model: type[SpanIn] = SpanIn) -> Validated:
    """Validates the envelope (all-or-nothing) and each span (one by one), then redacts.

    ``span_model``: the per-span checks (receivers of other formats relax tracecar's root rule).

    Values under a redact key are replaced by ``REDACTED`` before anything is stored (other
    clients than tracecar's exist); the spans are walked only when ``body`` (the decompressed
    request) may hold such a key, or when no body is given.
    """
    if not isinstance(raw, dict):
        raise EnvelopeError("body", f"expected an object with 'worker' and 'spans', got {type(raw).__name__}")
    try:
        batch = BatchIn.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise EnvelopeError(_loc(err["loc"]), err["msg"]) from None
    if len(batch.spans) > max_spans:
        raise EnvelopeError("spans", f"{len(batch.spans)} spans exceed TRACECAR_MAX_BATCH_SPANS={max_spans}")
    if batch.v >= WIRE_VERSION_IDS and batch.id_prefix:  # ids in full before anything reads them
        for item in batch.spans:
            expand_wire(item, batch.id_prefix)
    out = Validated(batch=batch)
    walk = body is None or redact.might_hold(body, body_is_json)
    envelope_warnings: list[str] = []
    if batch.client and not all(_storable(k) and _storable(v) for k, v in batch.client.items()):
        batch.client = None  # what the client says of itself: informational, never worth the batch
        envelope_warnings.append("client: ignored, a key or value holds a lone surrogate (not UTF-8)")
    if walk and batch.client:
        batch.client = {k: (REDACTED if k in redact else v) for k, v in batch.client.items()}
    run_id, run_warning = _run_id(batch.wandb_run_id)
    if run_warning:
        envelope_warnings.append(run_warning)
    seen: dict[str, int] = {}
    for index, item in enumerate(batch.spans):
        span_id = item.get("span_id") if isinstance(item, dict) else None
        span_id = span_id if isinstance(span_id, str) else None
        try:
            span: Span = dict(span_model.model_validate(item).__dict__)  # type: ignore[assignment]  # no model_dump: it deep-copies inputs/output
        except ValidationError as exc:
            err = exc.errors()[0]
            field_name, reason = _describe_error(index, err)
            out.rejected.append(Rejection(index, span_id, field_name, reason))
            continue
        if span["span_id"] in seen:
            out.rejected.append(Rejection(index, span_id, f"spans[{index}].span_id",
                                          f"duplicate of spans[{seen[span['span_id']]}] in this batch"))
            continue
        seen[span["span_id"]] = index
        if span["kind"] == "annotation" and ROUTE_ATTR in span["attributes"]:  # its trajectory's route (a trainer's):
            _take_route(span)  # for a node's gateways to read, never the trajectory's attributes
        if span["exception_info"] is not None:
            info = cast(ExceptionInfo, span["exception_info"]).model_dump()  # still the model here
            if info["traceback"] is None:  # weave leaves the key out when nothing was raised
                del info["traceback"]
            span["exception_info"] = info
        else:
            del span["exception_info"]
        plain: dict[str, Any] = span  # type: ignore[assignment]  # for the walkers that take any span-shaped dict
        if walk:
            redact_span(plain, redact)
        elif span["exception"] is not None or "exception_info" in span:
            scrub_exception(plain, redact)  # no key anywhere in the body, but an error may have formatted a secret into its text
        warnings = _sanitize_non_finite(plain) + envelope_warnings
        if warnings:
            out.warnings[span["span_id"]] = warnings
        span["worker"] = batch.worker
        span["project"] = batch.project
        span["entity"] = batch.entity
        if batch.client:
            span["client"] = batch.client
        if run_id is not None:
            span["wandb_run_id"] = run_id
        out.spans.append(span)
    out.index_of = seen
    _reject_cycles(out, seen)
    return out


def _take_route(span: Span) -> None:
    """Moves an annotation's ``tracecar_route`` attribute (client.tracing.ROUTE_ATTR) to the span's ``route``
    field when it is a route (exporters/gateway_route.py reads it there); dropped otherwise: a hint, never
    worth the span, and never merged into the trajectory's attributes."""
    attributes = dict(span["attributes"])
    value = attributes.pop(ROUTE_ATTR)
    span["attributes"] = attributes
    if isinstance(value, str) and len(value) <= MAX_ROUTE_CHARS:
        span["route"] = value


def _storable(text: str) -> bool:
    """Whether a string can be stored (UTF-8): the standard JSON parser, used for bodies with numbers
    past a double, lets a lone surrogate escape (``"\\ud800"``) through, which orjson refuses."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _run_id(value: Any) -> tuple[str | None, str | None]:
    """The batch's W&B run id (a run id or entity/project/run_id), or why it is ignored."""
    if value is None:
        return None, None
    if (isinstance(value, str) and 0 < len(value) <= 256 and not any(c.isspace() for c in value) and value.count("/") <= 2
            and _storable(value)):
        return value, None
    # what was sent is described, never echoed: the answer and every span's warnings are stored and
    # served, and a misplaced value may be a secret (a dict holding an api_key, a token in a string)
    got = f"a string of {len(value)} characters" if isinstance(value, str) else f"a {type(value).__name__}"
    return None, f"wandb_run_id: ignored, expected a W&B run id or entity/project/run_id (at most 256 characters, no spaces), got {got}"


def _describe_error(index: int, err: Mapping[str, Any]) -> tuple[str, str]:
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    loc = _loc(err.get("loc", ()))
    head = msg.split(" ", 1)[0].rstrip(":")
    if "." in head or head in ("parent_id", "trace_id", "end_time", "span_id"):  # a field named by the message
        field_name, _, reason = msg.partition(" ")
        return f"spans[{index}].{field_name.rstrip(':')}", reason.lstrip(": ")
    return f"spans[{index}]" + (f".{loc}" if loc else ""), msg


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _sanitize_non_finite(span: dict[str, Any]) -> list[str]:
    """NaN/inf rewards are real signals (a reward collapse): keep them as strings, warn."""
    warnings: list[str] = []
    for container_name in ("attributes", "output"):
        container = span.get(container_name)
        if not isinstance(container, dict):
            continue
        for key, value in container.items():
            if type(value) is float and not math.isfinite(value):
                container[key] = repr(value)
                warnings.append(f"{container_name}.{key}: non-finite {value!r} stored as the string {repr(value)!r}")
    return warnings


def _reject_cycles(out: Validated, index_of: dict[str, int]) -> None:
    """Rejects spans whose parent chain inside this batch loops back to themselves."""
    parents = {s["span_id"]: s["parent_id"] for s in out.spans}
    cyclic: set[str] = set()
    done: set[str] = set()  # spans whose chain is already walked: each span is visited once, O(n)
    for start in parents:
        path: list[str] = []
        on_path: set[str] = set()
        node: str | None = start
        while node is not None and node in parents and node not in done and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = parents[node]
        if node is not None and node in on_path:
            cyclic.update(path[path.index(node):])
        done.update(path)
    if not cyclic:
        return
    kept = []
    for span in out.spans:
        if span["span_id"] in cyclic:
            index = index_of[span["span_id"]]
            out.rejected.append(Rejection(index, span["span_id"], f"spans[{index}].parent_id", "parent chain forms a cycle"))
        else:
            kept.append(span)
    out.spans = kept


def parents_to_look_up(out: Validated) -> list[str]:
    """Parent ids the batch names: their trace_id is asked of the store, those the batch holds too
    (a stored span wins over a batch copy of it, see :func:`reject_foreign_children`)."""
    return sorted({s["parent_id"] for s in out.spans if s["parent_id"] is not None})


def reject_foreign_children(out: Validated, stored_traces: dict[str, str]) -> None:
    """Rejects spans whose trace_id differs from their known parent's.

    A span belongs to its parent's trajectory; one that names a parent in another trace would
    be stored under a trajectory whose root it can never reach (and forwarded as a call whose
    parent lives in another trace). It is refused by name so its client sees the bug; the rest
    of the batch, its parent included, is stored. A parent that is not known (not in this batch
    nor in the store, e.g. not arrived yet or already forwarded and deleted) cannot be checked.
    """
    # a stored span wins over a batch copy of it: the copy is dropped as a duplicate at write time,
    # so it must not decide its children's trajectory either
    traces = {**{s["span_id"]: s["trace_id"] for s in out.spans}, **stored_traces}
    where = {s["span_id"]: out.index_of.get(s["span_id"]) for s in out.spans if s["span_id"] not in stored_traces}
    kept = []
    for span in out.spans:
        parent = span["parent_id"]
        parent_trace = traces.get(parent) if parent is not None else None
        if parent_trace is None or parent_trace == span["trace_id"]:
            kept.append(span)
            continue
        index = out.index_of[span["span_id"]]
        known = f"spans[{where[parent]}] of this batch" if parent in where else "a span already stored"
        out.rejected.append(Rejection(index, span["span_id"], f"spans[{index}].trace_id",
                                      f"{span['trace_id']!r} differs from the trace_id {parent_trace!r} of its parent "
                                      f"{parent!r} ({known}); a child belongs to its parent's trajectory"))
        out.warnings.pop(span["span_id"], None)
    out.spans = kept
