"""Guarantee 4: the collector being down, slow or resetting never slows the traced function.

The test process is the rollout worker: it runs the same function untraced and traced, with
the collector (a) refusing connections, (b) answering only after 10 s, (c) resetting every
connection. Speed is judged by counts, not thresholds: every traced call returned while the
slow collector had answered nothing; no call took as long as one HTTP timeout; and traced vs
untraced time of the same work, interleaved, with a generous ratio. Then the client
reconnects when a collector comes back, and a worker process that traces and exits flushes
within TRACECAR_SHUTDOWN_TIMEOUT_S and never hangs.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client import tracer as tracer_module

pytestmark = pytest.mark.timeout(120)

HTTP_TIMEOUT_S = 2.0


class SlowCollector:
    """Accepts ingest requests and answers each only after ``delay_s`` (10 s)."""

    def __init__(self, delay_s: float = 10.0) -> None:
        self.received = 0
        self.answered = 0
        self.release = threading.Event()
        slow = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                slow.received += 1
                slow.release.wait(delay_s)
                body = b'{"accepted": 0, "rejected_count": 0}'
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    slow.answered += 1
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class ResettingCollector:
    """Accepts every connection and resets it at once (RST, via SO_LINGER 0)."""

    def __init__(self, port: int = 0) -> None:
        self.connections = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def fault_target(request: pytest.FixtureRequest, kit: Any) -> Iterator[tuple[str, Any]]:
    mode = request.param
    if mode == "down":
        yield f"http://127.0.0.1:{kit.free_port()}", None  # nothing listens: connection refused
    elif mode == "slow":
        slow = SlowCollector(10.0)
        yield slow.url, slow
        slow.close()
    else:
        rst = ResettingCollector()
        yield rst.url, rst
        rst.close()


def work(n: int) -> int:
    """Fixed CPU work, like a small tool call."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


@rollout_trace_op
def traced_tool(n: int, prompt_ids: list[int]) -> int:
    return work(n)


def untraced_tool(n: int, prompt_ids: list[int]) -> int:
    return work(n)


@pytest.mark.parametrize("fault_target", ["down", "slow", "reset"], indirect=True)
def test_traced_function_keeps_its_speed_when_the_collector_misbehaves(fault_target, tracer_to):
    url, server = fault_target
    tracer = tracer_to(url, http_timeout_s=HTTP_TIMEOUT_S, retry_initial_s=0.05, retry_max_s=0.5,
                       queue_max_spans=5000, shutdown_timeout_s=1)
    prompt = list(range(64))
    rounds, per_round, n = 10, 40, 3000
    untraced_s = traced_s = 0.0
    slowest_call = 0.0
    results: list[int] = []
    expected = work(n)
    for r in range(rounds):  # interleaved, so background load hits both the same way
        t0 = time.perf_counter()
        for _ in range(per_round):
            assert untraced_tool(n, prompt) == expected
        untraced_s += time.perf_counter() - t0
        with rollout_trace_attr(sample_index=r, step=1, rollout_n=0):
            t0 = time.perf_counter()
            for _ in range(per_round):
                c0 = time.perf_counter()
                results.append(traced_tool(n, prompt))
                slowest_call = max(slowest_call, time.perf_counter() - c0)
            traced_s += time.perf_counter() - t0
        if r == 0:  # the sender is now blocked on / fighting the collector
            if server is None:
                assert _wait(lambda: tracer.stats()["retries"] >= 1, 10)  # refused at least once
            else:
                assert _wait(lambda: (server.received if hasattr(server, "received") else server.connections) >= 1, 10)
    calls = rounds * per_round
    answered_when_done = getattr(server, "answered", 0)
    stats = tracer.stats()
    ratio = traced_s / untraced_s
    print(f"\n{_mode(server)}: calls={calls} correct={results.count(expected)} untraced={untraced_s:.3f}s "
          f"traced={traced_s:.3f}s ratio={ratio:.2f} slowest_call={slowest_call * 1000:.1f}ms "
          f"collector_answered_before_done={answered_when_done} sender_sent={stats['sent']} retries={stats['retries']} "
          f"dropped={stats['dropped_total']}")
    assert results == [expected] * calls
    assert slowest_call < HTTP_TIMEOUT_S  # no call ever waited on the network
    assert ratio < 3.0  # generous: tracing costs microseconds a call, the work costs ~0.3 ms
    assert stats["sent"] == 0
    if isinstance(server, SlowCollector):
        assert server.received >= 1 and answered_when_done == 0  # all returned before it answered once
    if isinstance(server, ResettingCollector):
        assert server.connections >= 1 and stats["retries"] >= 1
    # a bounded shutdown counts what it could not deliver: every span is accounted for
    assert tracer_module.shutdown(0.5) is False
    final = tracer.stats()
    assert final["sent"] == 0 and final["dropped"] == {"shutdown_timeout": calls + rounds}


def _mode(server: Any) -> str:
    return {SlowCollector: "slow", ResettingCollector: "reset"}.get(type(server), "down")


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def test_client_reconnects_when_the_collector_comes_back(start_collector, tracer_to, kit):
    port = kit.free_port()
    url = f"http://127.0.0.1:{port}"
    tracer = tracer_to(url, http_timeout_s=HTTP_TIMEOUT_S, retry_initial_s=0.05, retry_max_s=0.2, retry_max_elapsed_s=60)

    emitted = 0
    def burst(step: int) -> None:
        nonlocal emitted
        with rollout_trace_attr(sample_index=0, step=step, rollout_n=0):
            for _ in range(24):
                traced_tool(10, [1, 2, 3])
        emitted += 25

    burst(1)  # collector down: refused
    assert kit.wait_for(lambda: tracer.stats()["retries"] >= 2, 10)
    rst = ResettingCollector(port)  # collector resets connections
    try:
        burst(2)
        assert kit.wait_for(lambda: rst.connections >= 2, 10)
    finally:
        rst.close()
    col = start_collector(port=port)  # the collector comes back on the same address
    burst(3)
    assert tracer.flush(20), tracer.stats()
    stats = tracer.stats()
    stored = col.collector.spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"]
    print(f"\nreconnect: emitted={emitted} sent={stats['sent']} stored={stored} retries={stats['retries']} "
          f"resets_seen={rst.connections} dropped={stats['dropped_total']}")
    assert stats["sent"] == emitted == stored and stats["dropped_total"] == 0


WORKER = textwrap.dedent("""
    import atexit, json, sys, time
    marks = {}
    # registered before tracecar's own atexit hook, so it runs after it (atexit is LIFO)
    atexit.register(lambda: print(json.dumps({**marks, "exit_flush_s": time.monotonic() - marks["done"],
                                               "stats": tracer.get_tracer().stats()}), flush=True))
    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

    @rollout_trace_op
    def tool(i):
        return i + 1

    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
        out = [tool(i) for i in range(99)]
    assert out == list(range(1, 100))
    marks["done"] = time.monotonic()
""")


def _run_worker(url: str, shutdown_timeout_s: float) -> tuple[dict[str, Any], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACECAR_")}
    env.update(TRACECAR_URL=url, TRACECAR_SHUTDOWN_TIMEOUT_S=str(shutdown_timeout_s), TRACECAR_HTTP_TIMEOUT_S="5",
               TRACECAR_RETRY_INITIAL_S="0.05", TRACECAR_FLUSH_INTERVAL_S="0.02")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def test_worker_exit_flushes_what_it_can_and_never_hangs(start_collector, kit):
    col = start_collector()
    up, _ = _run_worker(col.url, 5.0)  # collector up: exit flushes everything
    stored = col.collector.spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"]
    assert up["stats"]["sent"] == 100 == stored and up["stats"]["dropped_total"] == 0

    slow = SlowCollector(10.0)
    try:
        stuck, stuck_wall = _run_worker(slow.url, 1.5)  # collector slow: exit gives up after the timeout
        answered_at_exit = slow.answered
    finally:
        slow.close()
    down, down_wall = _run_worker(f"http://127.0.0.1:{kit.free_port()}", 1.5)  # collector down

    print(f"\nworker exit: up sent={up['stats']['sent']} stored={stored} exit_flush={up['exit_flush_s']:.2f}s; "
          f"slow exit_flush={stuck['exit_flush_s']:.2f}s wall={stuck_wall:.1f}s answered_before_exit={answered_at_exit} "
          f"dropped={stuck['stats']['dropped']}; down exit_flush={down['exit_flush_s']:.2f}s wall={down_wall:.1f}s "
          f"dropped={down['stats']['dropped']}")
    for result in (stuck, down):
        # it waited its full shutdown timeout (a sleep only runs long), then counted what was left
        assert result["exit_flush_s"] >= 1.5
        assert result["stats"]["sent"] == 0 and result["stats"]["dropped_total"] == 100
        assert set(result["stats"]["dropped"]) == {"shutdown_timeout"}
    assert answered_at_exit == 0  # it exited before the slow collector answered anything: no hang on it
    assert stuck["exit_flush_s"] < 10.0
