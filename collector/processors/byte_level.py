"""Byte-level BPE decoding from a table: tokenizers' ``ByteLevel`` decoder, done once per id.

A ``ByteLevel`` decoder (Qwen, Llama 3, DeepSeek, GPT-2) turns each token back into bytes on its
own (its characters through GPT-2's byte alphabet; a token with any character outside it is its
own UTF-8) and decodes their concatenation as UTF-8, invalid bytes becoming U+FFFD. So a
sequence's text is one table look-up per id and one UTF-8 decode: several times less CPU than
``decode_batch``, whose per-token work (the token's string, its characters mapped one by one) is
the collector's largest cost with token2text on.

The table is built the first time a tokenizer decodes, only when its decoder is exactly
``ByteLevel``, and is **checked against** ``decode_batch`` then (every id, byte tokens next to
each other and to added tokens, special tokens kept and skipped); a tokenizer it disagrees with on
anything decodes with tokenizers, as before. A sequence the table cannot answer exactly (an id
past the vocabulary, a negative one, a value that is not an int) goes to tokenizers too, so every
text and every error is tokenizers' own.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Sequence
from operator import itemgetter
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


class ByteTable:
    """Each id's bytes (``kept``), and the same with special tokens as empty bytes (``skipped``)."""

    __slots__ = ("kept", "skipped")

    def __init__(self, kept: list[bytes], skipped: list[bytes]) -> None:
        self.kept, self.skipped = kept, skipped

    def decode(self, ids: Sequence[Any], skip_special_tokens: bool) -> str:
        """The text, or IndexError / TypeError for what tokenizers must judge itself."""
        if not len(ids):
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


def _check_sequences(tokenizer: Tokenizer, table: ByteTable) -> list[list[int]]:
    """Every id once (runs of 64), byte tokens side by side (split characters), and every added
    token between byte tokens: what a table could get wrong, against tokenizers' own decode."""
    rng = random.Random(0)
    size = len(table.kept)
    sequences = [list(range(start, min(start + 64, size))) for start in range(0, size, 64)]
    byte_ids = [i for i, raw in enumerate(table.kept) if len(raw) == 1]
    added = sorted(tokenizer.get_added_tokens_decoder())
    if byte_ids:
        sequences += [[rng.choice(byte_ids) for _ in range(rng.randint(1, 12))] for _ in range(512)]
        sequences += [[rng.choice(byte_ids), a, rng.choice(byte_ids), rng.randrange(size)] for a in added]
    sequences += [[rng.randrange(size) for _ in range(rng.randint(0, 40))] for _ in range(256)]
    return sequences


def checked_table(tokenizer: Tokenizer) -> ByteTable | None:
    """The tokenizer's table, or None when its decoder is not ByteLevel or the table disagrees."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    try:
        table = ByteTable.build(tokenizer)
        sequences = _check_sequences(tokenizer, table)
        for skip in (False, True):
            expected = tokenizer.decode_batch(sequences, skip_special_tokens=skip)
            wrong = sum(table.decode(ids, skip) != text for ids, text in zip(sequences, expected))
            if wrong:
                log.warning("byte-level decoding table disagrees with tokenizers on %d of %d check sequences "
                            "(skip_special_tokens=%s): this tokenizer decodes with tokenizers", wrong, len(sequences), skip)
                return None
    except Exception as exc:  # noqa: BLE001 - an odd tokenizer: decoded by tokenizers, as before
        log.warning("byte-level decoding table not built (%s: %s): this tokenizer decodes with tokenizers", type(exc).__name__, exc)
        return None
    return table


_TABLES: OrderedDict[int, tuple[Tokenizer, ByteTable | None]] = OrderedDict()  # id(tokenizer) -> (it, its table); the last 8
_LOCK = threading.Lock()


def table_of(tokenizer: Tokenizer) -> ByteTable | None:
    """The checked table of a tokenizer (built on first use, under a lock), or None."""
    with _LOCK:
        found = _TABLES.get(id(tokenizer))
        if found is not None and found[0] is tokenizer:
            _TABLES.move_to_end(id(tokenizer))
            return found[1]
        table = checked_table(tokenizer)
        _TABLES[id(tokenizer)] = (tokenizer, table)
        while len(_TABLES) > 8:
            _TABLES.popitem(last=False)
        return table


def decode_batch(tokenizer: Tokenizer, sequences: Sequence[Sequence[Any]], skip_special_tokens: bool) -> list[str]:
    """``tokenizer.decode_batch``, from the table when there is one (same texts, same errors)."""
    table = table_of(tokenizer)
    if table is not None:
        try:
            return [table.decode(ids, skip_special_tokens) for ids in sequences]
        except (IndexError, TypeError):
            pass  # ids only tokenizers can judge: its answer (ids past the vocabulary skipped) or its error
    return tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)


def decode(tokenizer: Tokenizer, ids: Sequence[Any], skip_special_tokens: bool) -> str:
    """``tokenizer.decode``, from the table when there is one."""
    return decode_batch(tokenizer, [ids], skip_special_tokens)[0]
