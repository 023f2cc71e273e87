"""Guarantee 5: SIGTERM turns the collector unready, stops intake, drains for at most
TRACECAR_SHUTDOWN_DRAIN_S and leaves the rest in the spool for the next start.

A real `tracecar serve` process forwards to a slow loopback Weave stub (each calls/complete
takes 0.25 s, 10 spans a batch), so a full drain would take far longer than the 1.5 s allowed.
While it shuts down a poller keeps asking /readyz and posting spans.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

DRAIN_S = 1.5


def test_sigterm_unready_first_bounded_drain_rest_kept_for_next_start(faulty_weave_stub, weave_collector_process, kit):
    stub = faulty_weave_stub
    pc = weave_collector_process(stub.url, TRACECAR_SHUTDOWN_DRAIN_S=DRAIN_S, TRACECAR_FORWARD_BATCH_SPANS=10).start()
    stub.outage = 503  # hold everything in the spool while we load it
    acked: set[str] = set()
    with httpx.Client() as client:
        for i in range(40):
            batch = kit.trajectory(children=4, sample_index=i)
            assert kit.post(pc.url, batch, client=client).status_code == 200
            acked.update(s["span_id"] for s in batch)
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_forward_failures_total") >= 1, 20)

    observations: list[tuple[float, str, int | None]] = []  # (time, "ready" | "ingest", status or None = refused)
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=2) as client:
            while not stop.is_set():
                for kind in ("ready", "ingest"):
                    started = time.monotonic()
                    batch = kit.trajectory(children=1)
                    try:
                        if kind == "ready":
                            status: int | None = client.get(pc.url + "/readyz").status_code
                        else:
                            status = kit.post(pc.url, batch, client=client).status_code
                    except httpx.HTTPError:
                        status = None
                    if kind == "ingest" and status == 200:
                        acked.update(s["span_id"] for s in batch)
                    observations.append((started, kind, status))
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.2)
    stub.outage, stub.delay_s = None, 0.25  # Weave is back, but slow: draining takes time
    delivered_before = len(stub.delivered())
    assert pc.proc is not None
    sigterm_at = time.monotonic()
    pc.proc.send_signal(signal.SIGTERM)
    rc = pc.proc.wait(timeout=60)
    exit_s = time.monotonic() - sigterm_at
    stop.set()
    poller.join(10)
    delivered_at_exit = set(stub.delivered())

    log = [json.loads(line) for line in pc.log_text().splitlines() if line.startswith("{")]
    events = [e.get("event") or e.get("msg") for e in log]
    drained = next(e for e in log if e.get("event") == "drained")
    after = [o for o in observations if o[0] >= sigterm_at]
    ready_after = [s for _, k, s in after if k == "ready"]
    first_unready = next((t for t, k, s in observations if k == "ready" and s != 200 and t >= sigterm_at), None)
    acked_after_unready = [s for t, k, s in observations if k == "ingest" and s == 200 and first_unready is not None and t >= first_unready]
    refused_ingest = sum(1 for _, k, s in after if k == "ingest" and s is None)
    print(f"\nsigterm: acked={len(acked)} forwarded_before_sigterm={delivered_before} forwarded_by_exit={len(delivered_at_exit)} "
          f"left_in_spool={drained['left_in_spool']} drain_s={drained['drain_s']} exit_s={exit_s:.2f} rc={rc} "
          f"readyz_after_sigterm={ {s: ready_after.count(s) for s in set(ready_after)} } "
          f"ingest_after_sigterm_refused={refused_ingest} acked_after_unready={len(acked_after_unready)}")

    assert rc in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    # Unready first: the marker precedes uvicorn's own shutdown and the drain; readiness never comes back.
    assert events.index("shutdown") < events.index("Shutting down") < events.index("drained")
    statuses = [s for _, k, s in sorted(observations) if k == "ready"]
    first_bad = next(i for i, s in enumerate(statuses) if s != 200)
    assert all(s != 200 for s in statuses[first_bad:])
    assert acked_after_unready == []  # once unready, nothing more is acknowledged
    assert refused_ingest >= 1  # intake stopped while it drained
    # Bounded drain: some forwarded, the rest left on disk, never past the deadline (a batch's grace at most).
    assert 0 < drained["drain_s"] <= DRAIN_S + 0.5
    assert 0 < len(delivered_at_exit) < len(acked)
    assert drained["left_in_spool"] == len(acked) - len(delivered_at_exit)

    # Next start: the rest goes out, each span once.
    stub.delay_s = 0.0
    pc.start()
    start_log = [json.loads(line) for line in pc.logs[-1].read_text().splitlines() if line.startswith("{")]
    assert next(e for e in start_log if e.get("event") == "startup")["spool_depth_at_start"] == drained["left_in_spool"]
    assert kit.wait_for(lambda: set(stub.delivered()) >= acked, 30)
    delivered = stub.delivered()
    print(f"after restart: forwarded={len(set(delivered))} deliveries={len(delivered)} lost={len(acked - set(delivered))}")
    assert len(delivered) == len(set(delivered)) == len(acked)


def test_sigterm_with_a_hung_backend_still_exits_within_the_drain_budget(faulty_weave_stub, weave_collector_process, kit):
    """A forward stuck on a backend that never answers is cut at the deadline; its batch is kept."""
    stub = faulty_weave_stub
    pc = weave_collector_process(stub.url, TRACECAR_SHUTDOWN_DRAIN_S=DRAIN_S).start()
    stub.hold.set()  # the first calls/complete is read and never answered (the sink waits 30 s)
    batches = [kit.trajectory(children=4, sample_index=i) for i in range(4)]
    for batch in batches:
        assert kit.post(pc.url, batch).status_code == 200
    assert stub.held.wait(30)
    assert pc.proc is not None
    sigterm_at = time.monotonic()
    pc.proc.send_signal(signal.SIGTERM)
    rc = pc.proc.wait(timeout=60)
    exit_s = time.monotonic() - sigterm_at
    log = [json.loads(line) for line in pc.log_text().splitlines() if line.startswith("{")]
    drained = next(e for e in log if e.get("event") == "drained")
    stub.release.set()
    print(f"\nhung backend: exit_s={exit_s:.2f} drain_s={drained['drain_s']} left_in_spool={drained['left_in_spool']} "
          f"forwarded_by_exit={len(stub.delivered())}")
    assert rc in (0, -signal.SIGTERM)
    assert exit_s < DRAIN_S + 5  # not the sink's 30 s timeout
    assert drained["drain_s"] <= DRAIN_S + 0.5 and drained["left_in_spool"] == 20 and stub.delivered() == []
    pc.start()  # the cut-off batch went out on the next start, once
    acked = {s["span_id"] for b in batches for s in b}
    assert kit.wait_for(lambda: set(stub.delivered()) >= acked, 30)
    assert len(stub.delivered()) == len(acked)


def test_unready_is_set_before_the_server_stops(start_collector):
    """In-process, deterministic: the SIGTERM handler flips readiness before uvicorn acts."""
    col = start_collector()
    assert httpx.get(col.url + "/readyz").status_code == 200
    col.server.handle_exit(signal.SIGTERM, None)
    assert col.collector.ready is False
    assert col.collector.metrics.ready._value.get() == 0
    col.thread.join(30)
    assert not col.thread.is_alive()


def test_unready_window_keeps_serving_503_before_the_listener_closes(start_collector):
    """TRACECAR_SHUTDOWN_UNREADY_S: after SIGTERM the collector still answers, unready, then stops."""
    col = start_collector(shutdown_unready_s=1.5)
    col.server.handle_exit(signal.SIGTERM, None)
    ready = httpx.get(col.url + "/readyz")  # the listener is still open: readiness is observable
    assert ready.status_code == 503 and ready.json()["ready"] is False
    ingest = httpx.post(col.url + "/v1/spans", json={"worker": "w", "spans": []})
    assert ingest.status_code == 503 and ingest.headers["Retry-After"]
    assert col.thread.is_alive()
    col.thread.join(30)
    assert not col.thread.is_alive()
