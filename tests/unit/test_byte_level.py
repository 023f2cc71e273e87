"""The byte-level decoding table gives tokenizers' own texts and errors, or is not used.

Real tokenizers only: DeepSeek's (129k ids, shipped in a package) and small ones trained here.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tracecar.collector.processors import byte_level


def _tokenizer_answer(tok: Tokenizer, sequences: list[Any], skip: bool) -> Any:
    try:
        return tok.decode_batch(sequences, skip_special_tokens=skip)
    except Exception as exc:  # noqa: BLE001 - the error's type is the answer
        return type(exc)


def _table_answer(tok: Tokenizer, sequences: list[Any], skip: bool) -> Any:
    try:
        return byte_level.decode_batch(tok, sequences, skip)
    except Exception as exc:  # noqa: BLE001
        return type(exc)


def _random_sequences(tok: Tokenizer, count: int, seed: int) -> list[list[int]]:
    """Ids of every kind side by side: single bytes (split characters), added tokens, anything."""
    rng = random.Random(seed)
    size = tok.get_vocab_size(with_added_tokens=True)
    table = byte_level.table_of(tok)
    assert table is not None
    singles = [i for i, raw in enumerate(table.kept) if len(raw) == 1]
    added = list(tok.get_added_tokens_decoder())
    pick = [lambda: rng.choice(singles), lambda: rng.choice(added), lambda: rng.randrange(size)]
    return [[rng.choice(pick)() for _ in range(rng.randint(0, 60))] for _ in range(count)]


def _trained(small_bpe_path: str, extra_added: list[AddedToken]) -> Tokenizer:
    """conftest's byte-level BPE (trained here from generated text) with tokens added after training."""
    tok = Tokenizer.from_file(small_bpe_path)
    tok.add_tokens(extra_added)
    return tok


@pytest.fixture(scope="module")
def deepseek(deepseek_tokenizer_path: str) -> Tokenizer:
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    assert byte_level.prepare(tok, "deepseek") is not None
    return tok


def test_deepseek_texts_are_tokenizers_own(deepseek: Tokenizer) -> None:
    tok = deepseek
    sequences = _random_sequences(tok, 3000, seed=11)
    real = tok.encode("def f(x):\n    return x + 1  # naïve 数字 🙂\n" * 40).ids
    sequences += [real, real[:-1], real[1:7]]
    for skip in (False, True):
        assert byte_level.decode_batch(tok, sequences, skip) == tok.decode_batch(sequences, skip_special_tokens=skip)
    assert byte_level.decode(tok, real, False) == tok.decode(real, skip_special_tokens=False)


def test_added_tokens_of_every_kind(tmp_path: Any, small_bpe_path: str) -> None:
    """Added after training: a special one, a plain one with a space (its own UTF-8, not the byte
    alphabet's), one repeating a vocabulary string; saved and loaded as the collector loads it."""
    tok = _trained(small_bpe_path, [AddedToken("<tool_call>", special=True), AddedToken("hello world", special=False),
                    AddedToken("tool", special=False), AddedToken("</tool_call>", special=True)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = Tokenizer.from_file(str(path))
    assert byte_level.prepare(loaded) is not None
    sequences = _random_sequences(loaded, 2000, seed=5)
    for skip in (False, True):
        assert byte_level.decode_batch(loaded, sequences, skip) == loaded.decode_batch(sequences, skip_special_tokens=skip)


@pytest.mark.parametrize("ids", [
    [], [0], [5, -1], [-3], [5, 10**9], [10**30], [1.0, 2], [True, 5], ["7"], [None], [[1, 2]], [5, 6.5],
    (5, 6), "", "57", {100, 200}, {0: 1, 1: 2}, {5: 1}, b"\x05",
])
def test_what_the_table_cannot_answer_is_tokenizers_answer(deepseek: Tokenizer, ids: Any) -> None:
    """Out of the vocabulary, negative, not an int, not a list: the same text, or the same error, as tokenizers."""
    tok = deepseek
    sequences = [ids, [100, 200]]
    for skip in (False, True, None, 1):
        assert _table_answer(tok, sequences, skip) == _tokenizer_answer(tok, sequences, skip)  # type: ignore[arg-type]
        try:
            expected: Any = tok.decode(ids, skip_special_tokens=skip)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            expected = type(exc)
        try:
            got: Any = byte_level.decode(tok, ids, skip)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            got = type(exc)
        assert got == expected


def test_a_wrong_byte_inside_a_split_character_is_caught(deepseek: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token that ends inside a character (' \xe2'): its wrong byte would hide in a U+FFFD in
    runs of ids; the check completes it with byte tokens, so the table is refused."""
    right = byte_level.token_bytes

    def bumped(token: str) -> bytes:
        raw = right(token)
        return raw[:-1] + bytes([raw[-1] + 1]) if raw and 0xE1 <= raw[-1] <= 0xEB else raw

    monkeypatch.setattr(byte_level, "token_bytes", bumped)
    assert byte_level.checked_table(deepseek) is None


def test_the_registry_makes_the_table_when_allowed(deepseek_tokenizer_path: str) -> None:
    """TRACECAR_DECODE_TABLE: on, a loaded tokenizer has its table; off, none; the texts
    decode_spans stores are the same either way (VERL-shaped outputs, byte-split characters)."""
    import copy

    from tracecar.collector.processors.decoding import TokenizerPolicy, TokenizerRegistry, decode_spans

    on = TokenizerRegistry(TokenizerPolicy(default=deepseek_tokenizer_path)).get(deepseek_tokenizer_path)
    off = TokenizerRegistry(TokenizerPolicy(default=deepseek_tokenizer_path, decode_table=False)).get(deepseek_tokenizer_path)
    assert on is not off and byte_level.table_of(on) is not None and byte_level.table_of(off) is None
    prompt = on.encode("<｜User｜>Compute 数字 + 🙂, naïvely.\n").ids
    sequences = _random_sequences(on, 40, seed=3)
    spans = [{"span_id": f"s{i}", "trace_id": "t", "name": "generate", "inputs": {"prompt_ids": prompt + ids},
              "output": {"prompt_ids": prompt + ids, "response_ids": ids[::-1], "num_turns": 2}}
             for i, ids in enumerate(sequences)]
    by_table, by_tokenizers = copy.deepcopy(spans), copy.deepcopy(spans)
    warnings_on: dict[str, list[str]] = {}
    warnings_off: dict[str, list[str]] = {}
    assert decode_spans(by_table, on, warnings_on) == decode_spans(by_tokenizers, off, warnings_off) > 0
    assert by_table == by_tokenizers and warnings_on == warnings_off
    assert all("prompt_text" in s["output"] and "response_text" in s["output"] for s in by_table)


def test_other_decoders_keep_tokenizers(small_bpe_path: str) -> None:
    """Metaspace (SentencePiece style) and a Sequence are not a plain ByteLevel: no table."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["a b c", "hello world"] * 50, trainers.BpeTrainer(vocab_size=60))
    assert byte_level.prepare(tok) is None and byte_level.table_of(tok) is None
    assert byte_level.decode_batch(tok, [[1, 2, 3]], False) == tok.decode_batch([[1, 2, 3]], skip_special_tokens=False)
    mixed = _trained(small_bpe_path, [])
    mixed.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert byte_level.prepare(mixed) is None


def test_a_table_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                            small_bpe_path: str) -> None:
    """The check at build is real: a wrong byte mapping is caught and tokenizers decodes."""
    tok = _trained(small_bpe_path, [])
    right = byte_level.token_bytes
    monkeypatch.setattr(byte_level, "token_bytes", lambda token: right(token).replace(b"7", b"8"))
    with caplog.at_level(logging.WARNING, logger="tracecar.decode"):
        assert byte_level.checked_table(tok) is None
    assert "disagrees with tokenizers" in caplog.text


def test_token_ends_from_the_table_are_the_incremental_roads(deepseek: Tokenizer, deepseek_tokenizer_path: str) -> None:
    """Each token's offsets (the token view, packed token arrays) from the table's prefix sums equal
    the incremental UTF-8 decoder's, token by token, on real text and on ids split inside characters."""
    from tracecar.collector.processors.token_pieces import token_pieces

    plain = Tokenizer.from_file(deepseek_tokenizer_path)  # no table: the incremental road
    assert byte_level.table_of(plain) is None
    text = "def f(x):\n    return x + 1  # naïve 数字 🙂 — “quoted” ✓\n" * 30
    whole = deepseek.encode(text).ids
    rng = random.Random(4)
    cuts = [sorted(rng.sample(range(len(whole)), 2)) for _ in range(100)]  # some cut inside a character
    sequences = [whole, *(whole[a:b] for a, b in cuts), *_random_sequences(deepseek, 300, seed=21)]
    answered = 0
    for ids in sequences:
        decoded = byte_level.decode(deepseek, ids, False)
        fast = token_pieces(deepseek, ids, decoded)
        slow = token_pieces(plain, ids, decoded)
        assert (fast.text, fast.ends, fast.exact) == (slow.text, slow.ends, slow.exact)
        table = byte_level.table_of(deepseek)
        assert table is not None
        found = table.ends(ids, decoded)
        if found is not None:
            answered += 1
            assert found == slow.ends
    assert answered >= 50  # the prefix sums answered the valid-UTF-8 sequences, not only the fallback
