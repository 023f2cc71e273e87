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

Byte fallback (Llama 2 / Mistral style BPE or Unigram: a character missing from the vocabulary
is spelled as ``<0xF0>``-like tokens, which a ``ByteFallback`` decoder turns back into text only
a whole run at a time, every byte token of a run that is not valid UTF-8 becoming U+FFFD)
defeats windows and prefixes that end inside a run: the run's earlier, complete characters
decode as U+FFFD there too. So a run of byte tokens is one *unit* for the window method (a
unit never ends inside a character), and inside a run each token's text is the characters
its byte completes (fed to an incremental UTF-8 decoder): the bytes it contributes, a piece
that ends inside a character belonging to the token that completes it.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Tokenizer

from . import byte_level
from .byte_level import token_bytes

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


class ApproximateEnds(list):
    """Offsets that join to the text but are not each token's own (:func:`_approximate`): the
    token view says so (``exact: false``)."""

    __slots__ = ()


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


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _TokenizerFacts:
    """What the roads learn of one tokenizer, filled as ids are seen."""

    __slots__ = ("tokenizer", "bytes", "byte_fallback", "fallback_bytes")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bytes: dict[int, bytes] = {}  # ByteLevel: each token's bytes
        try:
            state = tokenizer.decoder.__getstate__() if tokenizer.decoder is not None else b""
        except Exception:  # noqa: BLE001 - a decoder that cannot say what it is: not byte fallback
            state = b""
        self.byte_fallback = b'"ByteFallback"' in state
        self.fallback_bytes: dict[int, int | None] = {}  # ByteFallback: the byte a <0xHH> token spells, else None


_FACTS: OrderedDict[int, _TokenizerFacts] = OrderedDict()  # id(tokenizer) -> its facts (the last 8 tokenizers)
_FACTS_LOCK = threading.Lock()


def _facts(tokenizer: Tokenizer) -> _TokenizerFacts:
    with _FACTS_LOCK:
        found = _FACTS.get(id(tokenizer))
        if found is not None and found.tokenizer is tokenizer:
            _FACTS.move_to_end(id(tokenizer))
            return found
        facts = _FACTS[id(tokenizer)] = _TokenizerFacts(tokenizer)
        while len(_FACTS) > 8:
            _FACTS.popitem(last=False)
        return facts


def _bytes_table(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Per tokenizer, each token's bytes as its ByteLevel decoder makes them, filled as ids are seen."""
    return _facts(tokenizer).bytes


def _byte_level_ends(tokenizer: Tokenizer, ids: list[int], text: str) -> list[int] | None:
    """The fast road for ByteLevel decoders (see the module); None when it does not rebuild ``text``."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    checked = byte_level.table_of(tokenizer)
    if checked is not None:  # valid UTF-8 (the usual case): prefix sums over the checked table
        found = checked.ends(ids, text)
        if found is not None:
            return found
    table = _bytes_table(tokenizer)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    ends, pieces, at = [], [], 0
    for token_id in ids:
        raw = table.get(token_id)
        if raw is None:
            piece = tokenizer.id_to_token(token_id)
            if piece is None:
                return None
            raw = table[token_id] = token_bytes(piece)
        piece = decoder.decode(raw)
        pieces.append(piece)
        at += len(piece)
        ends.append(at)
    tail = decoder.decode(b"", final=True)  # bytes of a character the sequence never completes
    pieces.append(tail)
    ends[-1] = at + len(tail)
    return ends if "".join(pieces) == text else None


def _fallback_bytes(facts: _TokenizerFacts, ids: list[int]) -> list[int | None]:
    """The byte each id spells when it is a byte-fallback token (``<0xF0>``), else None."""
    table, out = facts.fallback_bytes, []
    for token_id in ids:
        if token_id not in table:
            match = _BYTE_TOKEN.fullmatch(facts.tokenizer.id_to_token(token_id) or "")
            table[token_id] = int(match.group(1), 16) if match else None
        out.append(table[token_id])
    return out


def _unit_ends(before: list[str], after: list[str], text: str) -> list[int] | None:
    """Like :func:`_ends_from` for units that never end inside a character: each unit's decode
    must extend the one before it exactly (a U+FFFD there is the text's own)."""
    ends, at = [], 0
    for a, b in zip(before, after):
        if not b.startswith(a):
            return None
        piece = b[len(a):]
        if text[at:at + len(piece)] != piece:
            return None
        at += len(piece)
        ends.append(at)
    return ends if at == len(text) else None


def _run_ends(run: list[int], piece: str, start: int) -> list[int] | None:
    """Offsets of a run of byte tokens whose text is ``piece`` (at ``start``): each token gets the
    characters its byte completes; an invalid run is one U+FFFD per token, as ByteFallback makes it."""
    raw = bytes(run)
    try:
        whole = raw.decode("utf-8")
    except UnicodeDecodeError:
        if piece == REPLACEMENT * len(run):
            return [start + i + 1 for i in range(len(run))]
        return None
    if not whole.endswith(piece):
        return None
    skip = len(whole) - len(piece)  # characters the decoder dropped at the start of the text (Strip)
    decoder = codecs.getincrementaldecoder("utf-8")()
    ends, made = [], 0
    for byte in raw:
        made += len(decoder.decode(bytes((byte,))))
        ends.append(start + max(0, made - skip))
    return ends


def _byte_fallback_ends(tokenizer: Tokenizer, ids: list[int], text: str, window: int,
                        skip_special_tokens: bool) -> list[int] | None:
    """Exact offsets for a ByteFallback decoder (see the module); None when it is not one, no id
    is a byte token, or the units do not rebuild ``text``."""
    facts = _facts(tokenizer)
    if not facts.byte_fallback:
        return None
    spelled = _fallback_bytes(facts, ids)
    if all(b is None for b in spelled):
        return None
    units: list[tuple[int, int]] = []  # token index ranges: a run of byte tokens, or one other token
    for i, byte in enumerate(spelled):
        if byte is not None and units and i > 0 and spelled[i - 1] is not None:
            units[-1] = (units[-1][0], i + 1)
        else:
            units.append((i, i + 1))
    firsts = [units[max(0, k - window)][0] for k in range(len(units))]
    decoded = byte_level.decode_batch(tokenizer, [ids[w:s] for w, (s, _) in zip(firsts, units)]
                                     + [ids[w:e] for w, (_, e) in zip(firsts, units)], skip_special_tokens=skip_special_tokens)
    n = len(units)
    unit_ends = _unit_ends(decoded[:n], decoded[n:], text)
    if unit_ends is None and n <= MAX_PREFIX_TOKENS:
        prefixes = byte_level.decode_batch(tokenizer, [ids[:s] for s, _ in units] + [ids], skip_special_tokens=skip_special_tokens)
        unit_ends = _unit_ends(prefixes[:-1], prefixes[1:], text)
    if unit_ends is None:
        return None
    ends: list[int] = []
    at = 0
    for (s, e), end in zip(units, unit_ends):
        if spelled[s] is None:
            ends.append(end)
        else:
            run = _run_ends([b for b in spelled[s:e] if b is not None], text[at:end], at)
            if run is None:
                return None
            ends.extend(run)
        at = end
    return ends


def token_pieces(tokenizer: Tokenizer, ids: list[int], text: str | None = None, *,
                 skip_special_tokens: bool = False, window: int = WINDOW, byte_road: bool = True) -> Pieces:
    """The pieces of ``ids`` in their full decode (``text`` when the caller already decoded it).

    Special tokens are kept by default, as the collector's ``token2text`` keeps them.
    ``byte_road=False`` skips the ByteLevel fast road (the tests hold both roads to one answer).
    """
    if text is None:
        text = byte_level.decode(tokenizer, ids, skip_special_tokens)
    if not ids:
        return Pieces(text, [], text == "")
    if byte_road and not skip_special_tokens:
        fast = _byte_level_ends(tokenizer, ids, text)
        if fast is not None:
            return Pieces(text, fast, True)
    fallback = _byte_fallback_ends(tokenizer, ids, text, window, skip_special_tokens)
    if fallback is not None:
        return Pieces(text, fallback, True)
    windows = [(max(0, i - window), i) for i in range(len(ids))]
    decoded = byte_level.decode_batch(tokenizer, [ids[s:i] for s, i in windows] + [ids[s:i + 1] for s, i in windows],
                                     skip_special_tokens=skip_special_tokens)
    n = len(ids)
    ends = _ends_from(decoded[:n], decoded[n:], text)
    if ends is not None:
        return Pieces(text, ends, True)
    if n <= MAX_PREFIX_TOKENS:
        prefixes = byte_level.decode_batch(tokenizer, [ids[:i] for i in range(n + 1)], skip_special_tokens=skip_special_tokens)
        ends = _ends_from(prefixes[:-1], prefixes[1:], text)
        if ends is not None:
            return Pieces(text, ends, True)
    return _approximate(tokenizer, ids, text, skip_special_tokens)


def _approximate(tokenizer: Tokenizer, ids: list[int], text: str, skip_special_tokens: bool) -> Pieces:
    """Last resort (a long sequence with a decoder that is not local): one-token decodes, clipped to ``text``."""
    ends, at = [], 0
    for piece in byte_level.decode_batch(tokenizer, [[i] for i in ids], skip_special_tokens=skip_special_tokens):
        found = text.find(_complete(piece), at) if _complete(piece) else -1
        if found == at:
            at += len(_complete(piece))
        ends.append(at)
    ends[-1] = len(text)
    return Pieces(text, ends, False)
