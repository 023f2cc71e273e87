"""Guarantee 2: a Weave outage costs nothing; a permanent rejection is dead-lettered, not a jam.

The forward target is a real loopback HTTP server. First nothing listens (connections
refused), then it answers 503, then 500, then 429 with Retry-After, then recovers: spans wait
in the spool, retries back off exponentially with jitter up to the cap, Retry-After is
honoured, and after recovery every span arrives once, in order within its trace. A span the
backend rejects for good (422, as Weave answers an invalid call) goes to the dead-letter table
with the reason, shows in /metrics and `tracecar dead-letters`, and the rest flows past it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tracecar.collector.exporters import forward as forward_module
from tracecar.collector.exporters.weave_sink import WeaveSink

pytestmark = pytest.mark.timeout(120)

INITIAL_S, CAP_S, RETRY_AFTER_S = 0.05, 0.8, 0.7


def test_outage_spans_wait_back_off_and_arrive_in_trace_order(start_collector, faulty_weave_stub_at, kit, monkeypatch):
    draws: list[tuple[float, float, float]] = []
    real_uniform = forward_module.random.uniform

    class RecordingRandom:  # the forwarder's jitter source, recorded
        @staticmethod
        def uniform(a: float, b: float) -> float:
            value = real_uniform(a, b)
            draws.append((a, b, value))
            return value

    monkeypatch.setattr(forward_module, "random", RecordingRandom)
    port = kit.free_port()
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=f"http://127.0.0.1:{port}")
    col = start_collector(sink=sink, backend="weave", forward_batch_spans=7,
                          forward_retry_initial_s=INITIAL_S, forward_retry_max_s=CAP_S)

    # Six trajectories, posted as three batches that interleave two trajectories each.
    trajectories = [kit.trajectory(children=4, sample_index=i) for i in range(6)]
    order: list[str] = []
    for a, b in zip(trajectories[::2], trajectories[1::2]):
        batch = [s for pair in zip(a, b) for s in pair]
        r = kit.post(col.url, batch)
        assert r.status_code == 200 and r.json()["accepted"] == 10
        order += [s["span_id"] for s in batch]
    total = len(order)

    def failures() -> float:
        return kit.metrics(col.url, "tracecar_forward_failures_total")

    # Phase 1: connection refused.
    assert kit.wait_for(lambda: failures() >= 4, 20)
    ready = httpx.get(col.url + "/readyz").json()
    assert ready["ready"] is True and ready["spool_depth"] == total and "ConnectError" in (ready["last_forward_error"] or "")

    # Phase 2: the server is up but failing: 503, then 500, then 429 with Retry-After.
    stub = faulty_weave_stub_at(port)
    for status, n, headers in ((503, 3, {}), (500, 2, {}), (429, 1, {"Retry-After": str(RETRY_AFTER_S)})):
        stub.outage_headers = headers
        stub.outage = status
        assert kit.wait_for(lambda: sum(1 for t in stub.timeline if t[2] == status) >= n, 20), status
    stub.outage = None  # recovery
    assert kit.wait_for(lambda: len(stub.delivered()) >= total, 30)
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spool_depth") == 0, 10)

    delivered = stub.delivered()
    failed = [t for t in stub.timeline if t[2] not in (200, None)]
    print(f"\noutage: spans={total} forwarded={len(set(delivered))} deliveries={len(delivered)} "
          f"refused+failed_attempts={int(failures())} http_failures={ {s: sum(1 for t in failed if t[2] == s) for s in (503, 500, 429)} } "
          f"backoff_caps={[round(b, 3) for _, b, _ in draws]}")
    # Nothing lost, nothing twice, and each trace in the order its spans arrived.
    assert sorted(delivered) == sorted(order) and len(delivered) == len(set(delivered)) == total
    for spans in trajectories:
        ids = [s["span_id"] for s in spans]
        assert [sid for sid in delivered if sid in ids] == ids
    assert kit.metrics(col.url, "tracecar_spans_forwarded_total") == total
    assert kit.metrics(col.url, "tracecar_dead_letters") == 0

    # Backoff: exponential from the initial delay, capped, with jitter drawn below each cap.
    caps = [b for _, b, _ in draws]
    assert caps[0] == INITIAL_S and max(caps) == CAP_S and all(b <= CAP_S for b in caps)
    assert all(later in (earlier, min(2 * earlier, CAP_S), min(4 * earlier, CAP_S)) for earlier, later in zip(caps, caps[1:]))
    assert all(0 <= v <= b for _, b, v in draws) and len({round(v, 6) for *_, v in draws}) > 1
    # Retry-After honoured: the next request came no sooner than the server asked.
    t429 = next(t for t, _, s in stub.timeline if s == 429)
    next_request = min(t for t, _, _ in stub.timeline if t > t429)
    assert next_request - t429 >= RETRY_AFTER_S - 0.01


@pytest.mark.parametrize("status", [422, 400])
def test_permanent_rejection_is_dead_lettered_with_its_reason_and_never_blocks(status, faulty_weave_stub, weave_collector_process, kit):
    stub = faulty_weave_stub
    stub.poison_status = status
    pc = weave_collector_process(stub.url).start()
    first, poisoned, last = (kit.trajectory(children=3, sample_index=i) for i in range(3))
    poison = poisoned[1]["span_id"]
    stub.poison = {poison}  # Weave refuses any batch holding this call (422 invalid call, 400 bad request)
    for batch in (first, poisoned):
        assert kit.post(pc.url, batch).json()["accepted"] == 4
    bad_project = kit.trajectory(children=1, sample_index=9)
    r = kit.post(pc.url, bad_project, project="a/b/c")  # a project Weave cannot address
    assert r.status_code == 200 and r.json()["accepted"] == 2
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_dead_letters") >= 3, 30)
    assert kit.post(pc.url, last).json()["accepted"] == 4  # posted after the poison: still flows

    good = [s["span_id"] for s in first + poisoned + last if s["span_id"] != poison]
    assert kit.wait_for(lambda: set(stub.delivered()) >= set(good), 30)
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_spool_depth") == 0, 30)
    delivered = stub.delivered()
    metrics = httpx.get(pc.url + "/metrics").text

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "dead-letters", "--url", pc.url],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    listing = json.loads(cli.stdout)
    reasons = {row["span_id"]: row["reason"] for row in listing["dead_letters"]}
    print(f"\ndead letters ({status}): posted={len(first + poisoned + last + bad_project)} forwarded={len(set(delivered))} "
          f"dead={listing['count']} reasons={ {k[-4:]: v[:60] for k, v in reasons.items()} }")
    assert sorted(delivered) == sorted(good)  # everything else delivered, once
    assert listing["count"] == 3 and set(reasons) == {poison} | {s["span_id"] for s in bad_project}
    assert str(status) in reasons[poison]
    assert all("invalid Weave project" in reasons[s["span_id"]] for s in bad_project)
    assert kit.metric(metrics, "tracecar_dead_letters") == 3
    assert kit.metric(metrics, "tracecar_spans_dead_lettered_total") == 3


def test_a_rejected_api_key_keeps_spans_pending_instead_of_dead_lettering_them(start_collector, faulty_weave_stub, kit):
    """A 401 (the key is refused) is never a span's fault: the spool waits for a fixed key, nothing dies.

    (A 403 stays permanent: spans may name different projects, and only that project is refused.)
    """
    status = 401
    stub = faulty_weave_stub
    stub.outage = status
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=stub.url)
    col = start_collector(sink=sink, backend="weave", forward_retry_initial_s=0.05, forward_retry_max_s=0.2)
    spans = kit.trajectory(children=4) + kit.trajectory(children=4)
    assert kit.post(col.url, spans).json()["accepted"] == 10
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_forward_failures_total") >= 3, 20)
    ready = httpx.get(col.url + "/readyz").json()
    dead_while_refused = kit.metrics(col.url, "tracecar_dead_letters")
    assert dead_while_refused == 0 and ready["spool_depth"] == 10 and str(status) in ready["last_forward_error"]
    stub.outage = None  # the key is fixed
    assert kit.wait_for(lambda: len(stub.delivered()) == 10, 20)
    print(f"\ncredentials {status}: failed_attempts={int(kit.metrics(col.url, 'tracecar_forward_failures_total'))} "
          f"dead_while_refused={int(dead_while_refused)} forwarded_after_fix={len(stub.delivered())}")
    assert sorted(stub.delivered()) == sorted(s["span_id"] for s in spans)
    assert kit.metrics(col.url, "tracecar_dead_letters") == 0
