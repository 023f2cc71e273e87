"""Token id lists kept as the bytes received, not as Python ints (issue 32, item 1).

With token2text off the collector rarely needs a span's token ids one by one: it stores them,
and the store's payload writes back exactly the digits the client sent. Parsing 2,000 ids into
int objects and dumping them again was most of the collector's CPU per span (docs/performance.md,
``bench/raw_ids.py``). So in a JSON body, each array of plain integers under a key of
:data:`POSITIONS` (``"prompt_ids":[``, ``"response_ids":[``, ``"token_ids":[``, written compactly
as every tracecar client and orjson write it) is located as bytes, the rest of the body is parsed
with a small placeholder where each array was, and the arrays at a span's ``inputs.prompt_ids``
and its output's ``prompt_ids``/``response_ids``/``token_ids`` become :class:`RawIds`. One found
anywhere else (nested deeper, in attributes) is turned back into a list at once, so nothing else
in the collector ever sees one. The few stages that need the ints parse them when they do (a
later turn's prompt reference, per-token arrays, a batch that asks for token2text).

Exactness: an array is kept raw only if it is digits and commas alone (no sign, no space, no
leading zero, 1 to 19 digits an item), so its ints are exactly what ``orjson.loads`` would give
and its bytes exactly what ``orjson.dumps`` of them writes. A body that holds ``\\u0000`` (the
placeholder's key could then be forged) or that the placeholder parse refuses is parsed as it
came, so an error names the same place it would have.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from ..heap import HEAP
from ..loudness import describe_error
from ..types import RawIds

log = logging.getLogger("tracecar.collector")

KEY_END = b'_ids":['
PLACEHOLDER = "\x00tracecar_ids"  # no client can write this key: a body holding \u0000 is never rewritten
_PLACEHOLDER_OPEN = b'{"\\u0000tracecar_ids":'
_ESCAPED_NUL = b"\\u0000"
POSITIONS: dict[str, tuple[str, ...]] = {"inputs": ("prompt_ids",), "output": ("prompt_ids", "response_ids", "token_ids")}
GROUP_BYTES = 1 << 20  # arrays checked together by numpy: each temporary stays under the heap's mmap threshold (heap.py)
MAX_ARRAY_BYTES = 1 << 20  # an array longer than this (~170,000 ids, past any context length) is parsed as it is
MAX_DIGITS = 19  # every such integer is below 2**64: orjson keeps it an int, and writes it back the same digits
#: digits to "9", commas kept, anything else to "x": one translate tells the shape of an array
_SHAPE = bytes(ord("9") if chr(b).isdigit() and b < 128 else b if b == ord(",") else ord("x") for b in range(256))
_TOO_LONG = b"9" * (MAX_DIGITS + 1)


def materialize(spans: list[Any]) -> None:
    """Every :class:`RawIds` of these spans back to a list, in place (a batch that decodes)."""
    for span in spans:
        for part, keys in POSITIONS.items():
            holder = span.get(part)
            if type(holder) is dict:
                for key in keys:
                    value = holder.get(key)
                    if type(value) is RawIds:
                        holder[key] = value.tolist()


def _candidates(body: bytes | bytearray) -> list[tuple[int, int]]:
    """(first item, closing bracket) of each array under a key of :data:`POSITIONS`
    (``"prompt_ids":[``, ``"response_ids":[``, ``"token_ids":[``) up to its first ``]``, in order.

    In valid JSON ``_ids":[`` can only end a key (a quote inside a string is escaped as ``\\"``,
    and only a key is followed by a colon). Arrays under other keys are not even looked at: they
    are parsed as they are, so only such a key somewhere else than a span's inputs or output
    (rare) costs the walk that turns its array back into a list."""
    out: list[tuple[int, int]] = []
    find, pos = body.find, 0
    while True:
        key = find(KEY_END, pos)
        if key < 0:
            return out
        start = key + len(KEY_END)
        if body[key - 7:key] != b'"prompt' and body[key - 9:key] != b'"response' and body[key - 6:key] != b'"token':
            pos = start
            continue
        end = find(b"]", start)
        if end < 0:
            return out
        if end - start <= MAX_ARRAY_BYTES:  # longer: far past any context length, left to the parser
            out.append((start, end))
        pos = end


def locate_py(body: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(start, end, count) of each ``"…_ids":[…]`` array of plain integers (1 to 19 digits, no
    leading zero, single commas), in body order; any other array is left to the parser.

    The reference: :func:`locate` is the same, vectorised with numpy (tests compare them)."""
    out: list[tuple[int, int, int]] = []
    for start, end in _candidates(body):
        items = bytes(body[start:end])
        if not items:
            continue
        shape = items.translate(_SHAPE)
        if b"x" in shape or _TOO_LONG in shape or b",," in shape or shape[0] == 0x2C or shape[-1] == 0x2C \
                or _leading_zero(items):
            continue
        out.append((start - 1, end + 1, items.count(b",") + 1))
    return out


def _leading_zero(items: bytes) -> bool:
    """An item written with a leading zero ("07"), which JSON forbids: the parser must say so."""
    if items[0] == 0x30 and len(items) > 1 and items[1] != 0x2C:
        return True
    at = items.find(b",0")
    while at != -1:
        if at + 2 < len(items) and items[at + 2] != 0x2C:
            return True
        at = items.find(b",0", at + 2)
    return False


def _locate_np(body: bytes | bytearray, group_bytes: int = GROUP_BYTES) -> list[tuple[int, int, int]]:
    """:func:`locate_py` in a few passes of numpy over the candidate arrays, ``group_bytes`` of them
    at a time (about 1 ns a byte, ten times less than the byte-string checks, which cost about what
    parsing the ids does; the group, and :data:`MAX_ARRAY_BYTES` an array, bound the passes'
    temporaries: a few bytes a byte checked, whatever the arrays hold)."""
    np = _numpy()
    assert np is not None, "numpy is not installed: locate() takes the byte-string checks"
    out: list[tuple[int, int, int]] = []
    view = memoryview(body)
    group: list[tuple[int, int]] = []
    size = 0
    for start, end in _candidates(body):
        if end == start:  # [] is never kept: nothing to check
            continue
        group.append((start, end))
        size += end - start + 1
        if size >= group_bytes:
            out += _check_group(np, view, group)
            group, size = [], 0
    if group:
        out += _check_group(np, view, group)
    return out


def _check_group(np: Any, view: memoryview, found: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The arrays of ``found`` (none empty) that hold plain integers: their items joined with ``;``
    between arrays; every check is a shifted comparison of the whole buffer, OR-ed into one mask of
    the bytes that refuse their array, reduced to one flag an array."""
    joined = b";".join([view[s:e] for s, e in found])
    r = np.frombuffer(joined, np.uint8)
    offsets = [0] * len(found)
    for i in range(1, len(found)):
        offsets[i] = offsets[i - 1] + found[i - 1][1] - found[i - 1][0] + 1
    digit = (r - np.uint8(48)) < 10  # uint8 wraps: only "0".."9" are below 10
    other = ~digit
    comma = r == 44
    refuse = other & ~comma  # anything but a digit or a comma ...
    refuse[np.array(offsets[1:], dtype=np.int64) - 1] = False  # ... but the separators
    refuse[1:] |= other[:-1] & other[1:]  # an empty item: two non-digits in a row (named by the second)
    refuse[0] |= other[0]  # the first array starts with a comma
    refuse[-1] |= other[-1]  # the last one ends with one
    if len(r) > 2:  # an item that starts with 0 and goes on (a leading zero)
        refuse[1:-1] |= (r[1:-1] == 48) & other[:-2] & digit[2:]
    if len(r) > 1:
        refuse[0] |= (r[0] == 48) & digit[1]
    run = digit[1:] & digit[:-1]  # run[j]: digits at j and j+1; then 4, 8, 16, 20 digits from j on
    for shift in (2, 4, 8, 4):
        run = run[shift:] & run[:-shift]
    refuse[:len(run)] |= run
    refused = np.logical_or.reduceat(refuse, offsets).tolist()  # each array's bytes and the separator after it
    return [(s - 1, e + 1, int(np.count_nonzero(comma[o:o + e - s])) + 1)
            for (s, e), o, no in zip(found, offsets, refused) if not no]


_np: Any = None  # numpy, imported by the first body with id arrays (it costs ~0.1 s to import)
_NO_NUMPY = object()


def _numpy() -> Any:
    """numpy, or None where it is not installed (the collector extra installs it)."""
    global _np
    if _np is None:
        try:
            import numpy
        except ImportError:  # pragma: no cover - tests/unit/test_raw_ids.py forces this branch
            _np = _NO_NUMPY
        except Exception as exc:  # noqa: BLE001 - a broken install must not cost a request: the checks run without it
            log.warning("numpy could not be imported (%s); id arrays are checked without it, slower",
                        describe_error(exc), extra={"event": "numpy_unusable"})
            _np = _NO_NUMPY
        else:
            _np = numpy
    return None if _np is _NO_NUMPY else _np


def locate(body: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(start, end, count) of each array :func:`locate_py` finds, with numpy when it is installed
    (without it the byte-string checks give the same answer, slower)."""
    return locate_py(body) if _numpy() is None else _locate_np(body)


def parse_keeping_ids(body: bytes | bytearray) -> Any | None:
    """The body parsed with its span's id lists as :class:`RawIds`, or None when it must be parsed
    as it came (no such list, a body that holds ``\\u0000``, or one the placeholder parse refuses)."""
    arrays = locate(body) if _ESCAPED_NUL not in body else []
    if not arrays:
        return None
    pieces: list[bytes | bytearray | memoryview] = []
    kept: list[RawIds] = []
    view, last = memoryview(body), 0
    for i, (start, end, count) in enumerate(arrays):
        pieces.append(view[last:start])
        pieces.append(b"%s%d}" % (_PLACEHOLDER_OPEN, i))
        kept.append(RawIds(bytes(view[start:end]), count))
        last = end
    pieces.append(view[last:])
    try:
        parsed = HEAP.parse(orjson.loads, b"".join(pieces))
    except orjson.JSONDecodeError:
        return None
    if _splice(parsed, kept) < len(kept):
        _materialize_everywhere(parsed, kept)
    return parsed


def _placeholder(value: Any) -> int | None:
    if type(value) is dict and len(value) == 1:
        index = value.get(PLACEHOLDER)
        if type(index) is int:
            return index
    return None


def _splice(parsed: Any, kept: list[RawIds]) -> int:
    """Puts each kept array at its known position of a span; returns how many were put."""
    spans = parsed.get("spans") if type(parsed) is dict else None
    if type(spans) is not list:
        return 0
    done = 0
    for span in spans:
        if type(span) is not dict:
            continue
        for part, keys in POSITIONS.items():
            holder = span.get(part)
            if type(holder) is not dict:
                continue
            for key in keys:
                index = _placeholder(holder.get(key))
                if index is not None:
                    holder[key] = kept[index]
                    done += 1
    return done


def _materialize_everywhere(parsed: Any, kept: list[RawIds]) -> None:
    """Every placeholder not at a known position (a ``prompt_ids`` key nested deeper, say) becomes
    the list it stood for (walked without recursion: a body may nest as deep as the parser allows)."""
    stack = [parsed]
    while stack:
        value = stack.pop()
        if type(value) is dict:
            for key, item in value.items():
                index = _placeholder(item)
                if index is not None:
                    value[key] = kept[index].tolist()
                elif type(item) is dict or type(item) is list:
                    stack.append(item)
        elif type(value) is list:
            for i, item in enumerate(value):
                index = _placeholder(item)
                if index is not None:
                    value[i] = kept[index].tolist()
                elif type(item) is dict or type(item) is list:
                    stack.append(item)
