"""Memory bound under concurrent large uploads (issue 11, item 4).

TRACECAR_MAX_INFLIGHT_REQUESTS slots are taken before a body is read: a request without one is
answered 503 + Retry-After while uvicorn holds no more than its flow-control window of the body.
64 clients upload 16 MiB bodies at once to a `tracecar serve` process; its RSS (psutil, sampled
every 20 ms) stays within the README's bound, every request is answered 200 or 503, and every
acknowledged span is in the store.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import psutil
import pytest

pytestmark = pytest.mark.timeout(300)
MiB = 2**20
CLIENTS, BODY_MIB, INFLIGHT, DECODE_THREADS = 64, 16, 16, 2


def documented_bound_mib(inflight: int, body_mib: float, decode_threads: int) -> float:
    """The README's bound on RSS above the idle process: every slot holds its body, and each
    decode thread adds at most four more copies of one (parsed, packed, rows awaiting the writer)."""
    return inflight * body_mib + decode_threads * 4 * body_mib


def _body(kit) -> bytes:
    spans = []
    for _ in range(4):  # 4 trajectories x (7 children of ~585 KiB + a root) = 16 MiB
        spans.extend(kit.trajectory(children=7, payload_bytes=BODY_MIB * MiB // 28 - 400))  # the root carries none
    body = orjson.dumps({"v": 1, "worker": "w-mem", "project": None, "entity": None, "tokenizer": None, "spans": spans})
    assert abs(len(body) - BODY_MIB * MiB) < MiB
    return body


def test_64_concurrent_16_mib_uploads_stay_within_the_documented_memory_bound(collector_process, kit):
    pc = collector_process(TRACECAR_MAX_INFLIGHT_REQUESTS=INFLIGHT, TRACECAR_DECODE_THREADS=DECODE_THREADS,
                           TRACECAR_MAX_BODY_BYTES=20 * MiB, TRACECAR_RETRY_AFTER_S=1).start()
    proc = psutil.Process(pc.proc.pid)
    # warm up the code paths once, then take the baseline
    assert kit.post(pc.url, kit.trajectory(children=3, payload_bytes=100_000)).status_code == 200
    time.sleep(0.5)
    start_rss = proc.memory_info().rss
    peak = [start_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    body = _body(kit)
    statuses: list[int] = []
    accepted: list[int] = []
    lock = threading.Lock()
    gate = threading.Barrier(CLIENTS)

    def upload() -> None:
        with httpx.Client(timeout=120) as client:
            gate.wait(30)
            try:
                r = client.post(pc.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"})
                status, n = r.status_code, (r.json().get("accepted", 0) if r.status_code == 200 else 0)
                if status == 503:
                    assert r.headers["Retry-After"] == "1"
            except httpx.HTTPError as exc:
                status, n = -1, 0
                print("upload error:", type(exc).__name__, exc)
        with lock:
            statuses.append(status)
            accepted.append(n)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    threads = [threading.Thread(target=upload) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    took = time.monotonic() - started
    stop.set()
    sampler.join(5)
    added_mib = (peak[0] - start_rss) / MiB
    bound = documented_bound_mib(INFLIGHT, BODY_MIB, DECODE_THREADS)
    stored = httpx.get(pc.url + "/v1/trajectories", params={"limit": 1000}).json()["total"]
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"\nmemory: {CLIENTS} clients x {BODY_MIB} MiB in {took:.1f}s statuses={counts} start_rss={start_rss / MiB:.0f} MiB "
          f"peak_rss={peak[0] / MiB:.0f} MiB added={added_mib:.0f} MiB bound={bound:.0f} MiB "
          f"(before this fix the red team measured +1,287 MiB) stored_trajectories={stored}")
    assert len(statuses) == CLIENTS and set(statuses) <= {200, 503}, counts
    assert counts.get(200, 0) >= 1 and counts.get(503, 0) >= 1
    assert added_mib <= bound
    assert stored == 1 + 4 and sum(accepted) == 32  # one body, posted by all: later ones are duplicates
    assert took < 240


# ---- memory bounded before parsing (issue 28, item 5) -----------------------------------------
# A small compressed body can hold millions of tiny spans (or containers) that cost tens of bytes
# each once parsed, and a few bytes of prompt reference can rebuild a context of a million ids:
# the bounds must refuse them before the memory is spent, not count after a full parse.
SMALL_BODY_MIB, SMALL_DECOMPRESSED_MIB, SMALL_INFLIGHT = 4, 16, 4
SMALL = {"TRACECAR_MAX_BODY_BYTES": SMALL_BODY_MIB * MiB, "TRACECAR_MAX_DECOMPRESSED_BYTES": SMALL_DECOMPRESSED_MIB * MiB,
         "TRACECAR_MAX_INFLIGHT_REQUESTS": SMALL_INFLIGHT, "TRACECAR_DECODE_THREADS": DECODE_THREADS,
         "TRACECAR_RETRY_AFTER_S": 1}
SMALL_BOUND_MIB = documented_bound_mib(SMALL_INFLIGHT, SMALL_DECOMPRESSED_MIB, DECODE_THREADS)  # 192 MiB


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _otlp_empty_spans(n: int) -> bytes:
    """An ExportTraceServiceRequest of ``n`` empty spans (2 bytes each on the wire)."""
    return _field(1, _field(2, b"\x12\x00" * n))


def _hostile_body(kind: str) -> tuple[str, bytes, str]:
    """(path, gzip body, content type) of a small body that parses into a huge object."""
    import gzip

    import msgpack

    if kind == "otlp_protobuf":  # the red team's: 380k minimal spans in ~45 KiB of gzip
        return "/v1/traces", gzip.compress(_otlp_empty_spans(380_000)), "application/x-protobuf"
    if kind == "otlp_json":
        spans = b"[" + b",".join([b"{}"] * 2_000_000) + b"]"
        return "/v1/traces", gzip.compress(b'{"resourceSpans":[{"scopeSpans":[{"spans":' + spans + b"}]}]}"), "application/json"
    if kind == "json":  # 14 KiB of gzip: {} x 5M on /v1/spans
        return "/v1/spans", gzip.compress(b'{"v":1,"worker":"w","spans":[' + b",".join([b"{}"] * 5_000_000) + b"]}"), "application/json"
    assert kind == "msgpack"  # one byte per empty map
    return "/v1/spans", gzip.compress(msgpack.packb({"v": 1, "worker": "w", "spans": [{}] * 12_000_000})), "application/msgpack"


class PeakRss:
    """Samples a process's RSS every 20 ms; ``added_mib`` is the peak above the start."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / MiB


def _post_concurrently(url: str, n: int, path: str, body: bytes, content_type: str) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    gate = threading.Barrier(n)

    def post() -> None:
        with httpx.Client(timeout=120) as client:
            gate.wait(30)
            r = client.post(url + path, content=body, headers={"Content-Type": content_type, "Content-Encoding": "gzip"})
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=post) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


@pytest.mark.parametrize("kind", ["otlp_protobuf", "otlp_json", "json", "msgpack"])
def test_compressed_bodies_of_many_tiny_spans_are_refused_before_they_are_parsed(collector_process, kit, kind):
    pc = collector_process(**SMALL).start()
    assert kit.post(pc.url, kit.trajectory(children=3, payload_bytes=100_000)).status_code == 200  # warm up
    time.sleep(0.5)
    path, body, content_type = _hostile_body(kind)
    assert len(body) <= SMALL_BODY_MIB * MiB
    started = time.monotonic()
    with PeakRss(pc.proc.pid) as rss:
        answers = _post_concurrently(pc.url, SMALL_INFLIGHT, path, body, content_type)
    took = time.monotonic() - started
    statuses = sorted(r.status_code for r in answers)
    cpu_s = sum(psutil.Process(pc.proc.pid).cpu_times()[:2])
    print(f"\n{kind}: {len(body) / 1024:.0f} KiB gzip x {SMALL_INFLIGHT} -> {statuses} in {took:.2f}s, "
          f"+{rss.added_mib:.0f} MiB peak RSS (bound {SMALL_BOUND_MIB:.0f} MiB), collector CPU so far {cpu_s:.1f}s; "
          f"answer: {answers[0].text[:160]!r}")
    assert set(statuses) <= {413, 503} and 413 in statuses, statuses
    refusal = next(r for r in answers if r.status_code == 413).text
    assert ("TRACECAR_MAX_BATCH_SPANS" in refusal) if kind == "otlp_protobuf" else ("objects and arrays" in refusal)
    assert rss.added_mib <= SMALL_BOUND_MIB
    assert kit.post(pc.url, kit.trajectory(children=1)).status_code == 200  # and it keeps serving


def test_prompt_references_cannot_rebuild_more_than_a_body_per_request(collector_process, kit):
    """Four 1-2 KB v2 bodies whose references rebuild a 1M-id context (before: +202 MiB against a
    96 MiB bound): a batch's references rebuild at most TRACECAR_MAX_DECOMPRESSED_BYTES / 16 ids,
    the spans past that are refused as unresolved (their clients resend them whole)."""
    import gzip

    pc = collector_process(**SMALL).start()
    root = kit.new_id()
    ids = list(range(100_000, 1_100_000))
    base = {"span_id": kit.new_id(), "trace_id": root, "parent_id": root, "name": "generate", "kind": "op",
            "start_time": time.time(), "end_time": time.time() + 1, "attributes": {}, "inputs": {"prompt_ids": ids},
            "output": {}, "exception": None}
    body, headers = kit.encode([base], v=2)
    r = httpx.post(pc.url + "/v1/spans", content=gzip.compress(body), headers={**headers, "Content-Encoding": "gzip"}, timeout=60)
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    time.sleep(1.0)
    refs = [{**base, "span_id": kit.new_id(), "inputs": {"prompt_ids": {"$ref": base["span_id"], "n": len(ids), "add": []}}}
            for _ in range(12)]
    small, headers = kit.encode(refs, v=2)
    assert len(small) < 8192
    with PeakRss(pc.proc.pid) as rss:
        answers = _post_concurrently(pc.url, SMALL_INFLIGHT, "/v1/spans", gzip.compress(small), headers["Content-Type"])
    payloads = [a.json() for a in answers]
    print(f"\nreferences: {len(small)} B x {SMALL_INFLIGHT} rebuilding {len(ids):,} ids each x 12 -> "
          f"accepted {[p.get('accepted') for p in payloads]}, +{rss.added_mib:.0f} MiB peak RSS "
          f"(bound {SMALL_BOUND_MIB:.0f} MiB); {payloads[0]['rejected'][0]['reason'][:120]!r}")
    assert all(a.status_code == 200 for a in answers)
    assert sum(p["accepted"] for p in payloads) == 1 and sum(p["duplicates"] for p in payloads) == 3  # one body's first span
    assert all(p["rejected_count"] == 11 for p in payloads)
    assert all("rebuild more than 1048576 ids" in r["reason"] for p in payloads for r in p["rejected"])
    assert rss.added_mib <= SMALL_BOUND_MIB
