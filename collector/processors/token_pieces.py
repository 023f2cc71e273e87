"""Token pieces: where each token of a decoded response sits in its text.

The token view shades a response token by token, so each token needs its span of characters in
``response_text``. Decoding tokens one at a time does not give it: a byte-level BPE token can
hold half of a multi-byte character (an emoji, a CJK character), which alone decodes to U+FFFD,
and Metaspace decoders change a token's text by its position. So each token's piece is the
difference between decoding a short window of ids ending before it and the same window ending
with it; bytes of a character that is not complete yet give an empty piece, and the token that
completes it gets the whole character. The pieces are then checked to join to the full decode;
if a decoder is not local enough for the window, exact growing prefixes are used instead.
Every result reproduces ``tokenizer.decode(ids)`` exactly, or says it could not (``exact``).

Byte-level BPE (GPT-2 style ``ByteLevel`` decoders: Llama 3, Qwen, DeepSeek) takes a faster road
first, ten times cheaper than the windows: each token's bytes (its vocabulary string mapped back
through the byte alphabet, as the decoder does) are fed to an incremental UTF-8 decoder, which
holds a split character until the token that completes it. Its pieces too must join to the
full decode, else the window method decides.
"""

from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
WINDOW = 8  # ids of context before each token: enough for any UTF-8 character (4 bytes) and leading-space rules
MAX_PREFIX_TOKENS = 4096  # the exact fallback decodes n prefixes (quadratic): only up to this many tokens


@dataclass
class Pieces:
    """Character offsets of each token in ``text``: token i is ``text[ends[i-1]:ends[i]]`` (0 before the first)."""

    text: str
    ends: list[int]
    exact: bool  # the pieces join to exactly ``text`` (False only past MAX_PREFIX_TOKENS with an odd decoder)

    def starts(self) -> list[int]:
        return [0, *self.ends[:-1]]

    def piece(self, i: int) -> str:
        start = self.ends[i - 1] if i else 0
        return self.text[start:self.ends[i]]


def _complete(text: str) -> str:
    """The text without a trailing incomplete character (decoded as U+FFFD)."""
    return text.rstrip(REPLACEMENT)


def _ends_from(before: list[str], after: list[str], text: str) -> list[int] | None:
    """Offsets from (decode without token i, decode with it) pairs; None if they do not rebuild ``text``."""
    ends: list[int] = []
    at = 0
    for i, (a, b) in enumerate(zip(before, after)):
        last = i == len(after) - 1
        head = _complete(a)
        tail = b if last else _complete(b)  # the last token keeps whatever the full decode ends with
        if not tail.startswith(head):
            if len(tail) < len(head) and head.startswith(tail):
                ends.append(at)  # a piece that (with its context) decodes shorter: nothing new
                continue
            return None
        piece = tail[len(head):]
        if text[at:at + len(piece)] != piece:
            return None
        at += len(piece)
        ends.append(at)
    if at != len(text):
        return None
    return ends


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed: the character a ByteLevel vocabulary uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_ALPHABET = _byte_alphabet()
_TOKEN_BYTES: OrderedDict[int, tuple[Tokenizer, dict[int, bytes]]] = OrderedDict()  # id(tokenizer) -> its tokens' bytes
_TOKEN_BYTES_LOCK = threading.Lock()


def _bytes_table(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Per tokenizer (the last 8), each token's bytes as its ByteLevel decoder makes them, filled as ids are seen."""
    with _TOKEN_BYTES_LOCK:
        found = _TOKEN_BYTES.get(id(tokenizer))
        if found is not None and found[0] is tokenizer:
            _TOKEN_BYTES.move_to_end(id(tokenizer))
            return found[1]
        table: dict[int, bytes] = {}
        _TOKEN_BYTES[id(tokenizer)] = (tokenizer, table)
        while len(_TOKEN_BYTES) > 8:
            _TOKEN_BYTES.popitem(last=False)
        return table


def _byte_level_ends(tokenizer: Tokenizer, ids: list[int], text: str) -> list[int] | None:
    """The fast road for ByteLevel decoders (see the module); None when it does not rebuild ``text``."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    table = _bytes_table(tokenizer)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    ends, pieces, at = [], [], 0
    for token_id in ids:
        raw = table.get(token_id)
        if raw is None:
            piece = tokenizer.id_to_token(token_id)
            if piece is None:
                return None
            try:  # a token whose every character is in the byte alphabet is those bytes; any other is its UTF-8
                raw = bytes(_ALPHABET[c] for c in piece)
            except KeyError:
                raw = piece.encode()
            table[token_id] = raw
        piece = decoder.decode(raw)
        pieces.append(piece)
        at += len(piece)
        ends.append(at)
    tail = decoder.decode(b"", final=True)  # bytes of a character the sequence never completes
    pieces.append(tail)
    ends[-1] = at + len(tail)
    return ends if "".join(pieces) == text else None


def token_pieces(tokenizer: Tokenizer, ids: list[int], text: str | None = None, *,
                 skip_special_tokens: bool = False, window: int = WINDOW, byte_road: bool = True) -> Pieces:
    """The pieces of ``ids`` in their full decode (``text`` when the caller already decoded it).

    Special tokens are kept by default, as the collector's ``token2text`` keeps them.
    ``byte_road=False`` skips the ByteLevel fast road (the tests hold both roads to one answer).
    """
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not ids:
        return Pieces(text, [], text == "")
    if byte_road and not skip_special_tokens:
        fast = _byte_level_ends(tokenizer, ids, text)
        if fast is not None:
            return Pieces(text, fast, True)
    windows = [(max(0, i - window), i) for i in range(len(ids))]
    decoded = tokenizer.decode_batch([ids[s:i] for s, i in windows] + [ids[s:i + 1] for s, i in windows],
                                     skip_special_tokens=skip_special_tokens)
    n = len(ids)
    ends = _ends_from(decoded[:n], decoded[n:], text)
    if ends is not None:
        return Pieces(text, ends, True)
    if n <= MAX_PREFIX_TOKENS:
        prefixes = tokenizer.decode_batch([ids[:i] for i in range(n + 1)], skip_special_tokens=skip_special_tokens)
        ends = _ends_from(prefixes[:-1], prefixes[1:], text)
        if ends is not None:
            return Pieces(text, ends, True)
    return _approximate(tokenizer, ids, text, skip_special_tokens)


def _approximate(tokenizer: Tokenizer, ids: list[int], text: str, skip_special_tokens: bool) -> Pieces:
    """Last resort (a long sequence with a decoder that is not local): one-token decodes, clipped to ``text``."""
    ends, at = [], 0
    for piece in tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens):
        found = text.find(_complete(piece), at) if _complete(piece) else -1
        if found == at:
            at += len(_complete(piece))
        ends.append(at)
    ends[-1] = len(text)
    return Pieces(text, ends, False)
