"""Token offsets on byte-fallback tokenizers (issue 27 §6): Llama 2 / Mistral style BPE and Unigram,
where a character missing from the vocabulary is spelled as ``<0xF0>``-like tokens and a
``ByteFallback`` decoder makes text of a whole run at a time. Both tokenizers are trained here from
generated text (nothing is downloaded), with Llama 2's normalizer and decoder. Offsets must be
exact (each token's text is the bytes it contributes, a piece that ends inside a character going
to the token that completes it), and every tokens answer says whether they are (``exact``).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tracecar.client.tracing import rollout_trace_attr, rollout_trace_op
from tracecar.collector.processors import token_pieces as pieces_module
from tracecar.collector.processors.token_pieces import REPLACEMENT, token_pieces

pytestmark = pytest.mark.timeout(240)

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
WORDS = ["the", "tool", "call", "returned", "a", "reward", "answer", "is", "prompt", "step", "42", "ok", "é", "日本"]
# what byte fallback is for: characters a small vocabulary lacks, in runs
EMOJI = ["🙂", "🎉", "🍣", "👍🏽", "👋🏿"]
ZWJ = ["👨\u200d👩\u200d👧", "🏳️\u200d🌈", "👩🏽\u200d💻"]
FLAGS = ["🇯🇵", "🇫🇷", "🇺🇦", "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f"]
RARE_CJK = ["𠀀", "𠀁", "𪜀", "𫠝", "鿰", "龘"]
COMBINING = ["e\u0301", "a\u0308\u0304", "n\u0303", "\u0915\u094d\u0937", "Z\u0335\u0321"]


def corpus() -> list[str]:
    rng = random.Random(27)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) for _ in range(400)]


def _plain_byte_tokens(tok: Tokenizer) -> Tokenizer:
    """The byte tokens as ordinary vocabulary (as in Llama 2's tokenizer.json), not special added tokens."""
    state = json.loads(tok.to_str())
    state["added_tokens"] = [t for t in state["added_tokens"] if not t["content"].startswith("<0x")]
    return Tokenizer.from_str(json.dumps(state))


def _llama2_style(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def byte_fallback_bpe() -> Tokenizer:
    tok = _llama2_style(Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True)))
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>", *BYTE_TOKENS]))
    return _plain_byte_tokens(tok)


def byte_fallback_unigram() -> Tokenizer:
    tok = _llama2_style(Tokenizer(models.Unigram()))
    tok.train_from_iterator(corpus(), trainers.UnigramTrainer(vocab_size=340, special_tokens=["<unk>", *BYTE_TOKENS],
                                                               unk_token="<unk>"))
    state = json.loads(tok.to_str())
    state["model"]["byte_fallback"] = True
    return _plain_byte_tokens(Tokenizer.from_str(json.dumps(state)))


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def fallback(request: pytest.FixtureRequest) -> Tokenizer:
    return byte_fallback_bpe() if request.param == "bpe" else byte_fallback_unigram()


def byte_of(tok: Tokenizer, token_id: int) -> int | None:
    token = tok.id_to_token(token_id) or ""
    return int(token[3:5], 16) if len(token) == 6 and token.startswith("<0x") and token.endswith(">") else None


def check_exact(tok: Tokenizer, ids: list[int]) -> list[str]:
    """The pieces are exact, join to the decode, and each byte token holds what its byte completes."""
    full = tok.decode(ids, skip_special_tokens=False)
    found = token_pieces(tok, ids)
    assert found.exact
    pieces = [found.piece(i) for i in range(len(ids))]
    assert "".join(pieces) == full and found.ends == sorted(found.ends)
    run: list[int] = []
    for i, token_id in enumerate([*ids, -1]):
        byte = byte_of(tok, token_id) if token_id >= 0 else None
        if byte is not None:
            run.append(i)
            continue
        if run:  # a run of byte tokens: its pieces are its bytes, each character on the token that completes it
            raw = bytes(byte_of(tok, ids[j]) for j in run)  # type: ignore[misc]
            text = "".join(pieces[j] for j in run)
            try:
                whole = raw.decode("utf-8")
            except UnicodeDecodeError:
                assert text == REPLACEMENT * len(run)  # ByteFallback: one U+FFFD per byte of an invalid run
            else:
                assert whole.endswith(text) and len(whole) - len(text) <= 1  # (the decoder may strip a leading space)
                made = 0
                for j in run:
                    before = made
                    made = len(raw[: j - run[0] + 1].decode("utf-8", errors="ignore"))
                    assert len(pieces[j]) == made - before or (before == 0 and len(whole) != len(text))
            run = []
    if REPLACEMENT not in full:
        assert all(REPLACEMENT not in p for p in pieces)
    return pieces


def test_a_run_of_byte_spelled_characters_is_exact(fallback: Tokenizer) -> None:
    text = "the tool 🙂🙂 returned 👨\u200d👩\u200d👧 🇯🇵 𠀀𠀁 e\u0301 ok"
    ids = fallback.encode(text).ids
    assert sum(byte_of(fallback, i) is not None for i in ids) >= 30  # spelled as bytes, in runs
    assert fallback.decode(ids) == text
    pieces = check_exact(fallback, ids)
    assert pieces.count("🙂") == 2 and "🇯" in pieces and "🇵" in pieces and "\u200d" in pieces and "𠀁" in pieces
    assert pieces[-1].strip() in ("ok", "k")  # the last token is its own text, not "the rest"


def _texts() -> st.SearchStrategy[str]:
    atoms = st.sampled_from([*WORDS, *EMOJI, *ZWJ, *FLAGS, *RARE_CJK, *COMBINING, " ", "  ", "\n", ".", "!", "數"])
    return st.lists(atoms, min_size=1, max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts())
def test_property_random_texts_have_exact_pieces_on_byte_fallback_bpe_and_unigram(fallback: Tokenizer, text: str) -> None:
    ids = fallback.encode(text).ids
    check_exact(fallback, ids)
    check_exact(fallback, [fallback.token_to_id("<s>") or 1, *ids])  # after a special token, as a chat response starts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_invalid_and_cut_byte_runs_are_exact_too(fallback: Tokenizer, data: st.DataObject) -> None:
    """A model samples byte tokens freely: runs that are not UTF-8 (one U+FFFD per byte), a character cut at the end."""
    ids = fallback.encode(data.draw(_texts())).ids
    byte_ids = [fallback.token_to_id(t) for t in BYTE_TOKENS]
    noise = data.draw(st.lists(st.sampled_from(byte_ids), min_size=1, max_size=6))
    at = data.draw(st.integers(0, len(ids)))
    check_exact(fallback, ids[:at] + noise + ids[at:])
    check_exact(fallback, ids[:-1] if len(ids) > 1 else ids)


def test_long_sequences_past_the_prefix_bound_stay_exact(fallback: Tokenizer) -> None:
    ids = fallback.encode("the answer 𠀀𠀁 is 🇯🇵🎉 e\u0301. " * 300).ids
    assert len(ids) > pieces_module.MAX_PREFIX_TOKENS
    check_exact(fallback, ids)


def test_wordpiece_metaspace_and_byte_level_stay_exact() -> None:
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=False)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    for tok in (wordpiece, byte_level):
        for text in ("the tool returned a reward", "the 🙂🙂 answer 𠀀𠀁 🇯🇵 e\u0301 is 42"):
            ids = tok.encode(text).ids
            found = token_pieces(tok, ids)
            assert found.exact and "".join(found.piece(i) for i in range(len(ids))) == tok.decode(ids, skip_special_tokens=False)


# ---- through a real collector: every tokens answer says ``exact`` ----------------------------------

class Loop:
    @rollout_trace_op
    async def generate(self, prompt_ids: list[int], ids: list[int]) -> dict[str, Any]:
        return {"token_ids": ids, "log_probs": [-0.1] * len(ids)}


def _traced(tracer: Any, ids: list[int]) -> str:
    async def one() -> str:
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="agent_loop") as trajectory:
            await Loop().generate([1], ids)
        return trajectory.span_id

    trace_id = asyncio.run(one())
    assert tracer.flush(30)
    return trace_id


def test_tokens_answers_are_exact_on_a_byte_fallback_tokenizer_and_say_so(start_collector, tracer_to, tmp_path: Path) -> None:
    tok = byte_fallback_bpe()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    text = "the answer 🙂🙂 is 👨\u200d👩\u200d👧 🇯🇵 𠀀𠀁 e\u0301 ok"
    ids = tok.encode(text).ids
    col = start_collector(token2text=True, tokenizer=str(path))
    trace_id = _traced(tracer_to(col.url, experiment="fallback"), ids)
    view = httpx.get(f"{col.url}/v1/trajectories/{trace_id}/tokens", timeout=30).json()
    assert view["exact"] is True
    [span] = view["spans"]
    assert span["exact"] is True and span["text"] == text
    assert [t["text"] for t in span["tokens"]] == check_exact(tok, ids)


def test_approximated_offsets_are_flagged_in_the_answer_the_cli_and_the_viewer(start_collector, tracer_to, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Where no exact method fits (forced here: an odd decoder on a long sequence), the pieces still join
    to the text and every reader is told they are approximated."""
    from tracecar.client import cli
    from tracecar.collector.viewer import routes

    tok = byte_fallback_bpe()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    for name in ("_byte_fallback_ends", "_byte_level_ends", "_ends_from"):
        monkeypatch.setattr(pieces_module, name, lambda *args, **kwargs: None)
    col = start_collector(token2text=True, tokenizer=str(path))
    trace_id = _traced(tracer_to(col.url, experiment="approx"), tok.encode("the answer 🙂🙂 is 42").ids)
    view = httpx.get(f"{col.url}/v1/trajectories/{trace_id}/tokens", timeout=30).json()
    [span] = view["spans"]
    assert view["exact"] is False and span["exact"] is False
    assert "".join(t["text"] for t in span["tokens"]) == span["text"] == "the answer 🙂🙂 is 42"
    assert cli.main(["tokens", trace_id, "--url", col.url]) in (0, None)
    assert "token boundaries approximated" in capsys.readouterr().out
    assert 'data-testid": "token-inexact"' in (routes.STATIC / "app.js").read_text()
