"""A span's stored form: one JSON object, with the byte offsets of its inputs and output.

Here, below the processors, because both the ingest path (processors.span_work) and the store's
readers (spool.full_payloads, which rebuilds stored prompt references) must write it byte for byte
the same way.
"""

from __future__ import annotations

import base64
from typing import Any

import msgpack
import orjson

from ..types import RawIds, Span

_DUMP_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
_INPUTS_KEY, _OUTPUT_KEY = b'"inputs":', b',"output":'


def _json_default(value: Any) -> Any:
    if type(value) is RawIds:  # ids kept as the bytes received: written back as they came
        return orjson.Fragment(value.data)
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes_b64__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, msgpack.ExtType):
        return {"__ext__": value.code, "data_b64": base64.b64encode(value.data).decode()}
    return repr(value)


class PayloadError(ValueError):
    """A span part that cannot be serialised; ``field`` names it (``attributes``, ``inputs``, ``output``, ...)."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason

    def __reduce__(self) -> Any:  # crosses process boundaries with both arguments
        return type(self), (self.field, self.reason)


def _dumps_part(value: Any, field_name: str) -> bytes:
    try:
        return orjson.dumps(value, default=_json_default, option=_DUMP_OPTS)
    except orjson.JSONEncodeError as exc:
        hint = " (nested deeper than the 254 levels a stored value may have)" if "Recursion" in str(exc) else ""
        raise PayloadError(field_name, f"cannot be stored: {exc}{hint}") from None


def _dumps_head(head: dict[str, Any]) -> bytes:
    """The span's fields other than inputs/output; on failure, the field at fault is named."""
    try:
        return orjson.dumps(head, default=_json_default, option=_DUMP_OPTS)
    except orjson.JSONEncodeError:
        for key, value in head.items():  # only on failure: find which field it was
            _dumps_part({key: value}, str(key))
        raise


def pack_payload(span: Span) -> tuple[bytes, int, int]:
    """The span as one JSON object, with the byte offsets of its inputs and output values.

    The object is ``{...every other field..., "inputs": I, "output": O}``: any reader can
    parse it whole, and the forwarder can parse just the small head and splice ``I`` and ``O``
    into the backend request as they are (they hold the token ids and decoded text: most of the
    bytes, and most of the parsing time).
    """
    head_fields = {k: v for k, v in span.items() if k != "inputs" and k != "output"}
    try:  # the three in one try: a failure is rare, and then each part is tried again to name it
        head = orjson.dumps(head_fields, default=_json_default, option=_DUMP_OPTS)
        inputs = orjson.dumps(span["inputs"], default=_json_default, option=_DUMP_OPTS)
        output = orjson.dumps(span["output"], default=_json_default, option=_DUMP_OPTS)
    except orjson.JSONEncodeError:
        head = _dumps_head(head_fields)
        inputs = _dumps_part(span["inputs"], "inputs")
        output = _dumps_part(span["output"], "output")
    prefix = head[:-1] + b"," + _INPUTS_KEY
    inputs_at = len(prefix)
    output_at = inputs_at + len(inputs) + len(_OUTPUT_KEY)
    return b"".join((prefix, inputs, _OUTPUT_KEY, output, b"}")), inputs_at, output_at
