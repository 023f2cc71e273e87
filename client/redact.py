"""Redaction of secrets by key, shared by the client's sender thread and the collector.

Weave replaces the value under any ``api_key``, ``auth_headers`` or ``authorization`` key
(``weave.utils.sanitize._REDACT_KEYS``, matched case-insensitively on ``str`` keys at any depth)
with the string ``"REDACTED"`` before a call leaves the process. tracecar does the same with the
same default set, plus the keys named in ``TRACECAR_REDACT_KEYS``, on every part of a span
(attributes, inputs, output, exception), and goes further than weave in two places: outputs are
redacted too (weave redacts inputs only), and the text of an object's repr or an exception
message is scrubbed of ``key=value`` / ``'key': value`` pairs.

Cheap by construction: :func:`might_hold` is a byte search over an already packed body, so
the Python walk (:func:`redact_value`) runs only on spans that can hold a key at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson

DEFAULT_REDACT_KEYS: frozenset[str] = frozenset({"api_key", "auth_headers", "authorization"})
REDACTED = "REDACTED"  # weave.utils.sanitize.REDACTED_VALUE


class RedactKeys:
    """A frozen, lower-cased key set and the byte patterns that find it in packed JSON/msgpack."""

    __slots__ = ("keys", "_needles", "_needle_set", "_lengths", "_always_walk", "_text_re", "spliceable", "_quoted")

    def __init__(self, extra: Iterable[str] = ()) -> None:
        keys = set(DEFAULT_REDACT_KEYS)
        keys.update(k.strip().lower() for k in extra if k and k.strip())
        self.keys = frozenset(keys)
        # bytes.lower() folds ASCII only: a key that is not plain ASCII, or that JSON would
        # escape, cannot be found by a byte search, so such a set always takes the walk.
        self._always_walk = any(not k.isascii() or any(c in k for c in '"\\') or not k.isprintable()
                                for k in self.keys)
        # the sender splices numeric lists in after the search (tracecar.client.wire.pack_span): the
        # piece around one, ':[1,2],', could only be a key holding a bracket; such a set searches it all
        self.spliceable = not any(c in k for k in self.keys for c in "[]")
        self._needles = tuple(k.encode() for k in sorted(self.keys))
        self._needle_set = frozenset(self._needles)
        self._quoted = tuple(b'"' + n + b'"' for n in self._needles)
        self._lengths = frozenset(len(n) for n in self._needles)
        alternatives = "|".join(re.escape(k) for k in sorted(self.keys, key=len, reverse=True))
        # key, optional closing quote, = or :, then a quoted string or a bare token
        self._text_re = re.compile(
            rf"""(?i)((?<![\w-])(?:{alternatives})['"]?\s*[:=]\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,;)}}\]]+)"""
        )

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self.keys

    def might_hold(self, packed: bytes | bytearray, is_json: bool = True, start_at: int = 0) -> bool:
        """False only when no key can be in ``packed`` (false hits are fine: they cost a walk).

        JSON: the pieces between quotes are compared with the key set. Other formats (msgpack): a
        substring search per key. ``start_at`` skips a prefix known to hold no such key.
        """
        if self._always_walk:
            return True
        body = packed[start_at:] if start_at else packed
        if is_json and (not body.isascii() or b"\\" in body):
            # a key written with an escape ("api\u005fkey") or with a character that lower-cases
            # to ASCII (a Kelvin sign K) matches no needle byte for byte: look at such pieces closer
            if self._odd_key(body):
                return True
        elif not is_json and _KELVIN in body:  # msgpack strings are raw UTF-8: the one such character
            return True
        if is_json:
            # Every key is a whole quoted string: a piece between two quotes equal to a key is the
            # key with its quotes around it, so one C substring search per key over the lower-cased
            # body finds exactly the pieces a split at quotes would (measured 3–5× faster than
            # splitting and comparing the pieces of a key's length).
            low = body.lower()
            return any(q in low for q in self._quoted)
        low = packed.lower()
        return any(n in low for n in self._needles)

    def _odd_key(self, body: bytes | bytearray) -> bool:
        """Is a quoted piece with an escape or a non-ASCII byte, decoded, one of the keys?"""
        longest = 6 * max(self._lengths)  # a key written entirely in \uXXXX escapes
        for piece in bytes(body).split(b'"'):
            if len(piece) > longest or (piece.isascii() and b"\\" not in piece):
                continue
            if (len(piece) - len(piece.rstrip(b"\\"))) % 2:  # cut at an escaped quote: part of a longer string
                continue
            try:
                text = orjson.loads(b'"' + piece + b'"')
            except orjson.JSONDecodeError:
                return True  # cannot tell: walk
            if text.lower() in self.keys:
                return True
        return False

    def scrub_text(self, text: str) -> str:
        """``api_key='sk-…'`` / ``"Authorization": "Bearer …"`` inside free text, value replaced."""
        low = text.lower()
        if not any(k in low for k in self.keys):
            return text
        return self._text_re.sub(lambda m: m.group(1) + REDACTED, text)


def parse_keys(raw: str | None) -> tuple[str, ...]:
    """``TRACECAR_REDACT_KEYS``: comma-separated key names (matched case-insensitively)."""
    if not raw:
        return ()
    return tuple(k.strip().lower() for k in raw.split(",") if k.strip())


_KELVIN = "\u212a".encode()  # KELVIN SIGN: the non-ASCII character whose lower() is an ASCII letter (k)

DEFAULT = RedactKeys()


def redact_value(value: Any, keys: RedactKeys = DEFAULT, depth: int = 0, max_depth: int = 254) -> Any:
    """A copy of a JSON-like value with every value under a redact key replaced by ``REDACTED``.

    Walks dicts, lists and tuples (as weave's ``redact_sensitive_keys`` does); anything else,
    strings included, is returned as is (a prompt that mentions "api_key" stays intact). Past
    ``max_depth`` (the 254 levels the store keeps) a container is replaced by a marker rather
    than walked.
    """
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        if depth >= max_depth:
            return "…[not shown: nested past the redaction depth]"
        if kind is dict:
            return {k: (REDACTED if k in keys else redact_value(v, keys, depth + 1, max_depth)) for k, v in value.items()}
        return [redact_value(v, keys, depth + 1, max_depth) for v in value]
    return value


def redact_span(span: dict[str, Any], keys: RedactKeys = DEFAULT) -> None:
    """Redacts a wire span dict in place: attributes, inputs, output by key; the exception text
    and its message (free text an error may have formatted a secret into) by ``key=value``."""
    for name in ("attributes", "inputs", "output"):
        value = span.get(name)
        if value is not None:
            span[name] = redact_value(value, keys)
    scrub_exception(span, keys)


def scrub_exception(span: dict[str, Any], keys: RedactKeys = DEFAULT) -> None:
    """``key=value`` secrets an error formatted into its text, replaced (runs on every span)."""
    exc = span.get("exception")
    if type(exc) is str:
        span["exception"] = keys.scrub_text(exc)
    info = span.get("exception_info")
    if type(info) is dict:
        info = redact_value(info, keys)
        if type(info.get("message")) is str:
            info["message"] = keys.scrub_text(info["message"])
        for frame in info.get("traceback") or ():
            if type(frame) is dict and type(frame.get("text")) is str:
                frame["text"] = keys.scrub_text(frame["text"])
        span["exception_info"] = info
