"""The capture proxy's recorder: a streamed answer reassembles to the non-streamed one (tool calls
arriving in pieces, completions, vLLM's token ids and logprobs), compressed and unreadable bodies
are recorded as such, never lost."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

from tests.support.openai_upstream import OpenAIUpstream
from tracecar.client.integrations.proxy_record import CHAT, COMPLETIONS, ExchangeRecord, describe_exchange, sse_data
from tracecar.client.spans import KIND_TRAJECTORY, SpanRecord

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def upstream(small_bpe_path: str) -> OpenAIUpstream:
    return OpenAIUpstream(Tokenizer.from_file(small_bpe_path))


def answered(upstream: OpenAIUpstream, path: str, request: dict[str, Any]) -> bytes:
    """The upstream's body for ``request``, as its ASGI app sends it (streamed or not)."""
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": orjson.dumps(request), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    asyncio.run(upstream({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send))
    return b"".join(sent)


def record(path: str, request: dict[str, Any], body: bytes, encoding: str | None = None, status: int = 200) -> ExchangeRecord:
    root = SpanRecord("rollout", KIND_TRAJECTORY, 1.0, None, {})
    rec = ExchangeRecord(path, 1.0, root, {}, orjson.dumps(request))
    rec.response_chunks = [body[: len(body) // 2], body[len(body) // 2:]]
    rec.status, rec.content_encoding, rec.end = status, encoding, 1.5
    return rec


@pytest.mark.parametrize("path, request_body", [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "add two numbers"}], "tools": TOOLS, "logprobs": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "say the rollout words"}], "logprobs": True,
            "return_token_ids": True}),
    (COMPLETIONS, {"model": "m", "prompt": "count the reward steps", "logprobs": 1, "return_token_ids": True}),
])
def test_a_streamed_answer_is_recorded_as_the_same_answer_unstreamed(upstream, path, request_body):
    whole = describe_exchange(record(path, request_body, answered(upstream, path, request_body)))
    stream_request = {**request_body, "stream": True, "stream_options": {"include_usage": True}}
    streamed = describe_exchange(record(path, stream_request, answered(upstream, path, stream_request)))
    keep = ("content", "text", "tool_calls", "token_ids", "log_probs", "finish_reason", "usage", "response_text", "prompt_text")
    assert {k: whole[1].get(k) for k in keep} == {k: streamed[1].get(k) for k in keep}
    assert whole[0]["prompt_ids"] == streamed[0]["prompt_ids"] and whole[0]["prompt_ids"]
    assert streamed[1]["stream"] is True and streamed[1]["chunks"] > 2 and whole[1]["stream"] is False
    turn = upstream.generate(request_body, chat=path == CHAT)
    assert whole[1]["token_ids"] == turn["ids"] and whole[1]["log_probs"] == pytest.approx(turn["logprobs"])
    if request_body.get("tools"):
        assert whole[1]["tool_calls"] == [turn["tool_call"]] and whole[1]["content"] is None


def test_ids_spelled_token_id_n_are_read_when_the_server_sends_no_token_ids(upstream):
    request = {"model": "m", "messages": [{"role": "user", "content": "add"}], "logprobs": True, "return_tokens_as_token_ids": True}
    _, output, _ = describe_exchange(record(CHAT, request, answered(upstream, CHAT, request)))
    assert output["token_ids"] == upstream.generate(request, chat=True)["ids"]


def test_compressed_error_and_unreadable_bodies_are_recorded_as_they_are():
    request = {"model": "m", "messages": []}
    error = orjson.dumps({"error": {"message": "model not found", "type": "NotFoundError", "code": 404}})
    _, output, exception = describe_exchange(record(CHAT, request, gzip.compress(error), "gzip", status=404))
    assert output["error"]["error"]["message"] == "model not found" and exception == "UpstreamError: HTTP 404: model not found"
    _, output, exception = describe_exchange(record(CHAT, request, b"<html>bad gateway</html>", status=200))
    assert output["unparsed"] == "<html>bad gateway</html>" and exception is None
    inputs, output, _ = describe_exchange(record(CHAT, {"model": "m"}, b"", status=None))  # no answer at all
    assert output == {"status": None, "stream": False, "latency_s": 0.5} and inputs["model"] == "m"


def test_server_sent_events_split_on_any_line_ending_and_join_multi_line_data():
    body = b"data: {\"a\": 1}\r\n\r\nevent: x\ndata: {\"b\":\ndata: 2}\n\n: comment\n\ndata: [DONE]\n\n"
    assert sse_data(body) == [b"{\"a\": 1}", b"{\"b\":\n2}", b"[DONE]"]
