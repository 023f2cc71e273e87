"""Validate: check each span of a batch on its own, so one bad span never costs the others.

Every rejection names the field (``spans[3].attributes.step``) and the reason. Values that are
worth keeping but suspicious (a NaN reward, a parent that is not here yet) are stored with a
recorded warning instead of being refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SpanKind = Literal["op", "trajectory", "annotation"]
_ID = Field(pattern=r"^[A-Za-z0-9._:\-]{1,128}$")
_INT_ATTRS = ("step", "sample_index", "rollout_n")
_INT64 = (-(2**63), 2**63 - 1)  # what an SQLite INTEGER column (the store's index) can hold


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

    @field_validator("attributes")
    @classmethod
    def _attribute_types(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        for key in _INT_ATTRS:
            value = attrs.get(key)
            if value is not None and (type(value) is not int):
                raise ValueError(f"attributes.{key} must be an integer, got {type(value).__name__}")
            if value is not None and not _INT64[0] <= value <= _INT64[1]:
                raise ValueError(f"attributes.{key} must fit in a signed 64-bit integer, got {value}")
        reward = attrs.get("reward")
        if type(reward) is int and not _INT64[0] <= reward <= _INT64[1]:
            raise ValueError(f"attributes.reward must fit in a signed 64-bit integer, got {reward}")
        if "validate" in attrs and type(attrs["validate"]) is not bool:
            raise ValueError("attributes.validate must be a boolean")
        if "experiment_name" in attrs and attrs["experiment_name"] is not None and not isinstance(attrs["experiment_name"], str):
            raise ValueError("attributes.experiment_name must be a string")
        return attrs

    @model_validator(mode="after")
    def _links(self) -> "SpanIn":
        if self.parent_id == self.span_id:
            raise ValueError("parent_id: a span cannot be its own parent")
        if self.parent_id is None and self.kind != "annotation" and self.trace_id != self.span_id:
            raise ValueError("trace_id: a root span (no parent_id) must have trace_id == span_id")
        if self.end_time is not None and self.end_time < self.start_time:
            raise ValueError("end_time: ends before it starts")
        return self


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
    spans: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    index_of: dict[str, int] = field(default_factory=dict)


class EnvelopeError(Exception):
    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


def validate_batch(raw: Any, max_spans: int) -> Validated:
    """Validates the envelope (all-or-nothing) and each span (one by one)."""
    if not isinstance(raw, dict):
        raise EnvelopeError("body", f"expected an object with 'worker' and 'spans', got {type(raw).__name__}")
    try:
        batch = BatchIn.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise EnvelopeError(_loc(err["loc"]), err["msg"]) from None
    if len(batch.spans) > max_spans:
        raise EnvelopeError("spans", f"{len(batch.spans)} spans exceed TRACECAR_MAX_BATCH_SPANS={max_spans}")
    out = Validated(batch=batch)
    run_id, run_warning = _run_id(batch.wandb_run_id)
    seen: dict[str, int] = {}
    for index, item in enumerate(batch.spans):
        span_id = item.get("span_id") if isinstance(item, dict) else None
        span_id = span_id if isinstance(span_id, str) else None
        try:
            span = dict(SpanIn.model_validate(item).__dict__)  # no model_dump: it deep-copies inputs/output
        except ValidationError as exc:
            err = exc.errors()[0]
            field_name, reason = _describe_error(index, err)
            out.rejected.append(Rejection(index, span_id, field_name, reason))
            continue
        if span["span_id"] in seen:
            out.rejected.append(Rejection(index, span_id, f"spans[{index}].span_id", f"duplicate of spans[{seen[span['span_id']]}] in this batch"))
            continue
        seen[span["span_id"]] = index
        warnings = _sanitize_non_finite(span)
        if run_warning:
            warnings.append(run_warning)
        if warnings:
            out.warnings[span["span_id"]] = warnings
        span["worker"] = batch.worker
        span["project"] = batch.project
        span["entity"] = batch.entity
        if run_id is not None:
            span["wandb_run_id"] = run_id
        out.spans.append(span)
    out.index_of = seen
    _reject_cycles(out, seen)
    return out


def _run_id(value: Any) -> tuple[str | None, str | None]:
    """The batch's W&B run id (a run id or entity/project/run_id), or why it is ignored."""
    if value is None:
        return None, None
    if isinstance(value, str) and 0 < len(value) <= 256 and not any(c.isspace() for c in value) and value.count("/") <= 2:
        return value, None
    return None, f"wandb_run_id: ignored, expected a W&B run id or entity/project/run_id, got {str(value)[:80]!r}"


def _describe_error(index: int, err: dict[str, Any]) -> tuple[str, str]:
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
    for start in parents:
        path, node = [], start
        while node is not None and node in parents and node not in path:
            path.append(node)
            node = parents[node]
        if node is not None and node in path:
            cyclic.update(path[path.index(node):])
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
