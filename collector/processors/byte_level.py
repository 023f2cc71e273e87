"""Byte-level BPE decoding from a table: tokenizers' ``ByteLevel`` decoder, done once per id.

A ``ByteLevel`` decoder (Qwen, Llama 3, DeepSeek, GPT-2) turns each token back into bytes on its
own (its characters through GPT-2's byte alphabet; a token with any character outside it is its
own UTF-8) and decodes their concatenation as UTF-8, invalid bytes becoming U+FFFD. So a
sequence's text is one table look-up per id and one UTF-8 decode: several times less CPU than
``decode_batch``, whose per-token work (the token's string, its characters mapped one by one) is
the collector's largest cost with token2text on.

The table is made when the collector loads a tokenizer (:func:`prepare`, from the tokenizer
registry, with ``TRACECAR_DECODE_TABLE`` on), only when its decoder is exactly ``ByteLevel``, and
is **checked against** ``decode_batch`` then (every id in runs of 64, each id whose bytes begin or
end inside a character with byte tokens completing it, byte tokens side by side, every added token
between byte tokens, special tokens kept and skipped); a tokenizer it disagrees with on anything
decodes with tokenizers, as before. A loaded tokenizer is never changed afterwards (the table is
of that state). A call the table cannot answer exactly (an id past the vocabulary, a negative
one, a value that is not an int, a container or flag of another type) goes to tokenizers too, so
every text and every error is tokenizers' own.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from itertools import accumulate
from operator import itemgetter, sub
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger("tracecar.decode")


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


ALPHABET = _byte_alphabet()
# str.translate: the alphabet's characters to the bytes they spell (as latin-1 characters); every
# other character below 256 to one that latin-1 cannot encode, so such a token falls to its UTF-8
_TO_LATIN1 = {ord(c): b for c, b in ALPHABET.items()} | {c: 0x110000 - 1 for c in range(256) if chr(c) not in ALPHABET}


def token_bytes(token: str) -> bytes:
    """A vocabulary string's bytes as the ByteLevel decoder makes them."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


_CONTINUATION = bytes(range(0x80, 0xC0))
_CONTINUES = bytes(1 if 0x80 <= b < 0xC0 else 0 for b in range(256))  # bytes.translate: 1 for a continuation byte


class ByteTable:
    """Each id's bytes (``kept``), the same with special tokens as empty bytes (``skipped``), and
    per id its byte count and how many of its bytes start a character (for :meth:`ends`)."""

    __slots__ = ("kept", "skipped", "lengths", "starts")

    def __init__(self, kept: list[bytes], skipped: list[bytes]) -> None:
        self.kept, self.skipped = kept, skipped
        self.lengths = [len(raw) for raw in kept]
        self.starts = [len(raw.translate(None, _CONTINUATION)) for raw in kept]

    def ends(self, ids: list[int], text: str) -> list[int] | None:
        """Each token's end offset in ``text`` (special tokens kept), as the incremental UTF-8
        road of token_pieces makes them — a character belongs to the token that completes it —
        when the ids' bytes are valid UTF-8 and decode to ``text``; else None (that road decides).

        Valid UTF-8: the characters complete after a token are the character starts so far,
        less one when the next byte continues a character. Prefix sums, no decoder per token.
        """
        if len(ids) < 2 or min(ids) < 0:
            return None
        try:
            raw = b"".join(itemgetter(*ids)(self.kept))
            if raw.decode("utf-8") != text:
                return None
            ends_at = itemgetter(*accumulate(itemgetter(*ids)(self.lengths)))  # each token's end, in bytes
            starts = accumulate(itemgetter(*ids)(self.starts))
        except (IndexError, TypeError, UnicodeDecodeError):
            return None
        continues = raw.translate(_CONTINUES) + b"\x00"  # 1 where a byte continues a character (0 past the end)
        return list(map(sub, starts, ends_at(continues)))

    def decode(self, ids: Sequence[Any], skip_special_tokens: bool) -> str:
        """The text, or an error for what tokenizers must judge itself."""
        if type(ids) is not list and type(ids) is not tuple:
            raise TypeError("not a list of ids")
        if not ids:
            return ""
        if min(ids) < 0:  # a negative id would index from the table's end
            raise IndexError("negative token id")
        table = self.skipped if skip_special_tokens else self.kept
        if len(ids) == 1:
            return table[ids[0]].decode("utf-8", "replace")
        return b"".join(itemgetter(*ids)(table)).decode("utf-8", "replace")  # itemgetter: ~20 % under map(table.__getitem__)

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> ByteTable:
        added = tokenizer.get_added_tokens_decoder()
        size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        tokens = [tokenizer.id_to_token(i) for i in range(size)]  # the added vocabulary first, then the model's: decode's order
        kept = [b"" if token is None else token_bytes(token) for token in tokens]  # no token (a hole): nothing, as in tokenizers
        special = {t.content for t in added.values() if t.special}
        skipped = list(kept)
        for i, token in enumerate(tokens):
            if token in special:
                skipped[i] = b""
        return cls(kept, skipped)


def _tail_completion(raw: bytes) -> bytes | None:
    """Continuation bytes that complete the character ``raw`` ends inside, or None."""
    for back in range(1, min(4, len(raw)) + 1):
        lead = raw[-back]
        if 0x80 <= lead <= 0xBF:
            continue
        if not 0xC2 <= lead <= 0xF4:
            return None
        missing = (2 if lead < 0xE0 else 3 if lead < 0xF0 else 4) - back
        if missing <= 0:
            return None
        for fill in (b"\x80", b"\xa0", b"\x90", b"\xbf", b"\x8f"):
            try:
                (raw[-back:] + fill * missing).decode("utf-8")
            except UnicodeDecodeError:
                continue
            return fill * missing
        return None
    return None


_LEADS = {1: 0xC3, 2: 0xE1, 3: 0xF1}  # a lead byte that any 1, 2, 3 continuation bytes complete


def _check_sequences(tokenizer: Tokenizer, table: ByteTable) -> list[list[int]]:
    """What a table could get wrong, to hold against tokenizers' own decode: every id once (runs of
    64); every id whose bytes begin or end inside a character, with the byte tokens that complete it
    (a wrong byte there would otherwise hide in a U+FFFD); byte tokens side by side; every added
    token between byte tokens; random runs."""
    rng = random.Random(0)
    size = len(table.kept)
    sequences = [list(range(start, min(start + 64, size))) for start in range(0, size, 64)]
    byte_ids: dict[int, int] = {}
    for i, raw in enumerate(table.kept):
        if len(raw) == 1:
            byte_ids.setdefault(raw[0], i)
    for i, raw in enumerate(table.kept):
        if not raw or raw.isascii():
            continue
        head = len(raw) - len(raw.lstrip(bytes(range(0x80, 0xC0))))
        tail = _tail_completion(raw)
        if not head and tail is None:
            continue
        before = [byte_ids[_LEADS[head]]] if head in _LEADS and _LEADS[head] in byte_ids else []
        after = [byte_ids[b] for b in tail] if tail is not None and all(b in byte_ids for b in tail) else []
        sequences.append([*before, i, *after])
    singles = list(byte_ids.values())
    added = sorted(tokenizer.get_added_tokens_decoder())
    if singles:
        sequences += [[rng.choice(singles) for _ in range(rng.randint(1, 12))] for _ in range(512)]
        sequences += [[rng.choice(singles), a, rng.choice(singles), rng.randrange(size)] for a in added]
    sequences += [[rng.randrange(size) for _ in range(rng.randint(0, 40))] for _ in range(256)]
    return sequences


def checked_table(tokenizer: Tokenizer, name: str = "") -> ByteTable | None:
    """The tokenizer's table, or None when its decoder is not ByteLevel or the table disagrees."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    label = name or "a tokenizer"
    try:
        table = ByteTable.build(tokenizer)
        sequences = _check_sequences(tokenizer, table)
        for skip in (False, True):
            expected = tokenizer.decode_batch(sequences, skip_special_tokens=skip)
            wrong = sum(table.decode(ids, skip) != text for ids, text in zip(sequences, expected))
            if wrong:
                log.warning("%s: the byte-level decoding table disagrees with tokenizers on %d of %d check sequences "
                            "(skip_special_tokens=%s): decoded with tokenizers", label, wrong, len(sequences), skip)
                return None
    except Exception as exc:  # noqa: BLE001 - an odd tokenizer: decoded by tokenizers, as before
        log.warning("%s: byte-level decoding table not built (%s: %s): decoded with tokenizers", label, type(exc).__name__, exc)
        return None
    log.info("%s: byte-level decoding table of %d ids, checked on %d sequences", label, len(table.kept), len(sequences))
    return table


_LOCK = threading.Lock()  # writers only: readers take one dict look-up (atomic under the GIL)
#: id(tokenizer) -> (the tokenizer, kept so its id stays its; its table). Not a WeakKeyDictionary:
#: tokenizers before 0.23 (transformers' pins, VERL's images) cannot be weakly referenced. Bounded
#: above the registry's 8 loaded tokenizers; one pushed out decodes with tokenizers (same texts).
_TABLES: dict[int, tuple[Tokenizer, ByteTable]] = {}
MAX_TABLES = 16


def prepare(tokenizer: Tokenizer, name: str = "") -> ByteTable | None:
    """Makes and checks the tokenizer's table (a byte-level one's), so that its decodes use it.
    Never raises: a tokenizer without a table decodes with tokenizers."""
    table = checked_table(tokenizer, name)
    if table is not None:
        with _LOCK:
            _TABLES[id(tokenizer)] = (tokenizer, table)
            while len(_TABLES) > MAX_TABLES:
                del _TABLES[next(iter(_TABLES))]  # the oldest made
    return table


def table_of(tokenizer: Tokenizer) -> ByteTable | None:
    """The checked table :func:`prepare` made for this tokenizer, or None."""
    found = _TABLES.get(id(tokenizer))
    return found[1] if found is not None and found[0] is tokenizer else None


def decode_batch(tokenizer: Tokenizer, sequences: list[Any], skip_special_tokens: bool) -> list[str]:
    """``tokenizer.decode_batch``, from the table when there is one (same texts, same errors)."""
    table = table_of(tokenizer) if type(sequences) is list and type(skip_special_tokens) is bool else None
    if table is not None:
        try:
            return [table.decode(ids, skip_special_tokens) for ids in sequences]
        except Exception:  # noqa: BLE001 - what only tokenizers can judge: its answer (ids past the vocabulary skipped) or its error
            pass
    return tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)


def decode(tokenizer: Tokenizer, ids: Any, skip_special_tokens: bool) -> str:
    """``tokenizer.decode``, from the table when there is one (same text, same error)."""
    table = table_of(tokenizer) if type(skip_special_tokens) is bool else None
    if table is not None:
        try:
            return table.decode(ids, skip_special_tokens)
        except Exception:  # noqa: BLE001 - tokenizers' own answer or error
            pass
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
