"""Receive: turn a raw HTTP body into Python data, with every size bound enforced.

The body is read raw (not through FastAPI's pydantic body parsing, which costs about half the
throughput), decompressed incrementally so a zip bomb stops at the bound instead of filling RAM,
and parsed with msgpack or orjson by its content type.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Any

import msgpack
import orjson
import zstandard

from ..heap import HEAP
from .raw_ids import parse_keeping_ids

_CHUNK = 256 * 1024
_INFLATE_CHUNK = 4 * 1024 * 1024  # the largest piece of compressed input fed to zlib at once (after member 1)
MAX_GZIP_MEMBERS = 4096  # members in one gzip body; above, 400 (each costs a few µs of Python)
EXT_INT32_ARRAY = 1  # msgpack ext type: packed little-endian int32 token ids
#: the least one parsed object or array costs in memory (an empty dict is 64 bytes, a list 56): a
#: body of tiny containers (``{}`` is 2 bytes of JSON, 1 of msgpack) parses to 30-60 times its size
CONTAINER_BYTES = 64


def max_containers(max_decompressed_bytes: int) -> int:
    """Objects and arrays one body may parse into: together at most twice the decompressed bound
    in memory (the README's memory bound allows each decode thread four bodies' worth)."""
    return max(1024, 2 * max_decompressed_bytes // CONTAINER_BYTES)


def too_many_containers(found: int | None, limit: int) -> BodyError:
    held = f"{found} JSON/msgpack objects and arrays, more than {limit}" if found is not None else \
        f"more than {limit} JSON/msgpack objects and arrays"
    return BodyError(413, "body", f"body holds {held} "
                                  f"(2 x TRACECAR_MAX_DECOMPRESSED_BYTES / {CONTAINER_BYTES} bytes each, the least one "
                                  "costs parsed); split the batch")


def check_json_containers(body: bytes | bytearray, limit: int) -> None:
    """Refuses, before parsing, a JSON body that may hold more than ``limit`` objects and arrays.

    Counts ``{`` and ``[`` bytes (about 0.6 ms per MiB; only in bodies over ``2 * limit`` bytes,
    since each takes two bytes at least, so a batch of usual size pays nothing): an upper bound on what the
    parser builds (a brace inside a string counts too, so the bound errs on the generous side
    of memory; a body needs one every 32 bytes on average to reach it)."""
    if len(body) <= 2 * limit:  # each takes two bytes at least ("{}"): a body this small cannot hold more
        return
    found = body.count(b"{")
    if found <= limit:
        found += body.count(b"[")
    if found > limit:
        raise too_many_containers(found, limit)


class _ContainerBudget:
    """msgpack's object and list hooks: counts containers as they are built, refusing past ``limit``."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.left, self.limit = limit, limit

    def __call__(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise too_many_containers(None, self.limit)
        return value


def unpack_ext(code: int, data: bytes) -> Any:
    """msgpack ext_hook: packed int32 ids (ext type 1) back to a list of ints.

    A packed array whose length is not a multiple of 4 stays an ext value, as an unknown ext
    type does: one span's bad value never costs the batch (it is stored as sent, base64).
    """
    if code == EXT_INT32_ARRAY:
        if len(data) % 4:
            return msgpack.ExtType(code, data)
        values = array("i")
        values.frombytes(data)
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()
    return msgpack.ExtType(code, data)


_OUT_OF_RANGE = "number is infinity when parsed as double"  # orjson's refusal of 1e400


def _parse_wide_numbers(body: bytes | bytearray, first_error: Exception) -> Any:
    """Valid JSON with a number past a double's range (``1e400``, or an integer of 309 digits or
    more): orjson refuses the whole body, which would cost every span in it. The standard parser
    takes it with orjson's own rules for every other number (an integer within 64 bits stays an
    int, a larger one becomes a float), and the number no double holds kept as its text (a
    string), so only that value changes. Runs only after orjson refused a body for that reason,
    bounded like any body by TRACECAR_MAX_DECOMPRESSED_BYTES."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def number(text: str) -> float | str:
        value = float(text)
        return value if math.isfinite(value) else text

    def integer(text: str) -> int | float | str:
        if len(text) <= 20:  # as orjson: a 64-bit integer (signed or not) stays an int
            value = int(text)
            if -(2**63) <= value < 2**64:
                return value
        return number(text)

    try:
        return json.loads(body, parse_float=number, parse_int=integer, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BodyError(400, "body", f"invalid JSON: {exc}") from None


@dataclass
class BodyError(Exception):
    """A body-level problem: the whole request is refused with this status and message."""

    status: int
    field: str
    reason: str


def decompress(body: bytes | bytearray, encoding: str | None, limit: int) -> bytes | bytearray:
    """Undoes Content-Encoding (identity, gzip, deflate, zstd), stopping at ``limit`` bytes."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding in ("gzip", "x-gzip", "deflate"):
        return _inflate(body, encoding, limit)
    if encoding == "zstd":
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(body)
            parts, total = [], 0
            while chunk := reader.read(_CHUNK):
                total += len(chunk)
                if total > limit:
                    raise _too_big(limit)
                parts.append(chunk)
            return b"".join(parts)
        except zstandard.ZstdError as exc:
            raise BodyError(400, "Content-Encoding", f"body is not valid zstd: {exc}") from None
    raise BodyError(415, "Content-Encoding", f"unsupported content encoding {encoding!r}; use gzip, deflate, zstd or identity")


def _inflate(body: bytes | bytearray, encoding: str, limit: int) -> bytes:
    """gzip or deflate, bounded by ``limit`` bytes of output.

    A gzip body may hold several members one after another (RFC 1952 §2.2: the file is their
    concatenation, as ``cat a.gz b.gz`` makes); each is inflated in turn, all of them together
    within ``limit``. Input is fed in chunks so that finding where a member ends never copies
    the rest of the body (which would make many tiny members quadratic): the first member is
    fed the whole body, later ones chunks that start small and double while the member lasts;
    at most :data:`MAX_GZIP_MEMBERS` members. Zero padding after the last member is ignored,
    as gzip(1) does; anything else after it is a 400.
    """
    wbits = 16 + zlib.MAX_WBITS if encoding != "deflate" else zlib.MAX_WBITS
    view, size = memoryview(body), len(body)
    parts: list[bytes] = []
    total = pos = members = 0
    while True:
        if members >= MAX_GZIP_MEMBERS:
            raise BodyError(400, "Content-Encoding", f"gzip body holds more than {MAX_GZIP_MEMBERS} members")
        inflater = zlib.decompressobj(wbits)
        # the first member gets the whole body (one zlib call, the common case); later ones get
        # chunks growing while the member lasts, so a small member costs a small unused_data copy
        step = size if members == 0 else 1024
        while not inflater.eof:
            if pos >= size:
                raise BodyError(400, "Content-Encoding", f"{encoding} body is truncated")
            chunk = view[pos:pos + step]
            pos += len(chunk)
            if members:
                step = min(step * 2, _INFLATE_CHUNK)
            try:
                out = inflater.decompress(chunk, limit - total + 1)
            except zlib.error as exc:
                where = f" (member {members + 1})" if members else ""
                raise BodyError(400, "Content-Encoding", f"body is not valid {encoding}{where}: {exc}") from None
            total += len(out)
            if total > limit or inflater.unconsumed_tail:
                raise _too_big(limit)
            parts.append(out)
        pos -= len(inflater.unused_data)  # the next member starts inside the last chunk
        members += 1
        if encoding == "deflate" or pos >= size or (body[pos] == 0 and body.count(b"\x00", pos) == size - pos):
            return b"".join(parts)


def _too_big(limit: int) -> BodyError:
    return BodyError(413, "body", f"decompressed body exceeds TRACECAR_MAX_DECOMPRESSED_BYTES={limit}")


def parse(body: bytes | bytearray, content_type: str | None, containers: int | None = None, keep_ids: bool = False) -> Any:
    """Parses JSON or msgpack by Content-Type; anything else is a 415 naming what is accepted.

    ``containers``: the most objects and arrays the parsed body may hold (413 above, found
    before the parse for JSON, while parsing for msgpack), so that memory is bounded before
    parsing, not checked after it (:func:`max_containers`). ``keep_ids``: a JSON body's span id
    lists stay the bytes received (:mod:`.raw_ids`; for a pipeline that will not decode them)."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media in ("application/json", "text/json"):
        if containers is not None:
            check_json_containers(body, containers)
        if keep_ids:
            kept = parse_keeping_ids(body)
            if kept is not None:
                return kept
        try:
            return HEAP.parse(orjson.loads, body)  # a usual body's parse buffer reused warm (heap.py)
        except orjson.JSONDecodeError as exc:
            if _OUT_OF_RANGE in str(exc):
                return _parse_wide_numbers(body, exc)
            raise BodyError(400, "body", f"invalid JSON: {exc}") from None
    if media in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack"):
        hooks: dict[str, Any] = {}
        if containers is not None and len(body) > containers:  # each takes a byte at least
            budget = _ContainerBudget(containers)
            hooks = {"object_hook": budget, "list_hook": budget}
        try:
            return msgpack.unpackb(
                body, raw=False, ext_hook=unpack_ext, strict_map_key=False,
                unicode_errors="replace", max_bin_len=len(body), max_str_len=len(body), **hooks,
            )
        except BodyError:
            raise
        except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input
            raise BodyError(400, "body", f"invalid msgpack: {exc}") from None
    raise BodyError(415, "Content-Type", f"unsupported content type {media!r}; use application/json or application/msgpack")
