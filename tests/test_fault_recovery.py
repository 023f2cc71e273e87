"""Recovery and batch bounds (issue 11, items 3, 12, 14).

* Too many spans in one request is a size bound: 413, and the real client splits the batch.
* A full spool with the backend down: the forwarder probes it (one-span batches every
  TRACECAR_FORWARD_PROBE_S) instead of waiting out its backoff, and resumes within seconds.
* A client backing off from a down collector (TRACECAR_RETRY_PROBE_S) resumes within about a
  second of its return, however long its backoff had grown.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.collector.exporters.weave_sink import WeaveSink

pytestmark = pytest.mark.timeout(120)
MiB = 2**20


@rollout_trace_op
def traced_tool(i: int, blob: str) -> int:
    return i + 1


def test_too_many_spans_is_413_and_the_real_client_splits_without_losing_any(start_collector, tracer_to, kit):
    col = start_collector(max_batch_spans=50)
    r = kit.post(col.url, [s for _ in range(13) for s in kit.trajectory(children=3)])  # 52 spans
    assert r.status_code == 413, r.text
    assert r.json()["error"]["field"] == "spans" and "TRACECAR_MAX_BATCH_SPANS=50" in r.json()["error"]["reason"]

    tracer = tracer_to(col.url, batch_max_spans=400, queue_max_spans=4000, batch_max_bytes=64 * MiB)
    emitted = 0
    for step in range(3):
        with rollout_trace_attr(sample_index=step, step=1, rollout_n=0):
            for i in range(299):
                assert traced_tool(i, "x") == i + 1
        emitted += 300
    assert tracer.flush(60), tracer.stats()
    stats = tracer.stats()
    stored = col.collector.spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"]
    refused = kit.metrics(col.url, "tracecar_batches_rejected_total", reason="spans")
    print(f"\nbatch bound: emitted={emitted} sent={stats['sent']} stored={stored} 413s={int(refused)} dropped={stats['dropped']}")
    assert refused >= 2  # the raw post and at least the client's first batch
    assert stats["sent"] == emitted == stored and stats["dropped_total"] == 0


def test_a_full_spool_probes_the_returning_backend_and_resumes_within_seconds(start_collector, faulty_weave_stub, kit):
    stub = faulty_weave_stub
    stub.outage = 503
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=stub.url)
    # a backoff that would wait 10-30 s per attempt without the probe
    col = start_collector(sink=sink, backend="weave", spool_max_bytes=MiB, retry_after_s=1,
                          forward_retry_initial_s=20, forward_retry_max_s=30, forward_probe_s=0.5)
    acked = 0
    with httpx.Client() as client:
        for _ in range(100):
            r = kit.post(col.url, kit.trajectory(children=4, payload_bytes=20_000), client=client)
            if r.status_code == 503:
                break
            assert r.status_code == 200, r.text
            acked += r.json()["accepted"]
    assert r.status_code == 503 and "TRACECAR_SPOOL_MAX_BYTES" in r.json()["error"]["reason"]
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_forward_probes_total") >= 2, 10)

    stub.outage = None  # Weave is back
    back = time.monotonic()
    assert kit.wait_for(lambda: len(stub.delivered()) > 0, 10)
    resumed_s = time.monotonic() - back
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spool_depth") == 0, 30)
    drained_s = time.monotonic() - back
    r = kit.post(col.url, kit.trajectory(children=4))
    print(f"\nrecovery: acked={acked} probes={int(kit.metrics(col.url, 'tracecar_forward_probes_total'))} "
          f"first_delivery_after={resumed_s:.2f}s drained_after={drained_s:.2f}s")
    assert resumed_s < 2.0
    assert r.status_code == 200  # ingest takes spans again
    assert kit.wait_for(lambda: len(set(stub.delivered())) == acked + 5, 20)
    assert len(stub.delivered()) == len(set(stub.delivered()))  # nothing forwarded twice


def test_a_client_backing_off_from_a_down_collector_resumes_within_a_second_of_its_return(start_collector, tracer_to, kit):
    port = kit.free_port()
    url = f"http://127.0.0.1:{port}"
    # without the probe this backoff would reach 10-30 s between attempts
    tracer = tracer_to(url, retry_initial_s=10, retry_max_s=30, retry_max_elapsed_s=120, retry_probe_s=0.5)
    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
        for i in range(99):
            traced_tool(i, "y")
    assert kit.wait_for(lambda: tracer.stats()["retries"] >= 3, 10)  # refused, again and again, every ~0.5 s
    col = start_collector(port=port)
    back = time.monotonic()
    assert kit.wait_for(lambda: tracer.stats()["sent"] == 100, 10), tracer.stats()
    resumed_s = time.monotonic() - back
    print(f"\nclient recovery: sent after {resumed_s:.2f}s, retries={tracer.stats()['retries']}")
    assert resumed_s < 1.5
    assert col.collector.spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"] == 100
    assert tracer.stats()["dropped_total"] == 0
