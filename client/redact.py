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

    __slots__ = ("keys", "_needles", "_needle_set", "_lengths", "_always_walk", "_text_re", "spliceable", "_quoted",
                 "_quoted_re", "_needle_re", "_anchors")

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
        # one case-insensitive scan for all of them: a bytes pattern folds ASCII case only, as
        # bytes.lower() does, so it finds exactly what a search of the lower-cased body would,
        # without the copy (4x faster on a collector's 1 MiB body)
        self._quoted_re = re.compile(b"|".join(re.escape(q) for q in self._quoted), re.IGNORECASE)
        self._needle_re = re.compile(b"|".join(re.escape(n) for n in self._needles), re.IGNORECASE)
        # per quoted key: its rarest letter in both cases, and the offsets it takes in the key
        self._anchors = tuple((q, _anchor_of(q)) for q in self._quoted)
        alternatives = "|".join(re.escape(k) for k in sorted(self.keys, key=len, reverse=True))
        # a key (not inside a longer name), its closing quote if any (JSON inside a string escapes
        # it: \"), then = or :; the value after it is measured by value_end
        self._text_re = re.compile(rf"""(?i)(?<![\w-])(?:{alternatives})(?:\\?['"])?\s*[:=]\s*""")

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
            # key with its quotes around it, so a search for the quoted keys (any ASCII case) finds
            # exactly the pieces a split at quotes would
            return self._holds_quoted(body)
        return self._needle_re.search(packed) is not None

    def _holds_quoted(self, body: bytes | bytearray) -> bool:
        """Whether a quoted key (any ASCII case) is in ``body``: exactly what ``_quoted_re.search`` says.

        The regex steps through every byte in Python's regex engine (~5 instructions a byte, a
        quarter of the collector's cost over 26c393c on a 2,000-id span, issue 32). Instead, per
        key, the places of its rarest letter (in English text, the hex digits a-f last: span ids
        are full of them) are found with ``bytes.find`` (memchr), in both cases, and each is
        compared with the quoted key, lower-cased (the regex folds ASCII case only): a letter
        absent rules the key out after two memchr passes. Bounded: past ``len(body) / 4096``
        places in all (a body full of that letter), the regex decides instead.

        A body under :data:`REGEX_BELOW` bytes goes to the regex at once: the sender's span without
        its id lists is a few hundred bytes of names and text, where each key's letters are
        common and every place costs a Python iteration (``bench/redact_search.py``: 3–11× the
        regex's time on a few hundred bytes; the memchr passes win only on long, digit-heavy bodies)."""
        if len(body) < REGEX_BELOW:
            return self._quoted_re.search(body) is not None
        find = body.find
        budget = max(_MIN_PLACES, len(body) >> 12)
        for quoted, (forms, offsets) in self._anchors:
            size = len(quoted)
            for form in forms:
                at = find(form)
                while at >= 0:
                    budget -= 1
                    if budget < 0:
                        return self._quoted_re.search(body) is not None
                    for i in offsets:
                        if at >= i and body[at - i:at - i + size].lower() == quoted:
                            return True
                    at = find(form, at + 1)
        return False

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
        """``api_key='sk-…'``, ``"Authorization": "Bearer …"``, ``Authorization: Bearer …``,
        ``api_key=['a', 'b']`` inside free text (an exception message, a repr), value replaced.

        The value is a quoted string (escaped quotes too, as in JSON held in a string), a bracketed
        value up to its matching bracket (a list, tuple or dict in a repr), an authorization
        scheme with its credential, or else a bare token.
        """
        low = text.lower()
        if "bearer" in low:  # a bearer credential is one whatever precedes it ("authorization -> Bearer …")
            text = _BEARER_CREDENTIAL.sub(_redact_credential, text)
        if not any(k in low for k in self.keys):
            return text
        out: list[str] = []
        done = 0
        for match in self._text_re.finditer(text):
            start = match.end()
            if match.start() < done or start >= len(text):
                continue  # inside a value replaced already, or nothing after the separator
            end = value_end(text, start)
            if end > start:
                out += (text[done:start], REDACTED)
                done = end
        return "".join(out) + text[done:] if out else text


#: places compared one by one in any body before the regex decides instead (see _holds_quoted):
#: each costs ~0.3–0.8 µs of Python, the regex ~1–1.5 ns a byte of text
_MIN_PLACES = 16
#: below this many bytes the regex searches at once (see _holds_quoted)
REGEX_BELOW = 4096
#: ASCII letters, rarest first: English text's order, with the hex digits a-f (every span id) last
_RARE_FIRST = "zqjxwvykghmpulonrsitfedcba"


def _anchor_of(quoted: bytes) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    """(the key's rarest letter in lower and upper case, the offsets it takes in ``quoted``).

    A key without letters (``TRACECAR_REDACT_KEYS`` may name one) is anchored at its quote, which
    every place of it holds."""
    letters = sorted({chr(c).lower() for c in quoted if chr(c).isascii() and chr(c).isalpha()}, key=_RARE_FIRST.find)
    letter = letters[0] if letters else '"'
    offsets = tuple(i for i, c in enumerate(quoted) if chr(c).lower() == letter)
    return (letter.encode(), letter.upper().encode()) if letters else (b'"',), offsets


# RFC 6750's token68 after "Bearer" on the same line: at least 16 characters, a letter and a digit
# among them (API keys, JWTs, opaque tokens), so "the ring bearer walked-through-the-door" or
# "bearer 2024-01-01T00:00:00" is left alone
_BEARER_CREDENTIAL = re.compile(
    r"(?i)(\bbearer[ \t]+)(?=[A-Za-z0-9\-._~+/]*[0-9])(?=[A-Za-z0-9\-._~+/]*[A-Za-z])[A-Za-z0-9\-._~+/]{16,}=*")


def _redact_credential(match: re.Match[str]) -> str:
    return match.group(1) + REDACTED


_SCHEME = re.compile(r"(?i)(?:bearer|basic|token|digest|negotiate|bot|apikey|api-key|aws4-hmac-sha256)\s+(?=\S)")
_BARE = re.compile(r"[^\s,;)}\]]+")
_CLOSE = {"[": "]", "(": ")", "{": "}"}
# a quoted value up to its closing quote (backslash escapes skipped), within its line
_QUOTED = {q: re.compile(rf"{q}(?:[^{q}\\\n]|\\.)*{q}") for q in ("'", '"')}


def value_end(text: str, start: int) -> int:
    """Where the value that begins at ``start`` ends (see :meth:`RedactKeys.scrub_text`). A value
    cut short (an unclosed quote or bracket, as in a truncated repr) runs to the end of its line:
    a repr or a message holds no raw newline, so the lines after it (a traceback) stay readable."""
    first = text[start]
    if first in _QUOTED:
        closed = _QUOTED[first].match(text, start)
        return closed.end() if closed else _line_end(text, start)
    if first == "\\" and text[start + 1:start + 2] in ("'", '"'):  # \"sk-…\" inside JSON held in a string
        return _escaped_quoted_end(text, start + 2, text[start + 1])
    if first in _CLOSE:
        return _bracketed_end(text, start)
    scheme = _SCHEME.match(text, start)
    bare = _BARE.match(text, scheme.end() if scheme else start)
    return bare.end() if bare else start


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _escaped_quoted_end(text: str, i: int, quote: str) -> int:
    """The end of a string written inside another string: read through the outer escapes
    (``\\\\`` is a backslash, ``\\"`` a quote of the inner text) and stop at the inner string's
    own closing quote, one not escaped in the inner text."""
    n, line_end = len(text), _line_end(text, i)
    inner_escape = False
    while i < line_end:
        c = text[i]
        if c == "\\" and i + 1 < n:  # an outer escape: the character it stands for
            c = text[i + 1]
            i += 2
        else:
            i += 1
        if inner_escape:
            inner_escape = False
        elif c == "\\":
            inner_escape = True
        elif c == quote:
            return i
    return line_end


def _bracketed_end(text: str, i: int) -> int:
    stack: list[str] = []
    line_end = _line_end(text, i)
    while i < line_end:
        c = text[i]
        if c in _QUOTED:
            closed = _QUOTED[c].match(text, i)
            if closed is None:
                return line_end
            i = closed.end()
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return line_end


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
        for field in ("message", "type"):  # a type name is text a hostile client may fill too
            if type(info.get(field)) is str:
                info[field] = keys.scrub_text(info[field])
        for frame in info.get("traceback") or ():
            if type(frame) is dict:
                scrub_frame(frame, keys)
        span["exception_info"] = info


#: a traceback frame's free-text fields (a source line, and names a secret may be formatted into)
FRAME_TEXT_FIELDS = ("text", "filename", "function_name")


def scrub_frame(frame: dict[str, Any], keys: RedactKeys = DEFAULT) -> None:
    """``key=value`` secrets in a traceback frame's line, file name and function name, replaced."""
    for name in FRAME_TEXT_FIELDS:
        value = frame.get(name)
        if type(value) is str:
            frame[name] = keys.scrub_text(value)
