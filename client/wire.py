"""Wire format shared by the client and the collector.

A batch is a msgpack map ``{"v": 1, "worker": str, "project": str|None, "entity": str|None,
"tokenizer": str|None, "spans": [span, ...]}``; JSON with the same shape is accepted too.
Lists of token ids travel as msgpack ext type 1 (packed little-endian int32), about 4 bytes
an id and one memcpy to build, instead of 1-5 bytes and a Python loop per id.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from array import array
from typing import Any, Callable

import msgpack

WIRE_VERSION = 1
EXT_INT32_ARRAY = 1
MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"
MIN_PACKED_LEN = 8
_LITTLE = sys.byteorder == "little"
_TRUNCATED = "…[truncated by tracecar: {n} chars]"


def pack_int_list(values: list[int]) -> msgpack.ExtType | None:
    """Packs a list of ints as int32 LE, or returns None when it isn't one (bools, big ints)."""
    first = values[0]
    if type(first) is not int or type(values[-1]) is not int:
        return None
    try:
        packed = array("i", values)
    except (TypeError, OverflowError):
        return None
    if not _LITTLE:
        packed.byteswap()
    return msgpack.ExtType(EXT_INT32_ARRAY, packed.tobytes())


def unpack_ext(code: int, data: bytes) -> Any:
    """msgpack ext_hook for the collector: packed ids back to a list of ints."""
    if code == EXT_INT32_ARRAY:
        if len(data) % 4:
            raise ValueError("packed int32 array length is not a multiple of 4")
        values = array("i")
        values.frombytes(data)
        if not _LITTLE:
            values.byteswap()
        return values.tolist()
    return msgpack.ExtType(code, data)


class WireEncoder:
    """Turns arbitrary traced values into msgpack-able data, on the sender thread only.

    Pydantic models, dataclasses, numpy/torch values and plain objects are flattened; strings
    longer than ``max_string_chars`` are cut with a marker; nesting deeper than ``max_depth`` and
    cycles become a repr, so a hostile or huge output can never stall or crash the sender.
    """

    def __init__(self, max_string_chars: int = 1_000_000, max_depth: int = 32) -> None:
        self.max_string_chars = max_string_chars
        self.max_depth = max_depth

    def encode(self, value: Any, depth: int = 0) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is int:
            return value
        if kind is float:
            return value if math.isfinite(value) else repr(value)
        if kind is str:
            return self._cut(value)
        if depth >= self.max_depth:
            return self._cut(repr(value))
        if kind is list or kind is tuple:
            if len(value) >= MIN_PACKED_LEN:
                packed = pack_int_list(value if kind is list else list(value))
                if packed is not None:
                    return packed
            return [self.encode(v, depth + 1) for v in value]
        if kind is dict:
            return {str(k): self.encode(v, depth + 1) for k, v in value.items()}
        if kind is bytes or kind is bytearray:
            return bytes(value[: self.max_string_chars])
        return self.encode(_flatten(value), depth + 1)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_string_chars:
            return text
        return text[: self.max_string_chars] + _TRUNCATED.format(n=len(text) - self.max_string_chars)


def _flatten(value: Any) -> Any:
    """One level of conversion for non-builtin values (never recursive itself)."""
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    dump: Callable[..., Any] | None = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        try:
            return dump()
        except Exception:  # noqa: BLE001 - a broken model still gets traced as its repr
            return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist) and type(value).__module__.split(".")[0] in ("numpy", "torch"):
        try:
            return tolist()
        except Exception:  # noqa: BLE001
            return repr(value)
    if isinstance(value, (set, frozenset)):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return {k: v for k, v in attrs.items() if not k.startswith("_")}
    return repr(value)


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, ext_hook=unpack_ext, strict_map_key=False)
