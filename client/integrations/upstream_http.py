"""The proxy's HTTP/1.1 client to the upstream: asyncio protocol + httptools' parser, pooled keep-alive.

Why not httpx (the thin client's own HTTP library): through httpx → httpcore → anyio → h11 one
forwarded request cost the proxy ~1 ms of CPU on a 2-core machine (bench/proxy.py, profiled),
and the proxy's goal is under 1 ms added at p99. llhttp (httptools, which uvicorn's server side
uses too) parses the upstream's answer in C; body chunks are handed on as they arrive, with flow
control (the upstream's socket stops being read while the client is slower than the model).

Bounds: ``connect_timeout_s`` to connect; ``read_timeout_s`` between two pieces of the answer (a
timer reset per chunk, not a task per wait); ``max_connections`` open at once (0: no bound);
at most ``max_idle`` kept for reuse. A pooled connection the upstream closed while idle is
detected before any byte of an answer arrives, and the request is sent once more on a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import Any
from urllib.parse import urlsplit

import httptools

PAUSE_CHUNKS = 64  # stop reading the upstream's socket while this many chunks wait for a slow client
RESUME_CHUNKS = 8


class UpstreamError(Exception):
    """No usable answer: ``kind`` is ``unreachable`` (connect failed), ``timeout`` or ``broke_off``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_END = object()


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.chunks: collections.deque[Any] = collections.deque()
        self.ready = asyncio.Event()  # headers (or a failure) known
        self.more = asyncio.Event()  # a chunk, the end or a failure waits in ``chunks``
        self.got_bytes = False
        self.complete = False
        self.keep_alive = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.error: UpstreamError | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail("broke_off", f"unreadable HTTP from the upstream: {exc}")
            self.close()
        self._arm_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if not self.complete:
            if self.status and not self._framed():  # an answer delimited by the connection's end (HTTP/1.0 style)
                self.on_message_complete()
            else:
                self._fail("broke_off", f"the upstream closed the connection{f' ({exc})' if exc else ''}")

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.ready.set()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.more.set()
        if len(self.chunks) >= PAUSE_CHUNKS and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # read here: after the callback the parser has moved on
        self.complete = True
        self._cancel_timer()
        self.chunks.append(_END)
        self.more.set()
        self.ready.set()

    # ---- timers and failures ------------------------------------------------------------------
    def _arm_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.complete:
            self.timer = self.loop.call_later(self.pool.read_timeout_s, self._timed_out)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        if self.paused:  # not reading because the client is slow: the upstream is not the one waiting
            self._arm_timer()
            return
        self._fail("timeout", f"no answer from the upstream for {self.pool.read_timeout_s:g} s")
        self.close()

    def _fail(self, kind: str, message: str) -> None:
        if self.error is None and not self.complete:
            self.error = UpstreamError(kind, message)
            self._cancel_timer()
            self.chunks.append(self.error)
            self.more.set()
            self.ready.set()

    def _framed(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" in names or b"transfer-encoding" in names

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # ---- one exchange -------------------------------------------------------------------------
    async def exchange(self, head: bytes, body: bytes) -> None:
        """Sends the request and waits for the answer's status line and headers."""
        assert self.transport is not None
        self._reset()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        self._arm_timer()
        await self.ready.wait()
        if self.error is not None and not self.status:
            raise self.error

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it came off the wire (de-chunked), None at the end."""
        while not self.chunks:
            self.more.clear()
            await self.more.wait()
        chunk = self.chunks.popleft()
        if self.paused and len(self.chunks) <= RESUME_CHUNKS and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        if chunk is _END:
            return None
        if isinstance(chunk, UpstreamError):
            raise chunk
        return chunk


class UpstreamResponse:
    """Status, raw headers and the body, read chunk by chunk; :meth:`close` returns the connection."""

    def __init__(self, pool: UpstreamPool, conn: UpstreamConnection, head_only: bool) -> None:
        self.pool = pool
        self.conn = conn
        self.closed = False
        self.status = conn.status
        self.headers = conn.headers
        self.head_only = head_only
        self.done = head_only

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def chunks(self) -> Any:
        while not self.done:
            chunk = await self.conn.next_chunk()
            if chunk is None:
                self.done = True
                return
            yield chunk

    def close(self) -> None:
        """Back to the pool when the answer was read to its end and the upstream keeps the connection; closed otherwise."""
        if self.closed:
            return
        self.closed = True
        if self.pool.limit is not None:
            self.pool.limit.release()
        conn = self.conn
        if self.done and conn.complete and not self.head_only and conn.keep_alive and not conn.closed:
            self.pool.release(conn)
        else:
            conn.close()
            self.pool.forget(conn)


class UpstreamPool:
    """Keep-alive connections to one upstream (``http://`` or ``https://``)."""

    def __init__(self, base_url: str, connect_timeout_s: float, read_timeout_s: float, max_connections: int = 0,
                 max_idle: int = 256) -> None:
        parts = urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        default = (self.https and self.port == 443) or (not self.https and self.port == 80)
        self.host_header = (parts.netloc.rsplit("@", 1)[-1] if not default else self.host).encode("idna")
        self.prefix = parts.path.rstrip("/").encode()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self.idle: list[UpstreamConnection] = []
        self.open: set[UpstreamConnection] = set()
        self.limit = asyncio.Semaphore(max_connections) if max_connections else None
        self.ssl = ssl.create_default_context() if self.https else None

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Sends one request (``target``: path and query, appended to the base URL's path)."""
        lines = [b"%s %s%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n" % (
            method.encode("latin-1"), self.prefix, target.encode("latin-1"), self.host_header, len(body))]
        lines.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
        lines.append(b"\r\n")
        head = b"".join(lines)
        if self.limit is not None:
            await self.limit.acquire()  # released by the response's close()
        try:
            for attempt in (0, 1):
                conn, reused = await self._connection()
                try:
                    await conn.exchange(head, body)
                except UpstreamError as exc:
                    conn.close()
                    self.forget(conn)
                    if reused and attempt == 0 and exc.kind == "broke_off" and not conn.got_bytes:
                        continue  # the upstream had closed this idle connection: once more, on a fresh one
                    raise
                return UpstreamResponse(self, conn, method == "HEAD")
            raise AssertionError("unreachable")
        except BaseException:
            if self.limit is not None:
                self.limit.release()
            raise

    async def _connection(self) -> tuple[UpstreamConnection, bool]:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port, ssl=self.ssl,
                                       server_hostname=self.host if self.ssl else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError("timeout", f"could not connect within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamError("unreachable", f"{type(exc).__name__}: {exc.strerror or exc}") from None
        self.open.add(conn)
        return conn, False

    def release(self, conn: UpstreamConnection) -> None:
        conn._cancel_timer()
        if len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.close()
            self.forget(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        self.open.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    async def aclose(self) -> None:
        for conn in list(self.open):
            conn.close()
        self.idle.clear()
        self.open.clear()
