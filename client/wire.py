"""Wire format: how the client packs spans (the collector accepts JSON and msgpack).

A batch is ``{"v": 1, "worker": str, "project": str|None, "entity": str|None,
"tokenizer": str|None, "wandb_run_id": str (optional), "spans": [span, ...]}``. The client sends JSON built by orjson: on this
kind of machine it packs a 2,000-id list about 4× faster than msgpack's C packer, and token ids
stay ids (never decoded in the worker). Each span is packed once, on the sender thread, and the
batch body is the packed spans joined, so batches are cut by exact byte counts.

Two ways to pack a span: the fast path hands the captured structure to orjson with a
``default`` hook for non-builtin values (pydantic models, numpy, objects); a span whose bytes
may hold a redact key, anything that path
cannot take (cycles, nesting past 254 levels, integers past 64 bits), a non-finite top-level
number (orjson would turn a NaN reward into null), or a result larger than the string bound
goes through :class:`WireEncoder`, which walks the value in Python and applies every bound.
"""

from __future__ import annotations

import datetime
import enum
import math
from typing import Any

import orjson

from .redact import DEFAULT as DEFAULT_REDACT
from .redact import REDACTED, RedactKeys, redact_value

WIRE_VERSION = 1
# version 2: inputs.prompt_ids may be {"$ref", "n", "add"} (tracecar.client.prompt_delta); sent
# only to a collector whose answers list it in "wire_versions"
WIRE_VERSION_DELTA = 2
JSON_CONTENT_TYPE = "application/json"
_TRUNCATED = "…[truncated by tracecar: {n} chars]"
# dataclasses, numpy values and datetimes go through ``default`` too, so they get weave's envelope /
# repr / CustomWeaveType rather than orjson's plain dict / list / ISO text
_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
# Token-id fields the collector decodes (tracecar.collector.processors.decoding's PROMPT_KEYS/RESPONSE_KEYS):
# an integer numpy array there travels as a list, so token2text still works; every other numpy
# value is its repr, as weave stores it (``np.int64(0)``, ``array([...], dtype=object)``).
ID_KEYS = ("prompt_ids", "response_ids", "token_ids")
_WEAVE_MAX_STR_LEN = 1000  # weave.trace.serialization.serialize.MAX_STR_LEN
#: A non-finite float down to this depth of the span (2: a value at the top level of ``inputs``,
#: ``output`` or ``attributes``) is written as ``"nan"`` / ``"inf"`` / ``"-inf"``; deeper, null.
NON_FINITE_TEXT_DEPTH = 2


class WireEncoder:
    """Turns arbitrary traced values into JSON-able data within explicit bounds, as weave would.

    Non-builtin values follow weave's serialisation rules (``weave.trace.serialization``):
    pydantic models and dataclasses become weave's type envelope (``_type``, the fields,
    ``_class_name``, ``_bases``), tuples (namedtuples too: weave's redaction makes them plain)
    lists, objects with ``to_dict`` that dict, and anything else its ``repr`` (cut at weave's 1,000 characters). Values under a redact key
    (:mod:`tracecar.client.redact`) become ``"REDACTED"``. On the slow path (:meth:`encode`),
    strings longer than ``max_string_chars`` are cut with a marker; nesting deeper than
    ``max_depth`` and cycles become a repr; non-finite floats at the top level of inputs, output
    and attributes become the strings ``nan``, ``inf``, ``-inf`` (deeper ones null, as weave writes
    them); so a hostile or huge output can never stall or crash the sender.
    """

    def __init__(self, max_string_chars: int = 1_000_000, max_depth: int = 32,
                 redact: RedactKeys = DEFAULT_REDACT) -> None:
        self.max_string_chars = max_string_chars
        self.max_depth = max_depth
        self.redact = redact

    def encode(self, value: Any, depth: int = 0) -> Any:
        kind = type(value)
        if value is None or kind is bool:
            return value
        if kind is int:
            return value if -(2**63) <= value < 2**64 else str(value)
        if kind is float:
            if math.isfinite(value):
                return value
            # text where it says something (a NaN reward or score: the top level of inputs, output
            # and attributes; weave's null would read as "no reward"); deeper, null as weave writes it
            return repr(value) if depth <= NON_FINITE_TEXT_DEPTH else None
        if kind is str:
            return self._cut(value)
        if isinstance(value, float) and not isinstance(value, enum.Enum):  # np.float64: a number, at its own depth
            return self.encode(float(value), depth)
        if depth >= self.max_depth:  # written as its repr, secrets at any depth below redacted first (as weave walks them)
            return self._cut(self.redact.scrub_text(repr(redact_value(value, self.redact))))
        if kind is list or kind is tuple:
            return [self.encode(v, depth + 1) for v in value]
        if kind is dict:
            keys = self.redact
            return {str(k): REDACTED if k in keys else self.encode(v, depth + 1) for k, v in value.items()}
        if kind is bytes or kind is bytearray:
            return self.stringify(value)  # weave has no serializer for bytes: their repr
        return self.encode(self.flatten(value), depth + 1)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_string_chars:
            return text
        return text[: self.max_string_chars] + _TRUNCATED.format(n=len(text) - self.max_string_chars)

    def flatten(self, value: Any) -> Any:
        """One level of conversion for a non-builtin value (never recursive itself)."""
        if isinstance(value, enum.Enum):
            return weave_enum(value, self.stringify)
        if isinstance(value, float):  # np.float64 and other float subclasses: weave keeps them numbers
            return float(value)
        if isinstance(value, datetime.datetime):
            return weave_datetime(value)
        shape = value_shape(type(value))
        if shape is not None:
            try:  # (orjson writes what this returns itself: enums in the fields are made weave's here)
                return _plain_enums(shape.envelope(ids_as_lists(shape.fields_of(value))), 1, self.stringify)
            except Exception:  # noqa: BLE001 - a field that raises: the model is traced as its repr
                return self.stringify(value)
        if type(value).__module__.split(".")[0] == "numpy":
            return self.stringify(value)  # weave keeps no numpy type: it stores the repr
        tolist = getattr(value, "tolist", None)  # torch tensors
        if callable(tolist) and type(value).__module__.split(".")[0] == "torch":
            try:
                return tolist()
            except Exception:  # noqa: BLE001
                return self.stringify(value)
        if isinstance(value, (tuple, list)):  # sets are no container to weave: their repr, below
            return list(value)
        if isinstance(value, dict):
            return dict(value)
        if not isinstance(value, (type, BaseException, bytes, bytearray)):
            to_dict = getattr(value, "to_dict", None)  # weave's Dictifiable protocol
            if callable(to_dict):
                try:
                    as_dict = to_dict()
                except Exception:  # noqa: BLE001 - weave falls through to the repr as well
                    as_dict = None
                if isinstance(as_dict, dict):
                    return as_dict
        return self.stringify(value)

    def stringify(self, value: Any) -> str:
        """weave's ``stringify``: the repr (else str), cut to 1,000 characters, secrets scrubbed."""
        try:
            rep = repr(value)
        except Exception:  # noqa: BLE001
            try:
                rep = str(value)
            except Exception:  # noqa: BLE001
                rep = f"<{type(value).__name__}: {id(value)}>"
        if len(rep) > _WEAVE_MAX_STR_LEN:
            rep = rep[: _WEAVE_MAX_STR_LEN - 3] + "..."
        return self.redact.scrub_text(rep)


# ---- enums and datetimes as weave writes them ----------------------------------------------
DATETIME_TYPE = "datetime.datetime"  # weave's serializer id for datetime (weave/type_handlers/DateTime)


def weave_enum(value: enum.Enum, stringify: Any) -> Any:
    """weave keeps an int / str / float enum (``IntEnum``, ``StrEnum``) as the primitive it is (its
    value, once JSON); any other enum has no serializer there: its repr, ``"<Color.RED: 'red'>"``."""
    if isinstance(value, (int, str, float)):
        return value.value
    return stringify(value)


def weave_datetime(value: datetime.datetime) -> dict[str, Any]:
    """weave's custom type for a datetime (a naive one taken as UTC, as weave's ``save`` does); the
    collector's Weave sink adds ``load_op``, the ref of weave's ``load_datetime.datetime`` op in
    the call's project (which only the collector knows)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    return {"_type": "CustomWeaveType", "weave_type": {"type": DATETIME_TYPE}, "val": value.isoformat()}


def _attribute_text(value: datetime.datetime | datetime.date | datetime.time) -> str:
    """weave sends attributes through pydantic's ``to_jsonable_python``: ISO text, UTC as ``Z``."""
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _is_plain_enum(value: Any) -> bool:
    return isinstance(value, enum.Enum) and not isinstance(value, (int, str, float))


def _plain_enums(value: Any, depth: int, stringify: Any) -> Any:
    """``value`` with every non-primitive enum as its repr, ``depth`` container levels down (a copy
    only where one is): orjson writes an enum as its value before ``default`` could see it."""
    kind = type(value)
    if kind is dict:
        out = value
        for key, item in value.items():
            item_kind = type(item)
            if item_kind in _PLAIN_ITEMS:  # most values: one set lookup
                continue
            if item_kind is dict or item_kind is list or item_kind is tuple:
                if depth <= 0:
                    continue
                new = _plain_enums(item, depth - 1, stringify)
            elif _is_plain_enum(item):
                new = stringify(item)
            else:
                continue
            if new is not item:
                if out is value:
                    out = dict(value)
                out[key] = new
        return out
    if (kind is list or kind is tuple) and value and depth > 0:
        if type(value[0]) in _PLAIN_ITEMS and type(value[-1]) in _PLAIN_ITEMS:  # token ids, logprobs, texts
            return value
        items = [stringify(v) if _is_plain_enum(v) else _plain_enums(v, depth - 1, stringify) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


_PLAIN_ITEMS = frozenset({int, float, str, bool, type(None)})
_repr = WireEncoder().stringify  # weave's stringify with weave's own redact keys (callers pass their encoder's)
ENUM_SCAN_DEPTH = 3  # container levels of inputs / output searched for enums on the fast path


class ValueShape:
    """How one pydantic model or dataclass type is written: its fields and weave's envelope."""

    __slots__ = ("name", "bases", "fields", "pydantic")

    def __init__(self, cls: type, pydantic: bool) -> None:
        self.name = cls.__name__
        self.pydantic = pydantic
        if pydantic:
            serialized_bases = getattr(cls, "_weave_serialized_bases", None)
            self.bases = list(serialized_bases) if serialized_bases else [c.__name__ for c in cls.mro()[1:-1]]
            self.fields = tuple((name, getattr(f, "alias", None) or name)
                                for name, f in cls.model_fields.items() if not getattr(f, "exclude", None))  # type: ignore[attr-defined]
        else:
            self.bases = [c.__name__ for c in cls.mro()[1:-1]]
            self.fields = tuple((name, name) for name in cls.__dataclass_fields__)  # type: ignore[attr-defined]

    def fields_of(self, value: Any) -> dict[str, Any]:
        """The fields by name, read one level (what a snapshot stores, too)."""
        return {name: getattr(value, name, None) for name, _ in self.fields}

    def envelope(self, values: dict[str, Any]) -> dict[str, Any]:
        """weave's ObjectRecord JSON: ``_type`` first, the fields (by alias), then ``_class_name``, ``_bases``."""
        out: dict[str, Any] = {"_type": self.name}
        for name, key in self.fields:
            out[key] = values.get(name)
        out["_class_name"] = self.name
        out["_bases"] = list(self.bases)
        return out


_shapes: dict[type, ValueShape | None] = {}


def value_shape(cls: type) -> ValueShape | None:
    """The shape of a pydantic model or dataclass type (cached per type), else None."""
    try:
        return _shapes[cls]
    except KeyError:
        pass
    shape: ValueShape | None = None
    try:
        if isinstance(getattr(cls, "model_fields", None), dict) and hasattr(cls, "__pydantic_fields__"):
            shape = ValueShape(cls, pydantic=True)
        elif isinstance(getattr(cls, "__dataclass_fields__", None), dict):
            shape = ValueShape(cls, pydantic=False)
    except Exception:  # noqa: BLE001 - an odd class is written as its repr instead
        shape = None
    _shapes[cls] = shape
    return shape


_isfinite = math.isfinite
#: exact types that are never an enum, a date or a non-finite number: skipped with one set lookup
_INERT = frozenset({int, str, bool, type(None)})
#: an attribute of these exact types is no date and no number (containers are not looked into)
_ATTRIBUTE_INERT = _INERT | {dict, list, tuple}
_DATES = (datetime.date, datetime.time)


def _is_non_finite(value: Any) -> bool:
    # isinstance: np.float64 too, which orjson (through ``default``) would also write as null
    return isinstance(value, float) and not _isfinite(value)


def ids_as_lists(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with integer numpy arrays under :data:`ID_KEYS` as lists (a copy only if one is)."""
    out = values
    for key in ID_KEYS:
        ids = values.get(key)
        if ids is not None and _is_id_array(ids):
            if out is values:
                out = dict(values)
            out[key] = ids.tolist()
    return out


def _is_id_array(ids: Any) -> bool:
    return type(ids).__module__ == "numpy" and getattr(getattr(ids, "dtype", None), "kind", "") in "iu" \
        and getattr(ids, "ndim", 0) == 1


def _weave_part(values: dict[str, Any], stringify: Any) -> tuple[dict[str, Any], bool]:
    """Top-level ``inputs`` / ``output`` as the fast path writes them, in one pass over its values:
    integer numpy arrays under :data:`ID_KEYS` as lists (:func:`ids_as_lists`), enums made weave's
    :data:`ENUM_SCAN_DEPTH` levels down (:func:`_plain_enums`), and whether a top-level value is a
    non-finite number; a copy only where a value changes. The same result as those three walks one
    after another, at one look per value for the usual ones (numbers, texts, lists of ids)."""
    out = values
    non_finite = False
    below = ENUM_SCAN_DEPTH - 1
    for key, item in values.items():
        kind = type(item)
        if kind in _INERT:
            continue
        if kind is float:
            if not _isfinite(item):
                non_finite = True
            continue
        if kind is list or kind is tuple:
            if not item or (type(item[0]) in _PLAIN_ITEMS and type(item[-1]) in _PLAIN_ITEMS):  # ids, logprobs, texts
                continue
            new = _plain_enums(item, below, stringify)
        elif kind is dict:
            new = _plain_enums(item, below, stringify)
        elif key in ID_KEYS and _is_id_array(item):
            new = item.tolist()
        elif _is_plain_enum(item):
            new = stringify(item)
        else:
            if _is_non_finite(item):
                non_finite = True
            continue
        if new is not item:
            if out is values:
                out = dict(values)
            out[key] = new
    return out, non_finite


def _fast_path_fits(wire: dict[str, Any], stringify: Any = None) -> bool:
    """Unwraps packed id arrays in inputs/output back to lists, writes enums as weave does and the
    attributes' datetimes as ISO text (in place); False when a top-level non-finite number (which
    orjson would write as null) sends the span through the walk."""
    stringify = stringify or _repr
    non_finite = _weave_attributes(wire)
    for part in ("output", "inputs"):
        value = wire.get(part)
        if type(value) is dict:
            wire[part], found = _weave_part(value, stringify)
            non_finite = non_finite or found
        elif isinstance(value, enum.Enum) or type(value) is list or type(value) is tuple:
            wire[part] = _plain_enums({"": value}, ENUM_SCAN_DEPTH, stringify)[""]
        elif isinstance(value, dict) and any(map(_is_non_finite, value.values())):  # a dict subclass: looked at only
            non_finite = True
    return not non_finite


def _weave_attributes(wire: dict[str, Any]) -> bool:
    """Attributes' datetimes as weave's ``to_jsonable_python`` writes them (ISO text), in place;
    True when an attribute is a non-finite number."""
    attributes = wire.get("attributes")
    if not isinstance(attributes, dict):
        return False
    non_finite = dates = False
    for value in attributes.values():
        kind = type(value)
        if kind in _ATTRIBUTE_INERT:
            continue
        if kind is float:
            if not _isfinite(value):
                non_finite = True
        elif isinstance(value, _DATES):
            dates = True
        elif _is_non_finite(value):
            non_finite = True
    if dates and type(attributes) is dict:
        wire["attributes"] = {k: _attribute_text(v) if isinstance(v, _DATES) else v for k, v in attributes.items()}
    return non_finite


def pack_span(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> bytes:
    """Packs one span as JSON: the fast path when it can, the bounded Python walk when it must.

    Numeric lists (token ids, logprobs, masks) at the top of ``inputs`` / ``output`` (and one
    dict further down: a prompt reference's ``add``) are packed on their own and spliced into the
    span's JSON as they are; a list whose JSON holds no quote holds no string, hence no key, so
    the redaction byte search runs over the rest of the span only (a few hundred bytes instead of
    the ~12 KB of a 2,000-id span). The bytes are exactly what one ``orjson.dumps`` of the whole
    span gives. A span whose bytes may hold a redact key, anything the fast path cannot take
    (cycles, nesting past 254 levels, integers past 64 bits), a non-finite top-level number
    (orjson would turn a NaN reward into null), or a result larger than the string bound goes
    through the bounded walk, which replaces those values, so a secret never leaves the worker.
    """
    pieces = pack_span_pieces(wire, encoder, size_limit)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def pack_span_pieces(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> list[bytes]:
    """:func:`pack_span`'s bytes as the pieces they are joined from (the span's JSON around its
    spliced lists, and the lists): the sender joins a whole body's pieces at once
    (:func:`batch_body_pieces`), so a span's ids are copied once on their way to the socket, not twice."""
    if _fast_path_fits(wire, encoder.stringify):
        try:
            if _Fragment is not None and encoder.redact.spliceable:
                pieces = _pack_spliced(wire, encoder, size_limit)
            else:
                whole = _pack_whole(wire, encoder, size_limit)
                pieces = [whole] if whole is not None else None
            if pieces is not None:
                return pieces
        except (orjson.JSONEncodeError, TypeError, OverflowError, RecursionError):
            pass
    return [orjson.dumps(encoder.encode(wire), option=_OPTIONS)]


def pieces_size(pieces: list[bytes]) -> int:
    """Bytes of a packed span given as pieces."""
    return len(pieces[0]) if len(pieces) == 1 else sum(map(len, pieces))


def pack_span_legacy(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> bytes:
    """The previous packing (one dump, the byte search over all of it, default fields sent):
    kept so a benchmark can run it beside :func:`pack_span` in one run (``TRACECAR_PACKING=legacy``)."""
    if _fast_path_fits(wire, encoder.stringify):
        try:
            packed = orjson.dumps(wire, default=encoder.flatten, option=_OPTIONS)
            if len(packed) <= size_limit and not _legacy_might_hold(encoder.redact, packed, max(0, packed.find(b'"attributes":'))):
                return packed
        except (orjson.JSONEncodeError, TypeError, OverflowError, RecursionError):
            pass
    return orjson.dumps(encoder.encode(wire), option=_OPTIONS)


def _legacy_might_hold(redact: RedactKeys, packed: bytes, start_at: int) -> bool:
    """The previous byte search (split at quotes, pieces of a key's length compared), for the baseline only."""
    if redact._always_walk:
        return True
    body = packed[start_at:]
    if (not body.isascii() or b"\\" in body) and redact._odd_key(body):
        return True
    pieces = body.split(b'"')
    lengths = redact._lengths
    if lengths.isdisjoint(map(len, pieces)):
        return False
    return any(p.lower() in redact._needle_set for p in pieces if len(p) in lengths)


def _pack_whole(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> bytes | None:
    """One dump, then the byte search over it; None: take the walk."""
    packed = orjson.dumps(wire, default=encoder.flatten, option=_OPTIONS)
    # the span's own fields before "attributes" are ids and names: no key to redact there
    if len(packed) <= size_limit and not encoder.redact.might_hold(packed, start_at=max(0, packed.find(b'"attributes":'))):
        return packed
    return None


_Fragment = getattr(orjson, "Fragment", None)  # orjson >= 3.10: already-packed JSON spliced in as is
_NUMBERS = (int, float)
SPLICE_MIN_ITEMS = 16  # a shorter list costs less inline than packed apart
_OMIT_IF_NONE = ("parent_id", "end_time", "output", "exception")
_ABSENT = object()
_MAX_SPLICED = 31  # placeholders are \x00 + one byte 1..31: control bytes, never in orjson's output
#: the placeholders, made once (orjson writes a Fragment's bytes as they are)
_PLACEHOLDERS = [_Fragment(b"\x00" + bytes((i,))) for i in range(1, _MAX_SPLICED + 1)] if _Fragment is not None else []


def _pack_spliced(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> list[bytes] | None:
    """Numeric lists packed apart and spliced in (as pieces to join); the byte search over the rest;
    None: take the walk."""
    lists: list[bytes] = []
    flatten = encoder.flatten
    shell = dict(wire)
    for key in ("inputs", "output"):
        value = shell.get(key)
        if type(value) is dict:
            shell[key] = _splice_lists(value, lists, flatten, 0)
    for key in _OMIT_IF_NONE:  # the collector's defaults (SpanIn): sent only when they say something
        if shell.get(key, _ABSENT) is None:
            del shell[key]
    if shell.get("kind") == "op":
        del shell["kind"]
    small = orjson.dumps(shell, default=flatten, option=_OPTIONS)
    if encoder.redact.might_hold(small, start_at=max(0, small.find(b'"attributes":'))):
        return None
    if not lists:
        return [small] if len(small) <= size_limit else None
    pieces = small.split(b"\x00")
    out = [pieces[0]]
    size = len(small) - 2 * len(lists)
    for piece in pieces[1:]:
        packed = lists[piece[0] - 1]
        size += len(packed)
        out.append(packed)
        out.append(piece[1:])
    return out if size <= size_limit else None


def _splice_lists(container: dict[Any, Any], lists: list[bytes], flatten: Any, depth: int) -> dict[Any, Any]:
    """``container`` with each numeric list replaced by a placeholder for its packed bytes (a copy
    only if one is); a list qualifies when its JSON holds no quote (so no string, no dict key) and
    no nested list (so orjson's depth bound is not in play: the bytes are those of the inline dump)."""
    out = container
    for key, value in container.items():
        kind = type(value)
        if kind is list:
            if len(value) < SPLICE_MIN_ITEMS or type(value[0]) not in _NUMBERS or type(value[-1]) not in _NUMBERS \
                    or len(lists) >= _MAX_SPLICED:
                continue
            packed = orjson.dumps(value, default=flatten, option=_OPTIONS)
            if b'"' in packed or packed.find(b"[", 1) != -1:
                continue
            lists.append(packed)
            new: Any = _PLACEHOLDERS[len(lists) - 1]
        elif kind is dict and depth == 0:
            if list not in map(type, value.values()):  # no list one level down to splice (one C-level look)
                continue
            new = _splice_lists(value, lists, flatten, 1)
            if new is value:
                continue
        else:
            continue
        if out is container:
            out = dict(container)
        out[key] = new
    return out


def batch_body(header: dict[str, Any], packed_spans: list[bytes]) -> bytes:
    """The request body: the envelope with the already-packed spans spliced in (one copy of the spans)."""
    head = orjson.dumps({**header, "spans": []})[:-3] + b"["
    if not packed_spans:
        return head + b"]}"
    return b",".join([head + packed_spans[0], *packed_spans[1:-1], packed_spans[-1] + b"]}"] if len(packed_spans) > 1
                     else [head + packed_spans[0] + b"]}"])


def batch_body_pieces(header: dict[str, Any], spans: list[list[bytes]]) -> bytes:
    """:func:`batch_body` of spans packed as pieces (:func:`pack_span_pieces`): one join for the
    whole body, the same bytes."""
    return b"".join(body_pieces(header, spans))


def body_pieces(header: dict[str, Any], spans: list[list[bytes]]) -> list[bytes]:
    """The pieces :func:`batch_body_pieces` joins: the envelope's head, each span's pieces
    between commas, the closing brackets (a benchmark can hand them to the socket unjoined)."""
    head = orjson.dumps({**header, "spans": []})[:-3] + b"["
    out = [head]
    append, extend = out.append, out.extend
    for i, pieces in enumerate(spans):
        if i:
            append(b",")
        extend(pieces)
    append(b"]}")
    return out
