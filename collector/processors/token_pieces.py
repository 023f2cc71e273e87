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
"""

from __future__ import annotations

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


def token_pieces(tokenizer: Tokenizer, ids: list[int], text: str | None = None, *,
                 skip_special_tokens: bool = False, window: int = WINDOW) -> Pieces:
    """The pieces of ``ids`` in their full decode (``text`` when the caller already decoded it).

    Special tokens are kept by default, as the collector's ``token2text`` keeps them.
    """
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not ids:
        return Pieces(text, [], text == "")
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
