"""Guarantee 3: a full spool answers 503 + Retry-After, never grows past its bound, never a 500.

Two faults, both real: the configured bound (TRACECAR_SPOOL_MAX_BYTES) reached while Weave
is down, with the real client backing off behind it; and a real full disk, the data dir on a
2 MiB tmpfs mounted for the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.collector.exporters.weave_sink import WeaveSink, is_elided

pytestmark = pytest.mark.timeout(120)

MiB = 2**20


def test_spool_bound_answers_503_and_the_client_backs_off_with_a_bounded_queue(start_collector, faulty_weave_stub, tracer_to, kit):
    stub = faulty_weave_stub
    stub.outage = 503  # Weave is down: everything stays in the spool
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=stub.url)
    col = start_collector(sink=sink, backend="weave", spool_max_bytes=MiB, retry_after_s=1,
                          forward_retry_initial_s=0.05, forward_retry_max_s=0.2)

    # 1. Fill the spool with our own posts until the collector says 503.
    acked, refused, biggest_batch = 0, 0, 0
    with httpx.Client() as client:
        for _ in range(100):
            batch = kit.trajectory(children=4, payload_bytes=20_000)
            r = kit.post(col.url, batch, client=client)
            if r.status_code == 503:
                refused += 1
                assert r.headers["Retry-After"] == "1"
                assert "TRACECAR_SPOOL_MAX_BYTES" in r.json()["error"]["reason"]
                if refused == 3:
                    break
                continue
            assert r.status_code == 200, r.text
            acked += r.json()["accepted"]
            biggest_batch = max(biggest_batch, len(r.request.content))
    assert refused == 3
    pending = kit.metrics(col.url, "tracecar_spool_pending_bytes")
    assert MiB <= pending <= MiB + 2 * biggest_batch  # stops at the bound (one batch of overshoot at most)
    assert kit.metrics(col.url, "tracecar_backpressure_total", bound="spool_bytes") == refused

    # 2. The real client behind a full collector: it retries, honours Retry-After, bounds its queue.
    tracer = tracer_to(col.url, queue_max_spans=100, batch_max_spans=50, retry_initial_s=0.05, retry_max_s=2.0,
                       retry_max_elapsed_s=120, shutdown_timeout_s=1)

    @rollout_trace_op
    def tool_call(i: int, blob: str) -> int:
        return i * 2

    emitted = 300
    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="full-spool"):
        assert [tool_call(i, "y" * 2000) for i in range(emitted - 1)] == [i * 2 for i in range(emitted - 1)]
    def refusals_to_client() -> float:
        return kit.metrics(col.url, "tracecar_backpressure_total", bound="spool_bytes") - refused

    assert kit.wait_for(lambda: tracer.stats()["retries"] >= 1, 20)
    before, started = refusals_to_client(), time.monotonic()
    assert not tracer.flush(3.0)  # a worker waiting on flush() must not turn backoff into a busy loop
    flush_s, during_flush = time.monotonic() - started, refusals_to_client() - before
    assert during_flush <= flush_s / 1.0 + 1  # Retry-After: 1 honoured (sleeps only ever run long)
    # every client retry was a 503 from the bound, counted on both sides (polled: the two counters tick microseconds apart)
    assert kit.wait_for(lambda: refusals_to_client() == tracer.stats()["retries"], 5)
    during = tracer.stats()
    client_refusals = refusals_to_client()
    assert during["sent"] == 0 and during["retries"] >= 2
    assert during["queued"] <= 100  # its own bounded queue
    assert during["dropped"].get("queue_full", 0) >= emitted - 150  # queue (100) + the batch being retried (50)

    # 3. Weave recovers: the spool drains, the collector takes spans again, the client delivers.
    stub.outage = None
    assert tracer.flush(60), tracer.stats()
    after = tracer.stats()
    accepted = kit.metrics(col.url, "tracecar_spans_accepted_total")
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spool_depth") == 0, 30)
    delivered = stub.delivered()
    print(f"\nspool bound: acked_by_posts={acked} refused_posts={refused} client_emitted={emitted} "
          f"client_sent={after['sent']} client_dropped={after['dropped']} client_retries={after['retries']} "
          f"collector_503s_to_client={int(client_refusals)} 503s_during_a_{flush_s:.1f}s_flush={int(during_flush)} "
          f"accepted={int(accepted)} forwarded={len(delivered)} "
          f"duplicates={len(delivered) - len(set(delivered))}")
    assert after["sent"] + after["dropped_total"] == emitted and after["queued"] == 0
    assert set(after["dropped"]) == {"queue_full"}  # the only loss: its full queue, counted
    assert emitted - 150 <= after["dropped"]["queue_full"] < emitted  # it held at most queue + one batch
    assert accepted == acked + after["sent"]
    # every accepted span forwarded once — as a Weave call, except rollout_trace_attr's trajectory root, which
    # (as in VERL's own Weave backend) is none: whether the client's full queue let it through varies by run
    stored = [orjson.loads(r["payload"]) for r in col.collector.spool.query("SELECT payload FROM spans")]
    assert len(stored) == accepted
    calls = {span["span_id"] for span in stored if not is_elided(span)}
    assert len(delivered) == len(set(delivered)) and set(delivered) == calls, (len(delivered), len(calls))


# ---- a real full disk ----------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the test (skips where mounting is not permitted)."""
    mnt = tmp_path / "tiny-disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _stored(spool: Any, ids: list[str]) -> int:
    return spool.query(f"SELECT COUNT(*) AS n FROM spans WHERE span_id IN ({','.join('?' * len(ids))})", ids)[0]["n"]


def test_full_disk_answers_503_stores_nothing_partial_and_recovers(tiny_disk, start_collector, kit):
    ballast = tiny_disk / "ballast"
    ballast.write_bytes(b"\0" * (MiB // 2))  # freed later: "space returns"
    col = start_collector(data_dir=tiny_disk / "data")
    spool = col.collector.spool
    statuses: dict[int, int] = {}
    acked, refused_batch, first_trace = 0, None, None
    with httpx.Client() as client:
        for _ in range(200):
            batch = kit.trajectory(children=9, payload_bytes=8_000)
            r = kit.post(col.url, batch, client=client)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                refused_batch = batch
                break
            acked += r.json()["accepted"]
            first_trace = first_trace or batch[0]["trace_id"]
        assert refused_batch is not None, "the tiny disk never filled"
        assert r.status_code == 503, (r.status_code, r.text)  # not a 500
        assert r.headers.get("Retry-After") and "disk" in r.json()["error"]["reason"]
        ids = [s["span_id"] for s in refused_batch]
        assert _stored(spool, ids) == 0  # nothing partial

        # Still full: more posts are refused the same way, and everything else keeps serving.
        for _ in range(3):
            again = kit.post(col.url, refused_batch, client=client)
            statuses[again.status_code] = statuses.get(again.status_code, 0) + 1
            assert again.status_code == 503, again.text
        assert httpx.get(col.url + "/healthz").status_code == 200
        assert httpx.get(col.url + "/readyz").status_code == 200
        listing = httpx.get(col.url + "/v1/trajectories", params={"limit": 1000})  # its index lives on the same full disk
        assert listing.status_code == 503 and listing.headers.get("Retry-After") and "disk" in listing.text, listing.text
        # Every other reader of that index answers the same 503 (it was a 500 on the viewer's pages, then on
        # the export, JSONL and Parquet, through the API and the viewer: issue 28, item 4) ...
        for path, params in [("/ui/api/trajectories", {}), ("/ui/api/facets", {}), ("/ui/api/overview", {}),
                             ("/ui/api/status", {}), ("/v1/groups", {"step": 0}), ("/ui/api/groups", {"step": 0}),
                             ("/v1/health", {"step": 0}), ("/v1/export", {}), ("/v1/export", {"format": "parquet"}),
                             ("/ui/api/export", {}), ("/ui/api/export", {"format": "parquet", "token_ids": "true"})]:
            answer = httpx.get(col.url + path, params=params)
            assert answer.status_code == 503 and answer.headers.get("Retry-After") and "disk" in answer.text, (path, answer.text)
        # ... while a stored trajectory still opens: it is read from the spool, only its summary row is withheld.
        opened = httpx.get(col.url + f"/ui/api/trajectories/{first_trace}")
        assert opened.status_code == 200 and opened.json()["summary"] is None, opened.text[:300]
        refusals = kit.metrics(col.url, "tracecar_backpressure_total", bound="disk_full")
        assert refusals == 4
        assert _stored(spool, ids) == 0

        # Space returns: the same batch is taken whole.
        ballast.unlink()
        back = kit.post(col.url, refused_batch, client=client)
        assert back.status_code == 200 and back.json()["accepted"] == 10, back.text
        assert _stored(spool, ids) == 10
    assert kit.metrics(col.url, "tracecar_spans_accepted_total") == acked + 10
    print(f"\ndisk full: acked={acked} statuses={statuses} disk_full_503s={int(refusals)} stored_after_recovery=10")
    assert not any(s >= 500 and s != 503 for s in statuses)
