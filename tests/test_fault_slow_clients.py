"""Slow and idle clients (issue 11, item 10): header, body and idle timeouts, a bound on the head.

Raw sockets on 127.0.0.1 trickle bytes at a real collector; each case is bounded in time.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(90)

LIMITS = dict(http_header_timeout_s=1.0, http_body_timeout_s=1.0, http_idle_timeout_s=1.0, http_max_header_bytes=4096)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_after(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Reads until the server closes; returns what it sent and how long that took."""
    started, got = time.monotonic(), b""
    sock.settimeout(limit_s)
    while time.monotonic() - started < limit_s:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - started


def _trickle(sock: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return
        time.sleep(every_s)


def test_a_connection_that_sends_nothing_or_trickles_its_headers_is_closed_at_the_header_timeout(start_collector, kit):
    col = start_collector(**LIMITS)
    silent = _connect(col.url)
    got, took = _closed_after(silent)
    assert got.startswith(b"HTTP/1.1 408") and 0.8 <= took < 3.0, (got, took)

    head = b"POST /v1/spans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 200
    sock = _connect(col.url)
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(sock, head, 0.05, stop), daemon=True).start()
    started = time.monotonic()
    got, _ = _closed_after(sock)
    took = time.monotonic() - started
    stop.set()
    assert got.startswith(b"HTTP/1.1 408") and took < 3.0, (got, took)  # a byte every 50 ms does not keep it open
    assert kit.metrics(col.url, "tracecar_http_closed_total", reason="header_timeout") == 2


def test_a_trickled_body_is_cut_at_the_body_timeout_and_nothing_is_stored(start_collector, kit):
    col = start_collector(**LIMITS)
    spans = kit.trajectory(children=2)
    body, headers = kit.encode(spans)
    sock = _connect(col.url)
    sock.sendall(f"POST /v1/spans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(sock, body, 0.05, stop), daemon=True).start()
    started = time.monotonic()
    got, _ = _closed_after(sock)
    took = time.monotonic() - started
    stop.set()
    assert took < 3.0 and not got.startswith(b"HTTP/1.1 200"), (got, took)
    assert kit.metrics(col.url, "tracecar_http_closed_total", reason="body_timeout") == 1
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_batches_rejected_total", reason="client_disconnect") == 1, 5)
    assert kit.metrics(col.url, "tracecar_spans_accepted_total") == 0
    # the same batch sent at a normal pace is taken whole
    assert kit.post(col.url, spans).json()["accepted"] == 3


def test_an_idle_keep_alive_connection_is_closed_and_a_huge_head_gets_431(start_collector, kit):
    col = start_collector(**LIMITS)
    sock = _connect(col.url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    got, took = _closed_after(sock)
    assert got.startswith(b"HTTP/1.1 200") and 0.8 <= took < 3.0, (got, took)  # answered, then closed when idle
    assert kit.metrics(col.url, "tracecar_http_closed_total", reason="idle_timeout") == 1

    big = _connect(col.url)
    big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 64 * 1024)
    got, took = _closed_after(big)
    assert got.startswith(b"HTTP/1.1 431") and took < 3.0, got[:80]
    assert kit.metrics(col.url, "tracecar_http_closed_total", reason="header_too_large") == 1
    # a head under the bound is fine
    assert httpx.get(col.url + "/healthz", headers={"X-Ok": "o" * 3000}).status_code == 200


def test_twenty_slowloris_connections_are_all_closed_while_real_clients_are_served(start_collector, kit):
    col = start_collector(**LIMITS)
    head = b"POST /v1/spans HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 400
    stop = threading.Event()
    socks = [_connect(col.url) for _ in range(20)]
    for s in socks:
        threading.Thread(target=_trickle, args=(s, head, 0.1, stop), daemon=True).start()
    try:
        for _ in range(5):  # served meanwhile
            assert kit.post(col.url, kit.trajectory(children=1)).status_code == 200
        started = time.monotonic()
        results = [_closed_after(s) for s in socks]
        assert time.monotonic() - started < 5.0
        assert all(got.startswith(b"HTTP/1.1 408") for got, _ in results)
    finally:
        stop.set()
        for s in socks:
            s.close()
    assert kit.metrics(col.url, "tracecar_http_closed_total", reason="header_timeout") == 20
    assert kit.metrics(col.url, "tracecar_spans_accepted_total") == 10
