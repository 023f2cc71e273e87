"""Slow and idle clients: header, body and idle timeouts and a bound on the request head.

uvicorn alone arms a timer only after a response (``timeout_keep_alive``): a connection that
never finishes its headers, or trickles its body a byte at a time, is held forever, and its
httptools parser buffers a request head of any size. This subclass of uvicorn's httptools
protocol adds what the OpenTelemetry Collector's HTTP server (Go's ``net/http``) has:

* ``header_timeout_s`` (ReadHeaderTimeout, 1 min there): from connect, or from the first byte
  of the next request on a kept-alive connection, until the headers are complete; then 408.
* ``body_timeout_s`` (the rest of ReadTimeout): from the end of the headers until the whole
  body is in; then the connection is closed (the app sees a disconnect and stores nothing).
* ``idle_timeout_s`` (IdleTimeout, 1 min there): a kept-alive connection with no request.
* ``max_header_bytes`` (MaxHeaderBytes): a larger request head gets 431 and the connection closes.

Each close is reported through ``on_close(reason)`` (counted in ``tracecar_http_closed_total``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_IDLE, _HEAD, _BODY, _APP = "idle", "head", "body", "app"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024


def _answer(status: str) -> bytes:
    return f"HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\n\r\n".encode()


def guarded_protocol(limits: ConnectionLimits, on_close: Callable[[str], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` enforced; pass it as ``uvicorn.Config(http=...)``."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.timeout_keep_alive = limits.idle_timeout_s  # type: ignore[assignment]  # uvicorn says int; call_later takes float
            self._phase = _HEAD
            self._head_bytes = 0
            self._timer: asyncio.TimerHandle | None = None

        # ---- timers ------------------------------------------------------------------------
        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, reason)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, reason: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            on_close(reason)
            if reason == "header_timeout":
                self.transport.write(_answer("408 Request Timeout"))
            self.transport.close()  # mid-body: the app's receive() gets http.disconnect

        # ---- protocol events ---------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(limits.header_timeout_s, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._phase == _IDLE:  # the next request starts (even a trickle of CRLFs)
                self._phase, self._head_bytes = _HEAD, 0
                self._arm(limits.header_timeout_s, "header_timeout")
            if self._phase == _HEAD:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._phase == _HEAD and self._head_bytes > limits.max_header_bytes and not self.transport.is_closing():
                self._disarm()
                on_close("header_too_large")
                self.transport.write(_answer("431 Request Header Fields Too Large"))
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._phase = _BODY
            self._arm(limits.body_timeout_s, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()
            if self.cycle is not None and self.cycle.response_complete:
                self._go_idle()  # answered before its body was in (e.g. 503): idle from now
            else:
                self._phase = _APP  # the app is working: no client timer

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._phase != _BODY:  # else the body is still arriving under its own timer
                self._go_idle()

        def _go_idle(self) -> None:
            self._disarm()
            self._phase, self._head_bytes = _IDLE, 0
            if not self.transport.is_closing() and self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def timeout_keep_alive_handler(self) -> None:
            if not self.transport.is_closing():
                on_close("idle_timeout")
            super().timeout_keep_alive_handler()

    return GuardedHttpToolsProtocol
