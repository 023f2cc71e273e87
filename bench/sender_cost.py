"""Where the tracecar sender's background CPU per span goes, for bench/hot_path.py's traced call.

Records are made by the real decorator (the sender's queue is swapped for a list, so nothing is
posted), then packed the way ``Sender._build_body`` packs them, in batches of the client's bounds,
on this thread: the thread CPU per span of the whole packing, and of each of its parts alone
(``to_wire``, ``orjson.dumps`` of the wire dict, the redaction byte search, ``batch_body``), then
a cProfile top list. Nothing is sent; no network.

    .venv/bin/python bench/sender_cost.py [--spans 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from collections.abc import Callable
from typing import Any

import hot_path
import orjson

from common import token_ids, tool_call


def per_span_us(fn: Callable[[], Any], n: int) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=3000)
    args = parser.parse_args()
    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer
    from tracecar.client import sender as sender_mod
    from tracecar.client.wire import batch_body, pack_span

    records: list[Any] = []
    sender_mod.Sender.enqueue = lambda self, record: records.append(record)  # type: ignore[method-assign]
    tr = tracer.configure(url="http://127.0.0.1:9", experiment="bench")  # never posted to: enqueue is replaced
    loop = hot_path.make_loop(rollout_trace_op)
    rng = random.Random(1)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
        for i in range(args.spans):
            loop.step(*inputs[i & 7])
    s, cfg = tr.sender, tr.sender.config

    def pack_all() -> list[bytes]:
        bodies, parts, size = [], [], 0
        for record in records:
            packed = pack_span(s._wire(record), s.encoder, cfg.max_string_chars)
            parts.append(packed)
            size += len(packed)
            if size >= cfg.batch_max_bytes or len(parts) >= cfg.batch_max_spans:
                bodies.append(batch_body(s._header(), parts))
                parts, size = [], 0
        if parts:
            bodies.append(batch_body(s._header(), parts))
        return bodies

    pack_all()  # warm
    t0 = time.thread_time()
    bodies = pack_all()
    total = (time.thread_time() - t0) * 1e6 / len(records)
    one = records[len(records) // 2]
    wire = s._wire(one)
    packed = pack_span(wire, s.encoder, cfg.max_string_chars)
    per_batch = max(1, len(records) // len(bodies))
    parts = [packed] * per_batch
    print(f"{len(records)} spans, {len(bodies)} bodies ({per_batch} spans, {len(bodies[0]) / 2**20:.2f} MiB each), "
          f"{len(packed):,} bytes per span")
    print(f"packing, all of it:          {total:6.1f} µs CPU per span")
    print(f"  to_wire:                   {per_span_us(lambda: s._wire(one), 2000):6.1f} µs")
    print(f"  orjson.dumps(wire):        {per_span_us(lambda: orjson.dumps(wire), 2000):6.1f} µs")
    at = packed.find(b'"attributes":')
    print(f"  redaction byte search:     {per_span_us(lambda: s.encoder.redact.might_hold(packed, start_at=at), 2000):6.1f} µs")
    print(f"  batch_body, per span:      {per_span_us(lambda: batch_body(s._header(), parts), 50) / per_batch:6.1f} µs")
    prof = cProfile.Profile()
    prof.runcall(pack_all)
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
