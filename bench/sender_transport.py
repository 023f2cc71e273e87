"""What the sender's post costs with three HTTP paths, on real bodies (nothing of the sender changed).

Spans of ``hot_path.py``'s call (trajectories of 4) are built by the real ``Sender._build_body``
(prompt deltas and short ids on, as against a current collector), and each body is posted to a
loopback sink process (reads the body, answers 200 with a small JSON) in one of three ways,
alternating in every round (ABAB):

- ``httpx``: the body joined, ``httpx.Client.post`` (what the sender does; h11 copies it again);
- ``http.client``: the body joined, ``http.client.HTTPConnection.request``;
- ``sendmsg``: no join: the body's pieces handed to one ``socket.sendmsg`` (scatter-gather),
  the answer read by ``http.client``'s parser.

Prints the sending thread's CPU per span for build + post, its minor page faults per span, and
each path against ``httpx`` in the same round (median and spread). Only 127.0.0.1; bounded by
``--spans`` and ``--rounds``.

    .venv/bin/python bench/sender_transport.py [--rounds 6] [--spans 2000]
"""

from __future__ import annotations

import argparse
import http.client
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from sender_harness import keep_body_pieces, shutdown, traced_sender

from common import free_port

SINK = """
import asyncio, sys
async def handle(r, w):
    try:
        while True:
            head = await r.readuntil(b"\\r\\n\\r\\n")
            n = next((int(l.split(b":")[1]) for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length:")), 0)
            await r.readexactly(n)
            w.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: 14\\r\\n\\r\\n" + b'{"accepted":1}')
            await w.drain()
    except Exception:
        w.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), limit=1 << 25)
    await server.serve_forever()
asyncio.run(main())
"""
IOV_MAX = 1024  # buffers one sendmsg takes on Linux


def sendmsg_all(sock: socket.socket, pieces: list[Any]) -> None:
    """Every byte of ``pieces``, in as few sendmsg calls as the kernel takes them."""
    while pieces:
        sent = sock.sendmsg(pieces[:IOV_MAX])
        done = 0
        while done < len(pieces) and sent >= len(pieces[done]):
            sent -= len(pieces[done])
            done += 1
        pieces = pieces[done:]
        if sent:
            pieces = [memoryview(pieces[0])[sent:], *pieces[1:]]


def posters(port: int) -> dict[str, Callable[[list[bytes]], None]]:
    url = f"http://127.0.0.1:{port}/v1/spans"
    headers = {"Content-Type": "application/json"}
    client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    scatter = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def with_httpx(pieces: list[bytes]) -> None:
        client.post(url, content=b"".join(pieces), headers=headers).json()

    def with_httpx_chunks(pieces: list[bytes]) -> None:
        chunks = join_in_chunks(pieces)
        client.post(url, content=chunks, headers={**headers, "Content-Length": str(sum(map(len, chunks)))}).json()

    def with_http_client(pieces: list[bytes]) -> None:
        plain.request("POST", "/v1/spans", body=b"".join(pieces), headers=headers)
        plain.getresponse().read()

    def with_sendmsg(pieces: list[bytes]) -> None:
        scatter.putrequest("POST", "/v1/spans", skip_accept_encoding=True)
        scatter.putheader("Content-Type", "application/json")
        scatter.putheader("Content-Length", str(sum(map(len, pieces))))
        scatter.endheaders()
        assert scatter.sock is not None
        sendmsg_all(scatter.sock, pieces)
        scatter.getresponse().read()

    return {"httpx": with_httpx, "httpx chunks": with_httpx_chunks, "http.client": with_http_client, "sendmsg": with_sendmsg}


def join_in_chunks(pieces: list[bytes], chunk: int = 512 * 1024) -> list[bytes]:
    out, run, size = [], [], 0
    for piece in pieces:
        run.append(piece)
        size += len(piece)
        if size >= chunk:
            out.append(b"".join(run))
            run, size = [], 0
    if run:
        out.append(b"".join(run))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--spans", type=int, default=2000, help="calls traced per path and round")
    args = parser.parse_args()
    traced = traced_sender()
    bodies = keep_body_pieces()
    sender, trace = traced.sender, traced.trace

    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)])
    try:
        deadline = time.monotonic() + 10  # a connect, not an HTTP probe: no client made here before the runs
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        post = posters(port)
        cpu: dict[str, list[float]] = {name: [] for name in post}
        faults: dict[str, list[float]] = {name: [] for name in post}
        for r in range(args.rounds + 1):  # round 0 warms every path up, unrecorded
            for name in (list(post) if r % 2 == 0 else list(post)[::-1]):
                trace(args.spans)
                spans = len(sender.queue)
                f0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
                while sender.queue:
                    sender._build_body()
                    post[name](bodies.pop())
                sender.opens.clear()
                if r:
                    cpu[name].append((time.thread_time() - t0) * 1e6 / spans)
                    faults[name].append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / spans)
    finally:
        sink.kill()
        shutdown()
    print(f"{args.rounds} rounds (ABAB), {args.spans} calls a path and round; build + post on this thread")
    print(f"{'path':12s} {'µs a span':>10s} {'faults a span':>14s}  against httpx (spread)")
    for name in post:
        ratios = sorted(c / h for c, h in zip(cpu[name], cpu["httpx"]))
        print(f"{name:12s} {statistics.median(cpu[name]):10.1f} {statistics.median(faults[name]):14.2f}  "
              f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
