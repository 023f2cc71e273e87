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
