"""One OpenAI-compatible exchange as a ``generate`` span, built on the sender thread.

The proxy's request path keeps only references: the request body's bytes, the response's raw
chunks, the status and a few timestamps (:class:`ExchangeRecord`). Everything else — decompressing,
parsing JSON or server-sent events, reassembling a streamed answer, pulling out token ids and
log-probabilities — happens here, when the sender thread asks the record for its wire form.

What a span holds (docs/integrations.md):

* ``inputs``: the request's ``messages`` (chat) or ``prompt`` (completions), ``tools``, ``model``,
  the other request fields under ``sampling_params``, the ``endpoint``, and ``prompt_ids`` when the
  server returned the prompt's token ids (vLLM's ``return_token_ids``: ``prompt_token_ids``);
* ``output``: the first choice's ``content`` / ``text``, ``reasoning_content``, ``tool_calls``,
  ``finish_reason``, ``stop_reason``; ``token_ids`` (vLLM's ``token_ids``, else parsed from
  ``return_tokens_as_token_ids``' ``token_id:N`` logprob tokens) and ``log_probs`` (the chosen
  tokens' log-probabilities); ``usage``; ``status``, ``stream``, ``latency_s``, ``first_byte_s``;
  ``response_text`` / ``prompt_text`` rendered from the messages, which the collector replaces
  with the exact decode when it has the tokenizer and the ids; other choices under ``other_choices``.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import orjson

from ..spans import KIND_OP, SpanRecord

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RECORDED_ENDPOINTS = frozenset({CHAT, COMPLETIONS})
#: request fields that have a place of their own in ``inputs``; the rest go under ``sampling_params``
_OWN_FIELDS = frozenset({"messages", "prompt", "tools", "model", "stream", "stream_options"})
_TOKEN_ID = re.compile(r"token_id:(-?\d+)\Z")
ERROR_TEXT_CHARS = 65536


class ExchangeRecord(SpanRecord):
    """A request through the proxy, as captured on its path: bytes and times, parsed later."""

    __slots__ = ("endpoint", "request_body", "response_chunks", "status", "content_encoding", "first_byte",
                 "truncated", "failure")

    def __init__(self, endpoint: str, start: float, parent: SpanRecord, attributes: dict[str, Any], request_body: bytes) -> None:
        super().__init__("generate", KIND_OP, start, parent, attributes)
        self.endpoint = endpoint
        self.request_body = request_body
        self.response_chunks: list[bytes] = []
        self.status: int | None = None
        self.content_encoding: str | None = None
        self.first_byte: float | None = None
        self.truncated = False
        self.failure: str | None = None  # what the proxy saw go wrong: unreachable, timeout, client gone

    def to_wire(self, max_frames: int = 200) -> dict[str, Any]:
        inputs, output, exception = describe_exchange(self)
        parent = self.parent
        return {
            "span_id": self.span_id, "trace_id": self.trace.span_id, "parent_id": parent.span_id if parent is not None else None,
            "name": self.name, "kind": self.kind, "start_time": self.start, "end_time": self.end,
            "attributes": self.attributes or {}, "inputs": inputs, "output": output, "exception": exception,
        }


def describe_exchange(record: ExchangeRecord) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """(inputs, output, exception) of one exchange; never raises (a body it cannot read is kept as text)."""
    request = _loads(record.request_body)
    inputs = describe_request(record.endpoint, request, record.request_body)
    body = b"".join(record.response_chunks)
    output: dict[str, Any] = {"status": record.status}
    exception = record.failure
    stream = isinstance(request, dict) and request.get("stream") is True
    try:
        body = _decompress(body, record.content_encoding)
        if record.status is not None and record.status >= 400:
            error = _loads(body)
            output["error"] = error if error is not None else body[:ERROR_TEXT_CHARS].decode("utf-8", "replace")
            exception = exception or f"UpstreamError: HTTP {record.status}: {_error_message(error, body)}"
        elif record.status is not None:
            answer = assemble_stream(body) if stream else _loads(body)
            if isinstance(answer, dict):
                output.update(describe_answer(record.endpoint, answer, inputs))
            elif body:
                output["unparsed"] = body[:ERROR_TEXT_CHARS].decode("utf-8", "replace")
    except Exception as exc:  # noqa: BLE001 - a body we cannot read is recorded as such, never lost
        output["unparsed"] = body[:ERROR_TEXT_CHARS].decode("utf-8", "replace")
        output["parse_error"] = f"{type(exc).__name__}: {exc}"
    output["stream"] = stream
    if record.end is not None:
        output["latency_s"] = record.end - record.start
    if record.first_byte is not None:
        output["first_byte_s"] = record.first_byte - record.start
    if record.truncated:
        output["recording_truncated"] = True
    return inputs, output, exception


def describe_request(endpoint: str, request: Any, raw: bytes) -> dict[str, Any]:
    if not isinstance(request, dict):
        return {"endpoint": endpoint, "body": raw[:ERROR_TEXT_CHARS].decode("utf-8", "replace")}
    inputs: dict[str, Any] = {"endpoint": endpoint}
    for key in ("model", "messages", "prompt", "tools"):
        if key in request:
            inputs[key] = request[key]
    prompt = request.get("prompt")
    if _int_list(prompt):  # a completions request given token ids
        inputs["prompt_ids"] = prompt
    params = {k: v for k, v in request.items() if k not in _OWN_FIELDS}
    if params:
        inputs["sampling_params"] = params
    return inputs


def describe_answer(endpoint: str, answer: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The output fields of a (reassembled) answer; puts the prompt's ids into ``inputs``."""
    out: dict[str, Any] = {}
    for key in ("id", "model"):
        if answer.get(key) is not None:
            out[key] = answer[key]
    choices = [c for c in answer.get("choices") or () if isinstance(c, dict)]
    first = _choice(choices[0]) if choices else {}
    prompt_ids = answer.get("prompt_token_ids")
    if prompt_ids is None and choices:
        prompt_ids = choices[0].get("prompt_token_ids")  # completions: on the choice
    if _int_list(prompt_ids):
        inputs["prompt_ids"] = prompt_ids
    out.update(first)
    if len(choices) > 1:
        out["other_choices"] = [_choice(c) for c in choices[1:]]
    if isinstance(answer.get("usage"), dict):
        out["usage"] = answer["usage"]
    if answer.get("chunks"):
        out["chunks"] = answer["chunks"]  # server-sent events of a streamed answer
    text = first.get("content") if endpoint == CHAT else first.get("text")
    if endpoint == CHAT:
        out["response_text"] = render_message({"role": "assistant", **first}, with_role=False)
        if isinstance(inputs.get("messages"), list):
            out["prompt_text"] = render_messages(inputs["messages"])
    elif isinstance(text, str):
        out["response_text"] = text
        if isinstance(inputs.get("prompt"), str):
            out["prompt_text"] = inputs["prompt"]
    return out


def _choice(choice: dict[str, Any]) -> dict[str, Any]:
    """One choice, chat or completions, as the span's output keeps it."""
    out: dict[str, Any] = {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else None
    if message is not None:
        out["content"] = message.get("content")
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            out["tool_calls"] = message["tool_calls"]
    elif "text" in choice:
        out["text"] = choice["text"]
    for key in ("finish_reason", "stop_reason"):
        if choice.get(key) is not None:
            out[key] = choice[key]
    if choice.get("index", 0):
        out["index"] = choice["index"]
    ids, logprobs = token_ids_and_logprobs(choice)
    if ids is not None:
        out["token_ids"] = ids
    if logprobs is not None:
        out["log_probs"] = logprobs
    return out


def token_ids_and_logprobs(choice: dict[str, Any]) -> tuple[list[int] | None, list[float] | None]:
    """vLLM's ``token_ids`` (``return_token_ids``), else the ids spelled ``token_id:N`` in the logprobs
    (``return_tokens_as_token_ids``); and the chosen tokens' log-probabilities, chat or completions shape."""
    ids: list[int] | None = choice["token_ids"] if _int_list(choice.get("token_ids")) else None
    logprobs = choice.get("logprobs")
    tokens: list[Any] = []
    values: list[Any] = []
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if isinstance(content, list):  # chat: [{token, logprob, bytes, top_logprobs}]
            tokens = [c.get("token") if isinstance(c, dict) else None for c in content]
            values = [c.get("logprob") if isinstance(c, dict) else None for c in content]
        elif isinstance(logprobs.get("tokens"), list):  # completions: {tokens, token_logprobs, ...}
            tokens = logprobs["tokens"]
            values = logprobs["token_logprobs"] if isinstance(logprobs.get("token_logprobs"), list) else []
    if ids is None and tokens:
        matches = [_TOKEN_ID.match(t) if isinstance(t, str) else None for t in tokens]
        if all(matches):
            ids = [int(m.group(1)) for m in matches if m is not None]
    if not values or any(type(v) not in (int, float) for v in values):
        return ids, None
    return ids, [float(v) for v in values]


def assemble_stream(body: bytes) -> dict[str, Any] | None:
    """A streamed answer (server-sent events of ``chat.completion.chunk`` or ``text_completion``)
    put back together in the shape of the non-streamed one."""
    answer: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    events = 0
    for event in sse_data(body):
        if event == b"[DONE]":
            break
        chunk = _loads(event)
        if not isinstance(chunk, dict):
            continue
        events += 1
        for key in ("id", "model"):
            if key not in answer and chunk.get(key) is not None:
                answer[key] = chunk[key]
        if chunk.get("usage") is not None:
            answer["usage"] = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None and "prompt_token_ids" not in answer:
            answer["prompt_token_ids"] = chunk["prompt_token_ids"]
        for delta in chunk.get("choices") or ():
            if isinstance(delta, dict):
                _merge_delta(choices.setdefault(int(delta.get("index") or 0), {"index": int(delta.get("index") or 0)}), delta)
    if not events:
        return None
    answer["choices"] = [_finish_choice(choices[i]) for i in sorted(choices)]
    answer["chunks"] = events
    return answer


def _merge_delta(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    for key in ("finish_reason", "stop_reason"):
        if delta.get(key) is not None:
            acc[key] = delta[key]
    if delta.get("prompt_token_ids") is not None:
        acc.setdefault("prompt_token_ids", delta["prompt_token_ids"])
    if isinstance(delta.get("text"), str):
        acc.setdefault("text_parts", []).append(delta["text"])
    if _int_list(delta.get("token_ids")):
        acc.setdefault("token_ids", []).extend(delta["token_ids"])
    logprobs = delta.get("logprobs")
    if isinstance(logprobs, dict):
        merged = acc.setdefault("logprobs", {})
        if isinstance(logprobs.get("content"), list):
            merged.setdefault("content", []).extend(logprobs["content"])
        for key in ("tokens", "token_logprobs"):
            if isinstance(logprobs.get(key), list):
                merged.setdefault(key, []).extend(logprobs[key])
    message = delta.get("delta")
    if not isinstance(message, dict):
        return
    for key in ("content", "reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            acc.setdefault(f"{key}_parts", []).append(message[key])
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        calls = acc.setdefault("tool_calls", {})
        slot = calls.setdefault(int(call.get("index") or 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]


def _finish_choice(acc: dict[str, Any]) -> dict[str, Any]:
    choice = {k: v for k, v in acc.items() if not k.endswith("_parts") and k != "tool_calls"}
    if "text_parts" in acc:
        choice["text"] = "".join(acc["text_parts"])
        return choice
    message: dict[str, Any] = {"role": "assistant", "content": "".join(acc["content_parts"]) if "content_parts" in acc else None}
    for key in ("reasoning_content", "reasoning"):
        if f"{key}_parts" in acc:
            message[key] = "".join(acc[f"{key}_parts"])
    if acc.get("tool_calls"):
        message["tool_calls"] = [acc["tool_calls"][i] for i in sorted(acc["tool_calls"])]
        if message["content"] == "":  # the empty first/last deltas around a call: no content, as unstreamed
            message["content"] = None
    choice["message"] = message
    return choice


def sse_data(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of a server-sent-event stream (multi-line data joined with newlines)."""
    events = []
    for block in re.split(rb"\r\n\r\n|\n\n|\r\r", body):
        lines = [line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")]
        if lines:
            events.append(b"\n".join(lines))
    return events


def render_messages(messages: list[Any]) -> str:
    """A readable transcript of the chat (not the model's chat template): what the viewer shows
    when the collector cannot decode the prompt's token ids."""
    return "\n".join(render_message(m) for m in messages if isinstance(m, dict))


def render_message(message: dict[str, Any], with_role: bool = True) -> str:
    parts = []
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if isinstance(reasoning, str) and reasoning:
        parts.append(f"<think>{reasoning}</think>")
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):  # content parts: text, image_url, ...
        parts.extend(p.get("text", "") if p.get("type") == "text" else f"[{p.get('type')}]" for p in content if isinstance(p, dict))
    for call in message.get("tool_calls") or ():
        function: dict[str, Any] = call["function"] if isinstance(call, dict) and isinstance(call.get("function"), dict) else {}
        parts.append(f"[tool call {function.get('name')}({function.get('arguments', '')})]")
    text = "".join(parts)
    return f"{message.get('role', '?')}: {text}" if with_role else text


def _error_message(error: Any, body: bytes) -> str:
    if isinstance(error, dict):
        inner = error.get("error", error)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"][:500]
        if isinstance(error.get("message"), str):
            return error["message"][:500]
        if isinstance(error.get("detail"), str):
            return error["detail"][:500]
    return body[:500].decode("utf-8", "replace")


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data) if data else None
    except orjson.JSONDecodeError:
        return None


def _decompress(body: bytes, encoding: str | None) -> bytes:
    """The body as the server meant it: the proxy forwards compressed bytes untouched, so the record
    undoes gzip/deflate here (other encodings are recorded as they came)."""
    if not encoding or not body:
        return body
    encoding = encoding.strip().lower()
    if encoding == "gzip":
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:
            return zlib.decompress(body, -zlib.MAX_WBITS)
    return body


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)
