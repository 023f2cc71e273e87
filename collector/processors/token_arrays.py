"""Per-token arrays of a span (log-probabilities, loss mask, entropy), packed for the spool.

VERL's ``AgentLoopOutput`` carries ``response_mask`` (1 for generated tokens, 0 for tool
output) and, with ``calculate_log_probs``, ``response_logprobs``; a server's ``TokenOutput``
has ``log_probs``. As JSON a float costs ~20 bytes; packed it costs 4. The collector packs them
(with the token ids and each token's end offset in ``response_text``, see token_pieces) into one
blob in the span's row, read by ``GET /v1/trajectories/{id}/tokens``. With nothing to forward
to (local mode) the float lists leave the stored payload, replaced by a short note (the 0/1 mask
stays: a few bytes a token, and the output keeps the fields VERL's ``model_dump`` has);
spans forwarded to a backend keep them, so the backend shows what VERL's own tracing shows.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from ..types import RawIds, Span, as_list

ID_KEYS = ("response_ids", "token_ids")
ARRAY_KEYS = {
    "logprobs": ("response_logprobs", "log_probs", "logprobs"),
    "mask": ("response_mask",),
    "entropy": ("response_entropy", "entropy", "entropies"),
}
MAGIC = b"TCT1"
_TYPES = {"ids": "i", "logprobs": "f", "mask": "B", "entropy": "f", "ends": "I"}
_ARRAY_KEY_SET = frozenset(k for keys in ARRAY_KEYS.values() for k in keys)
PACKED_NOTE = "packed by tracecar: {n} values, see GET /v1/trajectories/{trace_id}/tokens"


@dataclass
class TokenArrays:
    """One span's per-token data; every list has one entry per token id."""

    ids: list[int]
    logprobs: list[float] | None = None
    mask: list[int] | None = None
    entropy: list[float] | None = None
    ends: list[int] | None = None  # end offset of each token in output.response_text (token_pieces)
    keys: dict[str, str] | None = None  # which output key each array came from
    exact: bool = True  # False: ``ends`` join to the text but were approximated (token_pieces)

    def pack(self) -> bytes:
        header: dict[str, Any] = {"n": len(self.ids), "keys": self.keys or {}, "fields": []}
        if not self.exact:  # written only when so: blobs of exact offsets stay as they were
            header["approximate"] = True
        parts = []
        for name in ("ids", "logprobs", "mask", "entropy", "ends"):
            values = getattr(self, name)
            if values is None:
                continue
            packed = array(_TYPES[name], values)
            if sys.byteorder == "big":
                packed.byteswap()
            header["fields"].append(name)
            parts.append(packed.tobytes())
        head = orjson.dumps(header)
        return MAGIC + struct.pack("<I", len(head)) + head + b"".join(parts)

    @classmethod
    def unpack(cls, blob: bytes) -> TokenArrays:
        if blob[:4] != MAGIC:
            raise ValueError("not a tracecar token-array blob")
        (size,) = struct.unpack_from("<I", blob, 4)
        header = orjson.loads(blob[8:8 + size])
        n, at, out = header["n"], 8 + size, cls(ids=[], keys=header.get("keys") or {}, exact=not header.get("approximate"))
        for name in header["fields"]:
            values = array(_TYPES[name])
            width = values.itemsize * n
            values.frombytes(blob[at:at + width])
            if sys.byteorder == "big":
                values.byteswap()
            at += width
            setattr(out, name, values.tolist())
        return out


# The checks below run once per token of every response the collector stores: set(map(type, …))
# and map() keep them in C (2–3× faster than a Python loop per value)
_NUMBER_TYPES = frozenset({int, float})
_MASK_TYPES = frozenset({int, bool})
_MASK_VALUES = frozenset({0, 1})


def _floats(values: list[Any]) -> list[float] | None:
    types = set(map(type, values))
    if not types <= _NUMBER_TYPES | {type(None)}:
        return None
    try:
        if types <= _NUMBER_TYPES:
            return list(map(float, values))
        return [math.nan if v is None else float(v) for v in values]  # a missing log-probability
    except OverflowError:  # an integer past a double (msgpack or JSON can carry one): not packed, named
        return None


def _mask(values: list[Any]) -> list[int] | None:
    if set(map(type, values)) <= _MASK_TYPES and set(values) <= _MASK_VALUES:
        return list(map(int, values))
    return None


def _int32_ids(ids: list[Any]) -> bool:
    """Plain ints (no bools) that fit a signed 32-bit array."""
    if set(map(type, ids)) - {int}:
        return False
    try:
        array("i", ids)
    except OverflowError:
        return False
    return True


def extract(span: Span, warnings: list[str]) -> TokenArrays | None:
    """The span's per-token arrays, or None when it has none (or none that line up with its ids).

    An array that is not a list of numbers, or not one entry per token id, is named in
    ``warnings`` and left in the payload as sent.
    """
    output = span.get("output")
    if not isinstance(output, dict) or _ARRAY_KEY_SET.isdisjoint(output):  # most spans: one C-level look
        return None
    id_key = next((k for k in ID_KEYS if isinstance(output.get(k), (list, RawIds))), None)
    if id_key is None:
        return None
    present = {name: key for name, keys in ARRAY_KEYS.items()
               if (key := next((k for k in keys if isinstance(output.get(k), list)), None)) is not None}
    if not present:  # most spans (a server's generate call): nothing to pack, the ids are not looked at
        return None
    ids = as_list(output[id_key])  # ids kept as received (receivers/raw_ids.py): the ints are needed here
    if not _int32_ids(ids):
        return None
    sources = {"ids": id_key}  # which output key each array came from
    found = TokenArrays(ids=list(ids), keys=sources)
    for name, key in present.items():
        values = output[key]
        if len(values) != len(ids):
            warnings.append(f"output.{key}: {len(values)} values for {len(ids)} tokens in output.{id_key}; not packed")
            continue
        parsed = _mask(values) if name == "mask" else _floats(values)
        if parsed is None:
            kind = "0/1 integers" if name == "mask" else "numbers"
            warnings.append(f"output.{key}: not a list of {kind}; not packed")
            continue
        setattr(found, name, parsed)
        sources[name] = key
    if found.logprobs is None and found.mask is None and found.entropy is None:
        return None
    return found


def strip_from_payload(span: Span, arrays: TokenArrays) -> None:
    """Replaces the packed float lists in the span's output by a short note (local mode)."""
    output = span["output"]
    for name in ("logprobs", "entropy"):  # the mask stays: small ints, and the output keeps VERL's shape
        key = (arrays.keys or {}).get(name)
        if key is not None and getattr(arrays, name) is not None:
            output[key] = PACKED_NOTE.format(n=len(arrays.ids), trace_id=span.get("trace_id"))
