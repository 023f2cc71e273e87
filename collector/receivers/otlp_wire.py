"""Counting the spans of an OTLP protobuf request on the wire, before parsing it.

A span costs two bytes of protobuf at least and a few hundred bytes parsed (then a Python dict
when translated): a small compressed body of empty spans would fill memory long before a count
taken after parsing could refuse it. Reading only the three levels that hold spans
(``ExportTraceServiceRequest.resource_spans`` → ``ResourceSpans.scope_spans`` →
``ScopeSpans.spans``), skipping every other field by its length, counts them at about a
microsecond each and stops as soon as the bound is passed.
"""

from __future__ import annotations

_RESOURCE_SPANS = 1  # ExportTraceServiceRequest.resource_spans
_SCOPE_SPANS = 2  # ResourceSpans.scope_spans
_SPANS = 2  # ScopeSpans.spans


class WireError(ValueError):
    """Not a protobuf message the parser would take."""


def _varint(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def _messages(data: bytes | bytearray, pos: int, end: int, number: int) -> list[tuple[int, int]]:
    """(start, end) of each length-delimited field ``number`` of the message in data[pos:end]."""
    out: list[tuple[int, int]] = []
    while pos < end:
        key, pos = _varint(data, pos, end)
        wire = key & 7
        if wire == 2:
            size, pos = _varint(data, pos, end)
            stop = pos + size
            if stop > end:
                raise WireError("length past the end of its message")
            if key >> 3 == number:
                out.append((pos, stop))
            pos = stop
        elif wire == 0:
            _, pos = _varint(data, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:  # groups (3, 4) are not in OTLP, and 6, 7 do not exist
            raise WireError(f"unexpected wire type {wire}")
    if pos > end:
        raise WireError("fixed-size field past the end of its message")
    return out


def count_spans(data: bytes | bytearray, stop_above: int) -> int:
    """Spans in an ``ExportTraceServiceRequest``, counted up to ``stop_above + 1``; raises
    :class:`WireError` for what is not a well-formed message at those levels."""
    total = 0
    for rs_start, rs_end in _messages(data, 0, len(data), _RESOURCE_SPANS):
        for ss_start, ss_end in _messages(data, rs_start, rs_end, _SCOPE_SPANS):
            pos = ss_start
            while pos < ss_end:  # the innermost level inline: it runs once per span
                key, pos = _varint(data, pos, ss_end)
                wire = key & 7
                if wire == 2:
                    size, pos = _varint(data, pos, ss_end)
                    pos += size
                    if key >> 3 == _SPANS:
                        total += 1
                        if total > stop_above:
                            return total
                elif wire == 0:
                    _, pos = _varint(data, pos, ss_end)
                elif wire == 1:
                    pos += 8
                elif wire == 5:
                    pos += 4
                else:
                    raise WireError(f"unexpected wire type {wire}")
            if pos > ss_end:
                raise WireError("field past the end of its message")
    return total
