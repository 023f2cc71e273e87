"""Wire version 3: this process's span ids written short, expanded back by the collector.

A span id is the process's 16-hex prefix and a 16-hex counter (:mod:`tracecar.client.spans`);
with prompt deltas the ids (``span_id``, ``trace_id``, ``parent_id``, the turn mark's ``root``
and ``turn``, each reference's ``$ref``) are most of what a span carries besides its new token
ids. A v3 batch names the prefix once (``"id_prefix"``) and writes an id that starts with it as
``"~"`` + the counter's hex without leading zeros (``"~2d"``); the collector writes the full id
back before anything reads it (:func:`expand_wire`), so the store, Weave and every exporter see
the same ids as from a v1/v2 batch. ``~`` is outside the id alphabet, so a short id can never be
mistaken for a full one. Sent only to a collector whose answers list 3 in ``wire_versions``.
"""

from __future__ import annotations

from typing import Any

WIRE_VERSION_IDS = 3
SHORT = "~"
PREFIX_KEY = "id_prefix"
_HEX = "0123456789abcdef"
_COUNTER = 16  # hex digits of the counter part of a span id
MARK = "tracecar"  # tracecar.client.tracing.MARK (not imported: the collector imports this module)
MARK_IDS = ("root", "turn")
REF = "$ref"  # tracecar.client.prompt_delta.REF_KEY
REF_PLACES = (("inputs", "prompt_ids"), ("output", "prompt_ids"), ("output", "response_ids"))


def shorten(sid: Any, prefix: str) -> Any:
    """``sid`` as ``~<hex>`` when it is ``prefix`` + a 16-digit lower-case hex counter, else as it is."""
    if type(sid) is not str or len(sid) != len(prefix) + _COUNTER or not sid.startswith(prefix):
        return sid
    tail = sid[len(prefix):]
    if tail.strip(_HEX):  # not the counter's form: expanding would not give it back
        return sid
    return SHORT + tail.lstrip("0")


def expand(sid: Any, prefix: str) -> Any:
    """The full id of a short one (:func:`shorten`'s inverse); anything else as it is."""
    if type(sid) is str and sid[:1] == SHORT:
        return prefix + sid[1:].rjust(_COUNTER, "0")
    return sid


def shorten_record(wire: dict[str, Any], record: Any, prefix: str) -> None:
    """:func:`shorten_wire` for ``record.to_wire()``: its three ids come straight from the records'
    counters (one format each, no string checks), the rest as there. Only for that dict: an open
    marker's ``span_id`` is the call's + ``".open"``, so markers take :func:`shorten_wire`."""
    if record.prefix == prefix:
        wire["span_id"] = record.short_id
    for key, other in (("trace_id", record.trace), ("parent_id", record.parent)):
        if other is None:
            continue
        other_prefix = getattr(other, "prefix", None)  # an annotation's trajectory is only an id (tracing._TraceRef)
        if other_prefix is None:
            wire[key] = shorten(wire.get(key), prefix)
        elif other_prefix == prefix:
            wire[key] = other.short_id
    _shorten_rest(wire, prefix)


def shorten_wire(wire: dict[str, Any], prefix: str) -> None:
    """Shortens a span's ids in place; the parts it rewrites (attributes, references) are copied
    first, since they may be shared with other spans or with the caller.

    The sender thread runs this for every span: the three ids are done inline (no call each), and
    the mark and references only looked at when there (most spans have neither).
    """
    plen = len(prefix)
    full = plen + _COUNTER
    for key in ("span_id", "trace_id", "parent_id"):
        sid = wire.get(key)
        if type(sid) is str and len(sid) == full and sid.startswith(prefix):
            tail = sid[plen:]
            if not tail.strip(_HEX):
                wire[key] = SHORT + tail.lstrip("0")
    _shorten_rest(wire, prefix)


def _shorten_rest(wire: dict[str, Any], prefix: str) -> None:
    """The turn mark's ids and the references' ``$ref`` (copied first: they may be shared)."""
    attrs = wire.get("attributes")
    mark = attrs.get(MARK) if type(attrs) is dict else None
    if type(mark) is dict and (MARK_IDS[0] in mark or MARK_IDS[1] in mark):
        wire["attributes"] = {**attrs, MARK: {**mark, **{k: shorten(mark[k], prefix) for k in MARK_IDS if k in mark}}}  # type: ignore[dict-item]
    inputs = wire.get("inputs")
    output = wire.get("output")
    if type(inputs) is dict and type(inputs.get("prompt_ids")) is dict \
            or type(output) is dict and (type(output.get("prompt_ids")) is dict or type(output.get("response_ids")) is dict):
        _rewrite_refs(wire, prefix, shorten)


def expand_wire(span: Any, prefix: str) -> None:
    """The collector's side: every short id of a parsed v3 span written out in full, in place."""
    if type(span) is dict:
        _rewrite(span, prefix, expand)


def _rewrite(span: dict[str, Any], prefix: str, how: Any) -> None:
    for key in ("span_id", "trace_id", "parent_id"):
        value = span.get(key)
        if value is not None:
            span[key] = how(value, prefix)
    attrs = span.get("attributes")
    mark = attrs.get(MARK) if type(attrs) is dict else None
    if type(mark) is dict and (MARK_IDS[0] in mark or MARK_IDS[1] in mark):
        new_mark = {**mark, **{k: how(mark[k], prefix) for k in MARK_IDS if k in mark}}
        span["attributes"] = {**attrs, MARK: new_mark}  # type: ignore[dict-item]
    _rewrite_refs(span, prefix, how)


def _rewrite_refs(span: dict[str, Any], prefix: str, how: Any) -> None:
    for part, key in REF_PLACES:
        holder = span.get(part)
        ref = holder.get(key) if type(holder) is dict else None
        if type(ref) is dict and REF in ref:
            span[part] = {**holder, key: {**ref, REF: how(ref[REF], prefix)}}  # type: ignore[dict-item]
