"""Guarantee 1: a collector killed with SIGKILL mid-stream loses nothing it acknowledged.

A real `tracecar serve` process forwards (backend=weave) to a loopback Weave stub. The test
streams span batches itself with httpx, so it knows exactly which spans got a 2xx, and kills
the collector while (a) the client is still streaming and (b) a forward request is in flight
at the stub, unanswered. After a restart on the same spool every acknowledged span reaches the
stub exactly once; batches the client re-posts (its retries) are dropped as duplicates.
"""

from __future__ import annotations

import threading

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)


def test_sigkill_mid_stream_forwards_every_acknowledged_span_once(faulty_weave_stub, weave_collector_process, kit):
    stub = faulty_weave_stub
    pc = weave_collector_process(stub.url, TRACECAR_FORWARD_BATCH_SPANS=25).start()
    url = pc.url

    lock = threading.Lock()
    sent: set[str] = set()
    acked: set[str] = set()
    counts = {"posts": 0, "failed_posts": 0, "acked_batches": 0, "collector_duplicates": 0}
    done = threading.Event()
    batches: list[list[dict]] = []

    def stream() -> None:
        """Posts trajectories one by one; each is retried until a 2xx, as the real client does."""
        with httpx.Client() as client:
            for _ in range(3000):
                if done.is_set():
                    return
                batch = kit.trajectory(children=4)
                batches.append(batch)
                ids = {s["span_id"] for s in batch}
                while not done.is_set():
                    with lock:
                        sent.update(ids)
                        counts["posts"] += 1
                    try:
                        r = kit.post(url, batch, client=client, timeout=5)
                    except httpx.HTTPError:
                        r = None
                    if r is not None and r.status_code == 200:
                        with lock:
                            acked.update(ids)
                            counts["acked_batches"] += 1
                            counts["collector_duplicates"] += r.json()["duplicates"]
                        break
                    with lock:
                        counts["failed_posts"] += 1
                    done.wait(0.02)
                done.wait(0.002)

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        assert kit.wait_for(lambda: len(stub.delivered()) >= 50, 30), "nothing forwarded before the kill"
        stub.hold.set()  # the next forward request is read and left unanswered
        assert stub.held.wait(30), "no forward request in flight"
        with lock:
            acked_at_hold = len(acked)
        assert kit.wait_for(lambda: len(acked) >= acked_at_hold + 100, 30)
        assert streamer.is_alive()

        pc.kill()  # SIGKILL: the streamer is mid-stream, a forward is in flight
        with lock:
            acked_before_kill = set(acked)
            forwarded_before_kill = set(stub.delivered())
        stub.release.set()
        pc.start()
        with lock:
            acked_at_restart = counts["acked_batches"]
        assert kit.wait_for(lambda: counts["acked_batches"] >= acked_at_restart + 20, 30)
    finally:
        done.set()
        streamer.join(30)

    # A client retry of batches the collector already acknowledged (the answer was "lost").
    r = kit.post(url, [s for b in batches[:3] for s in b])
    assert r.status_code == 200 and r.json()["accepted"] == 0 and r.json()["duplicates"] == 15

    with lock:
        acked_final, sent_final = set(acked), set(sent)
    assert kit.wait_for(lambda: set(stub.delivered()) >= acked_final, 60), "acknowledged spans not forwarded"
    assert kit.wait_for(lambda: kit.metrics(url, "tracecar_spool_depth") == 0, 30)
    delivered = stub.delivered()
    forwarded = set(delivered)
    lost = acked_before_kill - forwarded
    duplicates = len(delivered) - len(forwarded)
    print(f"\ncrash: sent={len(sent_final)} acked={len(acked_final)} acked_before_kill={len(acked_before_kill)} "
          f"forwarded_before_kill={len(forwarded_before_kill)} forwarded={len(forwarded)} deliveries={len(delivered)} "
          f"duplicates={duplicates} lost={len(lost)} posts={counts['posts']} failed_posts={counts['failed_posts']} "
          f"collector_duplicates={counts['collector_duplicates'] + 15}")
    assert len(acked_before_kill) - len(forwarded_before_kill) >= 100  # the kill really stranded acked spans
    assert counts["failed_posts"] >= 1  # the client really was cut off mid-stream
    assert lost == set()
    assert duplicates == 0
    assert forwarded <= sent_final  # nothing forwarded that was never sent
    assert forwarded == acked_final  # every span eventually acked (retries) is forwarded, none else
    assert kit.metrics(url, "tracecar_dead_letters") == 0
