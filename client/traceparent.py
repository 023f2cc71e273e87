"""W3C ``traceparent`` for the current span, so an inference engine's spans join the rollout.

vLLM (``AsyncLLM.generate(..., trace_headers={"traceparent": ...})``) and SGLang
(``external_trace_header``) parent their per-request OpenTelemetry span on the context they
are given and export it over OTLP; pointed at the collector's ``/v1/traces`` that span lands
in the trajectory, as a child of the ``generate`` call that caused it.

The ids are tracecar's, written the W3C way (no mapping table anywhere):

* trace-id = the trajectory's trace id (the root span id: 16-hex process prefix + 16-hex
  counter, already 32 hex);
* parent-id = the 16-hex counter part of the current span's id. The collector rebuilds the
  tracecar parent as ``trace_id[:16] + parent-id`` (the root's process prefix + the counter),
  which is the current span's id whenever it was created in the process that opened the
  trajectory (always so for VERL: one trajectory runs in one agent-loop worker). A span made in
  another process (another prefix) names the trajectory root instead, so the engine span
  still lands in the right trajectory.
* flags ``01``; ``00`` inside ``rollout_trace_attr(trace=False)`` (a trajectory a worker-side
  budget did not choose): the engine's sampler (ParentBased) then records nothing.

``trace_headers()`` also gives a W3C ``tracestate`` entry, ``tracecar=<where>``, saying where
the engine span sits in VERL's Weave tree (which top-level call roots it, which turn it belongs
to): the engine's OpenTelemetry SDK copies the parent's trace state onto its span, so the
collector can place the span in Weave as it places the client's own calls (``attributes.tracecar``
marks, see :mod:`tracecar.client.tracing`) without looking up its parent.
"""

from __future__ import annotations

from . import tracer as _tracer
from .spans import ids
from .tracing import MARK

TRACESTATE_KEY = "tracecar"  # our entry in the W3C tracestate list (the collector's OTLP receiver reads it)

# A valid (non-zero) context whose sampled flag is off: the engine skips its span. The ids
# carry no meaning; they only have to parse.
_UNSAMPLED = "00-{prefix}ffffffffffffffff-ffffffffffffffff-00"


def traceparent() -> str | None:
    """The ``traceparent`` header for the current span; None outside a trace or with tracing off.

    Cheap (a context read and one string format), so it can sit on the generate path.
    """
    if _tracer.active is None:
        return None
    span = _tracer.current.get()
    if span is None:
        return None
    if span is _tracer.DISABLED:
        return _UNSAMPLED.format(prefix=ids.prefix)
    root = span.trace
    parent = span if span.prefix == root.prefix else root
    return "00-%s%016x-%016x-01" % (root.prefix, root.number, parent.number)  # noqa: UP031  (%-format: the cheapest here)


def tracestate() -> str | None:
    """The ``tracecar=`` tracestate entry for the current span, or None when it has no place mark.

    ``tracecar=top``: the current span is a trajectory root (an engine span under it is a
    top-level call); ``tracecar=<root>``: the current span is a top-level call (an engine span
    under it is a turn of its own); ``tracecar=<root>.<turn>``: the engine span belongs to that turn.
    """
    span = _tracer.current.get()
    if span is None or span is _tracer.DISABLED or not span.attributes:
        return None
    if span.prefix != span.trace.prefix:  # traceparent names the trajectory root then: so does this
        return f"{TRACESTATE_KEY}=top"
    mark = span.attributes.get(MARK)
    if not isinstance(mark, dict):
        return None
    if mark.get("trajectory") is True and span.parent is None:
        return f"{TRACESTATE_KEY}=top"
    if mark.get("top") is True:
        return f"{TRACESTATE_KEY}={span.span_id}"
    root, turn = mark.get("root"), mark.get("turn")
    return f"{TRACESTATE_KEY}={root}.{turn}" if root and turn else None


def trace_headers() -> dict[str, str] | None:
    """``{"traceparent": ..., "tracestate": ...}`` for an engine's ``trace_headers`` argument, or None."""
    value = traceparent()
    if value is None:
        return None
    state = tracestate() if value.endswith("-01") else None
    return {"traceparent": value} if state is None else {"traceparent": value, "tracestate": state}
