"""client/sender.py: the bounded queue and the batching, retry, split and drop rules, against a scripted loopback server."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tracecar.client.config import ClientConfig
from tracecar.client.sender import Sender
from tracecar.client.spans import SpanRecord

pytestmark = pytest.mark.timeout(60)


class Collector:
    """Answers /v1/spans from a script of (status, headers) (then 200), recording each batch."""

    def __init__(self) -> None:
        self.script: deque[tuple[int, dict[str, str]]] = deque()
        self.batches: list[dict[str, Any]] = []
        self.statuses: list[int] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                status, headers = collector.script.popleft() if collector.script else (200, {})
                collector.statuses.append(status)
                if status == 200:
                    collector.batches.append(json.loads(raw))
                body = b'{"accepted": 1, "rejected_count": 0}' if status == 200 else b"{}"
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def sent_names(self) -> list[str]:
        return [s["name"] for b in self.batches for s in b["spans"]]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.shutdown()
    c.server.server_close()


def record(name: str, payload: str = "") -> SpanRecord:
    r = SpanRecord(name, "op", 1.0, None, {"step": 1}, kwargs={"text": payload} if payload else None)
    r.end = 2.0
    return r


def sender(url: str, **config: Any) -> Sender:
    config.setdefault("flush_interval_s", 0.01)
    config.setdefault("retry_initial_s", 0.01)
    return Sender(ClientConfig(url=url, worker_id="w-unit", **config))


def test_spans_go_out_in_order_in_batches_no_larger_than_the_bound(collector: Collector) -> None:
    s = sender(collector.url, batch_max_spans=3)
    for i in range(7):
        s.enqueue(record(f"op{i}"))
    assert s.shutdown(10)
    assert collector.sent_names() == [f"op{i}" for i in range(7)]
    assert max(len(b["spans"]) for b in collector.batches) <= 3 and collector.batches[0]["worker"] == "w-unit"
    assert s.stats.as_dict()["sent"] == 7 and s.stats.as_dict()["dropped_total"] == 0


def test_after_a_post_only_whole_bodies_go_on_and_the_rest_waits_for_the_interval_or_a_flush(collector: Collector) -> None:
    # a post costs the worker ~300 µs of CPU whatever its size: the sender must not post a few
    # spans at a time just because they arrived while the previous post was in flight
    s = sender(collector.url, batch_max_spans=3, flush_interval_s=30)  # the timer never fires here
    for i in range(7):
        s.enqueue(record(f"op{i}"))  # the third wakes the sender
    deadline = time.monotonic() + 10
    while len(collector.batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a sender that posted the leftover span at once would have done so by now
    assert [len(b["spans"]) for b in collector.batches] == [3, 3]
    assert s.flush(10)  # a flush sends what is left, whole body or not
    assert collector.sent_names() == [f"op{i}" for i in range(7)]
    assert [len(b["spans"]) for b in collector.batches] == [3, 3, 1]
    assert s.shutdown(10) and s.stats.as_dict()["sent"] == 7


def test_the_wake_up_length_follows_the_bytes_a_body_holds(collector: Collector) -> None:
    # 3 spans of ~4 KB fill a 12 KB body although batch_max_spans allows 100: after the first
    # body the caller wakes the sender at 3 queued spans, not at 100
    s = sender(collector.url, batch_max_spans=100, batch_max_bytes=12_000, flush_interval_s=30)
    s.enqueue(record("first", "x" * 4000))
    assert s.flush(10) and len(collector.batches) == 1
    assert s._body_spans == 3
    for i in range(3):
        s.enqueue(record(f"op{i}", "x" * 4000))
    deadline = time.monotonic() + 10
    while len(collector.batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [len(b["spans"]) for b in collector.batches] == [1, 3]
    assert s.shutdown(10) and s.stats.as_dict()["sent"] == 4


def test_a_full_queue_drops_and_counts_instead_of_blocking(collector: Collector) -> None:
    s = sender(collector.url, queue_max_spans=2, flush_interval_s=30)  # the thread sleeps: the queue fills
    for i in range(5):
        s.enqueue(record(f"op{i}"))
    assert s.stats.dropped == {"queue_full": 3}
    assert s.shutdown(10) and collector.sent_names() == ["op0", "op1"]


def test_transient_answers_are_retried_and_permanent_ones_dropped_by_status(collector: Collector) -> None:
    collector.script.extend([(503, {"Retry-After": "0"}), (429, {}), (200, {}), (400, {})])
    s = sender(collector.url, batch_max_spans=1)
    s.enqueue(record("kept"))
    assert s.flush(10)
    s.enqueue(record("refused"))
    assert s.shutdown(10)
    assert collector.statuses == [503, 429, 200, 400]
    assert collector.sent_names() == ["kept"]
    assert s.stats.retries == 2 and s.stats.dropped == {"http_400": 1} and s.stats.sent == 1


def test_a_413_splits_the_batch_and_later_batches_shrink(collector: Collector) -> None:
    collector.script.append((413, {}))
    s = sender(collector.url, batch_max_spans=4, flush_interval_s=30)
    for i in range(4):
        s.enqueue(record(f"op{i}"))
    assert s.shutdown(10)
    assert [len(b["spans"]) for b in collector.batches] == [2, 2] and collector.sent_names() == [f"op{i}" for i in range(4)]
    assert s.config.batch_max_spans == 2 and s.stats.dropped == {}


def test_a_span_over_max_span_bytes_is_dropped_alone(collector: Collector) -> None:
    s = sender(collector.url, max_span_bytes=2048, flush_interval_s=30)
    s.enqueue(record("small"))
    s.enqueue(record("huge", "x" * 10_000))
    s.enqueue(record("small too"))
    assert s.shutdown(10)
    assert collector.sent_names() == ["small", "small too"] and s.stats.dropped == {"span_too_large": 1}


def test_gzip_above_the_threshold_reaches_the_collector_intact(collector: Collector) -> None:
    s = sender(collector.url, compression="gzip", compress_min_bytes=1)
    s.enqueue(record("zipped", "y" * 5000))
    assert s.shutdown(10)
    assert collector.sent_names() == ["zipped"]


def test_retries_give_up_after_the_elapsed_bound_and_count_it(collector: Collector) -> None:
    collector.script.extend([(503, {})] * 1000)
    s = sender(collector.url, retry_max_elapsed_s=0.2, retry_max_s=0.05)
    s.enqueue(record("lost"))
    assert s.flush(10)
    assert s.stats.dropped == {"retries_exhausted": 1} and collector.batches == []
    s.shutdown(1)
