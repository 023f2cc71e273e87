"""The OpenAI-compatible capture proxy: an ASGI app that forwards to the upstream and records.

An agent uses ``http://PROXY/rollout/{rollout_id}/v1`` as its OpenAI base URL (Agent Lightning's
gateway form ``/rollout/{id}/attempt/{attempt}/v1`` too; or the plain ``/v1`` with an
``X-Tracecar-Rollout`` header). Each request goes to the upstream as it came (minus hop-by-hop
headers), and the upstream's answer comes back as it was sent — status, headers, body bytes, one
chunk at a time as they arrive (server-sent events included). The proxy never answers in the
upstream's place, except when there is no answer: 502 naming the upstream when it cannot be
reached, 504 when it does not answer within ``read_timeout_s``.

Recording stays off the request's path: a ``POST`` to ``/v1/chat/completions`` or
``/v1/completions`` of a rollout keeps references to the request's and response's bytes (up to
``max_record_bytes`` each) and, when the answer has been forwarded, appends one record to the thin
client's bounded queue; the sender thread parses it into a ``generate`` span
(:mod:`.proxy_record`) and posts it to the collector. ``POST /rollout/{id}/reward`` ends the rollout
with its reward (:mod:`.proxy_rollouts`). ``GET /tracecar/healthz`` and ``GET /tracecar/stats``
are the proxy's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any
from urllib.parse import unquote

import orjson

from ..tracer import Tracer
from .proxy_config import ProxyConfig
from .proxy_record import RECORDED_ENDPOINTS, ExchangeRecord
from .proxy_rollouts import ATTEMPT_HEADER, MAX_ID_CHARS, META_HEADERS, ROLLOUT_HEADER, MetaError, Rollouts, header_meta
from .upstream_http import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger("tracecar.proxy")

#: hop-by-hop headers (RFC 9110 7.6.1) and what the HTTP layers set for themselves; never forwarded either way
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                        b"te", b"trailer", b"transfer-encoding", b"upgrade"})
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}  # the body is read whole: no 100-continue
_OWN_PREFIX = b"x-tracecar-"
ROLLOUT_PREFIX = "/rollout/"
WARN_INTERVAL_S = 60.0


class ProxyApp:
    """The ASGI application (run by uvicorn, see :func:`tracecar.client.cli.proxy.serve_proxy`)."""

    def __init__(self, config: ProxyConfig, tracer: Tracer) -> None:
        self.config = config
        self.tracer = tracer
        self.base = config.upstream_base
        self.rollouts = Rollouts(tracer.emit, tracer.config.experiment, config.rollout_idle_s, config.max_rollouts)
        self.stats: Counter[str] = Counter()
        self.http: UpstreamPool | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._warned_at: dict[str, float] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    async def startup(self) -> None:
        cfg = self.config
        self.http = UpstreamPool(self.base, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.max_connections)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def shutdown(self) -> None:
        """Closes the open rollouts (their roots are sent) and flushes the sender, bounded."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        closed = self.rollouts.close_all("shutdown")
        if self.http is not None:
            await self.http.aclose()
        drained = await asyncio.to_thread(self.tracer.shutdown, self.tracer.config.shutdown_timeout_s)
        log.info("tracecar proxy: stopped; %d open rollouts closed, %s", closed, "spans flushed" if drained else "spans left unsent")

    async def _sweep_forever(self) -> None:
        interval = max(0.05, min(5.0, self.config.rollout_idle_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.rollouts.sweep()

    # ---- ASGI ----------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # noqa: BLE001 - uvicorn reports it and exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        rollout_id = attempt = None
        if path.startswith(ROLLOUT_PREFIX):
            rollout_id, attempt, path = split_rollout_path(path)
            if path == "/reward":
                await self._reward(scope, receive, send, rollout_id, attempt)
                return
        elif path.startswith("/tracecar/"):
            await self._own(scope, send, path)
            return
        await self._forward(scope, receive, send, path, rollout_id, attempt)

    # ---- forwarding ----------------------------------------------------------------------
    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any, path: str, rollout_id: str | None,
                       attempt: str | None) -> None:
        body = await _read_body(receive)
        headers = []
        meta_headers = []
        for name, value in scope["headers"]:
            if name.startswith(_OWN_PREFIX):
                if name == ROLLOUT_HEADER and rollout_id is None:
                    rollout_id = unquote(value.decode("latin-1"))
                elif name == ATTEMPT_HEADER and attempt is None:
                    attempt = unquote(value.decode("latin-1"))
                elif name in META_HEADERS:
                    meta_headers.append((name, value))
            elif name not in _NOT_FORWARDED:
                headers.append((name, value))
        query = scope.get("query_string") or b""
        target = path + ("?" + query.decode("latin-1") if query else "")
        record = None
        if rollout_id is not None and scope["method"] == "POST" and path in RECORDED_ENDPOINTS:
            record = self._start_record(path, body, rollout_id, attempt, meta_headers)
        assert self.http is not None, "the proxy serves requests only after its startup"
        try:
            response = await self.http.request(scope["method"], target, headers, body)
        except UpstreamError as exc:
            if exc.kind == "timeout":
                await self._no_answer(send, record, 504, f"upstream {self.base} did not answer: {exc} "
                                                         "(TRACECAR_PROXY_READ_TIMEOUT_S / TRACECAR_PROXY_CONNECT_TIMEOUT_S)")
            else:
                await self._no_answer(send, record, 502, f"upstream {self.base} unreachable: {exc}")
            return
        try:
            await self._pass_through(response, receive, send, record)
        finally:
            response.close()
            self._answered(record)

    async def _pass_through(self, response: UpstreamResponse, receive: Any, send: Any, record: ExchangeRecord | None) -> None:
        """The upstream's status, headers and body bytes, chunk by chunk as they arrive."""
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP]})
        self.stats["forwarded"] += 1
        if response.status >= 500:
            self.stats["upstream_5xx"] += 1
        streaming = (response.header(b"content-type") or b"").startswith(b"text/event-stream")
        watcher = asyncio.ensure_future(receive()) if streaming else None  # a client that leaves ends the upstream's stream
        keep = record is not None
        kept = 0
        try:
            async for chunk in response.chunks():
                if keep:
                    assert record is not None
                    if record.first_byte is None:
                        record.first_byte = time.time()
                    kept += len(chunk)
                    if kept <= self.config.max_record_bytes:
                        record.response_chunks.append(chunk)
                    else:
                        keep, record.truncated = False, True
                        self.stats["recordings_truncated"] += 1
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if watcher is not None and watcher.done():
                    self.stats["client_disconnects"] += 1
                    self._finish(record, response, "ClientDisconnected: the client left before the answer ended")
                    return
        except UpstreamError as exc:  # the upstream broke off mid-answer: the client sees it end there, as it would
            self.stats["upstream_broke_off"] += 1
            self._finish(record, response, f"UpstreamError: the answer broke off ({exc})")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
        self._finish(record, response, None)  # queued before the last (empty) chunk: before the client can act on the end
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _start_record(self, endpoint: str, body: bytes, rollout_id: str, attempt: str | None,
                      meta_headers: list[tuple[bytes, bytes]]) -> ExchangeRecord | None:
        if not 0 < len(rollout_id) <= MAX_ID_CHARS or (attempt is not None and not 0 < len(attempt) <= MAX_ID_CHARS):
            self.stats["unrecorded_bad_rollout_id"] += 1
            self._warn("rollout_id", f"rollout id or attempt of 1 to {MAX_ID_CHARS} characters expected; request forwarded, not recorded")
            return None
        meta, ignored = header_meta(meta_headers) if meta_headers else ({}, [])
        for reason in ignored:
            self.stats["headers_ignored"] += 1
            self._warn("header", reason)
        rollout = self.rollouts.touch(rollout_id, attempt, meta)
        rollout.in_flight += 1
        rollout.requests += 1
        record = ExchangeRecord(endpoint, time.time(), rollout.root, rollout.child_attributes,
                                body if len(body) <= self.config.max_record_bytes else b"")
        if len(body) > self.config.max_record_bytes:
            record.truncated = True
            self.stats["recordings_truncated"] += 1
        return record

    def _finish(self, record: ExchangeRecord | None, response: UpstreamResponse | None, failure: str | None) -> None:
        if record is None:
            return
        record.end = time.time()
        record.failure = failure
        if response is not None:
            record.status = response.status
            encoding = response.header(b"content-encoding")
            record.content_encoding = encoding.decode("latin-1") if encoding else None
        self.tracer.emit(record)
        self.stats["recorded"] += 1

    def _answered(self, record: ExchangeRecord | None) -> None:
        """The request is over: its rollout may go idle again (unless it was closed meanwhile)."""
        if record is not None:
            rollout = self.rollouts.open.get(record.trace.span_id)
            if rollout is not None and rollout.in_flight > 0:
                rollout.in_flight -= 1

    async def _no_answer(self, send: Any, record: ExchangeRecord | None, status: int, message: str) -> None:
        """The upstream gave no answer: a clear error naming it (OpenAI's error shape), recorded as a failed call."""
        self.stats["upstream_unreachable" if status == 502 else "upstream_timeouts"] += 1
        self._warn(f"upstream_{status}", message)
        if record is not None:
            self._finish(record, None, message)
            self._answered(record)
        body = orjson.dumps({"error": {"message": f"tracecar proxy: {message}", "type": "upstream_unreachable" if status == 502
                                       else "upstream_timeout", "code": status}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # ---- the proxy's own routes ----------------------------------------------------------
    async def _reward(self, scope: dict[str, Any], receive: Any, send: Any, rollout_id: str | None, attempt: str | None) -> None:
        if scope["method"] != "POST":
            await _json(send, 405, {"error": {"field": "method", "reason": "POST a JSON body, e.g. {\"reward\": 1.0}"}})
            return
        body = await _read_body(receive, limit=65536)
        if body is None:
            await _json(send, 413, {"error": {"field": "body", "reason": "over 65536 bytes"}})
            return
        if not rollout_id or len(rollout_id) > MAX_ID_CHARS:
            await _json(send, 422, {"error": {"field": "rollout_id", "reason": f"must be 1 to {MAX_ID_CHARS} characters"}})
            return
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            await _json(send, 400, {"error": {"field": "body", "reason": f"not JSON: {exc}"}})
            return
        try:
            answer = self.rollouts.reward(rollout_id, attempt, parsed)
        except MetaError as exc:
            self.stats["rewards_rejected"] += 1
            await _json(send, 422, {"error": {"field": exc.field, "reason": exc.reason}})
            return
        await _json(send, 200, answer)

    async def _own(self, scope: dict[str, Any], send: Any, path: str) -> None:
        if path == "/tracecar/healthz":
            await _json(send, 200, {"ok": True, "upstream": self.config.upstream, "collector": self.tracer.config.url})
        elif path == "/tracecar/stats":
            await _json(send, 200, self.stats_dict())
        else:
            await _json(send, 404, {"error": {"field": "path", "reason": "the proxy's own routes: /tracecar/healthz, /tracecar/stats"}})

    def stats_dict(self) -> dict[str, Any]:
        return {**self.stats, "rollouts_open": len(self.rollouts.open), "rollouts_closed": dict(self.rollouts.closed),
                "rewards": self.rollouts.rewards, "sender": self.tracer.stats()}

    def _warn(self, key: str, message: str) -> None:
        """Logged at once, then at most once a minute per kind (a request path must not flood the log)."""
        now = time.monotonic()
        if now - self._warned_at.get(key, -WARN_INTERVAL_S) >= WARN_INTERVAL_S:
            self._warned_at[key] = now
            log.warning("tracecar proxy: %s", message)


def split_rollout_path(path: str) -> tuple[str, str | None, str]:
    """``/rollout/{id}[/attempt/{a}]{rest}`` -> (id, attempt or None, rest); ids percent-decoded."""
    rollout, _, rest = path[len(ROLLOUT_PREFIX):].partition("/")
    rest = "/" + rest
    attempt = None
    if rest.startswith("/attempt/"):
        attempt, _, tail = rest[len("/attempt/"):].partition("/")
        attempt = unquote(attempt)
        rest = "/" + tail
    return unquote(rollout), attempt, rest


async def _read_body(receive: Any, limit: int | None = None) -> Any:
    """The request body; None past ``limit`` bytes (the rest is not read)."""
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                return None
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _json(send: Any, status: int, value: Any) -> None:
    body = orjson.dumps(value)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
