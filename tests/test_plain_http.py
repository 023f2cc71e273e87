"""The sender's plain-http transport (tracecar.client.plain_http): httpx's interface over http.client.

Against a real collector (uvicorn on 127.0.0.1) and against small socket servers that misbehave
the way real peers do: one that closes a kept-alive connection while it is idle, one that hangs
up before answering, one that never answers, one that answers compressed and chunked, and a port
nobody listens on. Each failure must surface as the httpx exception the sender's retry logic
already tells apart (unreachable or not), and a stale connection must cost no failure at all.
"""

from __future__ import annotations

import gzip
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.support import free_port
from tracecar.client import plain_http, rollout_trace_attr, rollout_trace_op
from tracecar.client.plain_http import PlainHttpTransport, usable_for

pytestmark = pytest.mark.timeout(60)
ANSWER = b'{"accepted":1}'


def _read_request(conn: socket.socket, pending: bytes = b"") -> tuple[bytes, bytes] | None:
    """(head, body) of one request from ``conn``, or None at its end."""
    data = pending
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head, rest[:length]


@pytest.fixture
def socket_server() -> Iterator[Callable[[Callable[[socket.socket, list[tuple[bytes, bytes]]], None]], tuple[int, list]]]:
    """Factory: a loopback server running ``serve(conn, seen)`` per accepted connection, in a thread."""
    listeners: list[socket.socket] = []

    def start(serve: Callable[[socket.socket, list[tuple[bytes, bytes]]], None]) -> tuple[int, list]:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)
        seen: list[tuple[bytes, bytes]] = []

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    try:
                        serve(conn, seen)
                    except OSError:
                        pass

        threading.Thread(target=accept, daemon=True).start()
        return listener.getsockname()[1], seen

    yield start
    for listener in listeners:
        listener.close()


def _ok(extra_headers: bytes = b"", body: bytes = ANSWER) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra_headers + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


def _post(transport: PlainHttpTransport, port: int, body: bytes = b'{"spans":[]}') -> httpx.Response:
    with httpx.Client(transport=transport, headers={"Authorization": "Bearer t0ken"}) as client:
        return client.post(f"http://127.0.0.1:{port}/v1/spans?x=1", content=body)


def test_usable_only_for_plain_http_without_a_proxy(monkeypatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert usable_for("http://127.0.0.1:4318")
    assert not usable_for("https://collector.example:443")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")  # httpx would route through it: httpx's own pool
    assert not usable_for("http://127.0.0.1:4318")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1,.svc.cluster.local")  # ... unless NO_PROXY says direct
    assert usable_for("http://127.0.0.1:4318") and usable_for("http://localhost:4318")
    assert usable_for("http://tracecar.ns.svc.cluster.local:4318")
    assert not usable_for("http://collector.example:4318")
    urls = ["http://127.0.0.1:4318", "http://localhost:4318", "http://tracecar.ns.svc.cluster.local:4318",
            "http://svc.cluster.local:4318", "http://collector.example:4318", "http://sub.example.org:80",
            "http://example.org:80", "http://badexample.org:80", "http://10.1.2.3:4318", "http://[::1]:4318"]
    for no_proxy in ("localhost,127.0.0.1,.svc.cluster.local", "example.org", ".example.org", "*", "",
                     "10.0.0.0/8,::1", "http://collector.example", "localhost:4318"):
        monkeypatch.setenv("NO_PROXY", no_proxy)
        with httpx.Client() as pool:  # where this says direct, httpx's own pool goes direct as well
            for url in urls:
                if usable_for(url):
                    assert pool._transport_for_url(httpx.URL(url)) is pool._transport, (no_proxy, url)
    monkeypatch.setenv("NO_PROXY", ".example.org")
    assert usable_for("http://sub.example.org") and not usable_for("http://example.org")  # as httpx reads it


def test_the_sender_posts_through_it_to_a_real_collector(start_collector, tracer_to) -> None:
    collector = start_collector()
    tracer = tracer_to(collector.url)

    @rollout_trace_op
    def generate(prompt_ids: list[int]) -> dict[str, list[int]]:
        return {"response_ids": [i + 1 for i in prompt_ids]}

    for i in range(40):
        with rollout_trace_attr(sample_index=i, step=1, rollout_n=0):
            generate(list(range(i, i + 300)))
    assert tracer.flush(20)
    assert isinstance(tracer.sender._http._transport, PlainHttpTransport)
    stats = tracer.stats()
    assert stats["sent"] == 80 and not stats["dropped"], stats
    with httpx.Client() as reader:
        listed = reader.get(f"{collector.url}/v1/trajectories", params={"limit": 100}).json()
    assert len(listed["trajectories"]) == 40


def test_the_request_arrives_whole_with_its_headers(socket_server) -> None:
    def serve(conn, seen):
        pending = b""
        while (request := _read_request(conn, pending)) is not None:
            seen.append(request)
            conn.sendall(_ok())

    port, seen = socket_server(serve)
    transport = PlainHttpTransport(5)
    body = orjson.dumps({"spans": [{"prompt_ids": list(range(50_000))}]})  # larger than a socket buffer
    answer = _post(transport, port, body)
    assert answer.status_code == 200 and answer.json() == {"accepted": 1}
    head, received = seen[0]
    assert received == body
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/spans?x=1 HTTP/1.1"
    assert any(line.lower() == b"authorization: bearer t0ken" for line in lines)
    assert sum(line.lower().startswith(b"host:") for line in lines) == 1  # httpx's Host, not a second one


def test_a_connection_closed_while_idle_costs_no_failure(socket_server) -> None:
    """The server answers (keep-alive implied) and then closes: the next post goes out on a new
    connection, with no error to the caller."""
    def serve(conn, seen):
        request = _read_request(conn)
        if request is not None:
            seen.append(request)
            conn.sendall(_ok())
        conn.shutdown(socket.SHUT_RDWR)

    port, seen = socket_server(serve)
    transport = PlainHttpTransport(5)
    with httpx.Client(transport=transport) as client:
        for i in range(3):
            assert client.post(f"http://127.0.0.1:{port}/v1/spans", content=b"[%d]" % i).status_code == 200
    assert [body for _, body in seen] == [b"[0]", b"[1]", b"[2]"]


def test_a_hang_up_before_answering_is_a_remote_protocol_error(socket_server) -> None:
    def serve(conn, seen):
        if _read_request(conn) is not None:
            seen.append(b"")
        # closed without a status line

    port, seen = socket_server(serve)
    with pytest.raises(httpx.RemoteProtocolError):
        _post(PlainHttpTransport(5), port)
    assert seen  # the request did reach it (one try: a fresh connection is not retried)


def test_no_listener_is_a_connect_error_and_silence_a_read_timeout(socket_server) -> None:
    with pytest.raises(httpx.ConnectError):
        _post(PlainHttpTransport(2), free_port())
    stop = threading.Event()

    def serve(conn, seen):
        _read_request(conn)
        stop.wait(10)  # never answers

    port, _ = socket_server(serve)
    with pytest.raises(httpx.ReadTimeout):
        _post(PlainHttpTransport(0.3), port)
    stop.set()


def test_a_compressed_chunked_answer_reads_as_httpx_would(socket_server) -> None:
    packed = gzip.compress(b'{"accepted":2,"wire_versions":[1,2,3]}')

    def serve(conn, seen):
        if _read_request(conn) is not None:
            chunked = b"%x\r\n" % len(packed) + packed + b"\r\n0\r\n\r\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" + chunked)

    port, _ = socket_server(serve)
    answer = _post(PlainHttpTransport(5), port)
    assert answer.json() == {"accepted": 2, "wire_versions": [1, 2, 3]}


def test_only_plain_http(socket_server) -> None:
    with pytest.raises(httpx.UnsupportedProtocol):
        with httpx.Client(transport=PlainHttpTransport(1)) as client:
            client.post("https://127.0.0.1:1/v1/spans", content=b"{}")
    assert plain_http.usable_for("http://localhost:4318/")
