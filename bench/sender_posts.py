"""The tracecar sender against a real collector: CPU per span building bodies and posting them, and spans per post.

bench/hot_path.py's traced call (1,500 prompt ids, 500 response ids, a tool call, a reward),
paced by ``--gap-us`` of sleep as an agent loop awaits the GPU, through the real client to a
collector process on 127.0.0.1 (local store). The sender's ``_build_body`` and
``_post_with_retries`` are timed with the sender thread's CPU clock. A post costs the worker
most of a millisecond of CPU (0.7–0.9 ms here), most of it whatever its size, so how many spans a post carries decides
much of the background cost. Run it once with another tree's code
(``PYTHONPATH=<tree>/tests/typecheck``) for a same-session A/B.

    .venv/bin/python bench/sender_posts.py [--calls 6000] [--gap-us 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import hot_path

from common import header, machine_note, services, start_collector, token_ids, tool_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=6000)
    parser.add_argument("--gap-us", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import tracecar.client
    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer
    from tracecar.client import sender as sender_mod

    spent = {"build": 0.0, "post": 0.0, "posts": 0, "post_wall": 0.0}
    build, post = sender_mod.Sender._build_body, sender_mod.Sender._post_with_retries

    def timed_build(self: Any) -> Any:
        t0 = time.thread_time()
        try:
            return build(self)
        finally:
            spent["build"] += time.thread_time() - t0

    def timed_post(self: Any, body: bytes, n: int) -> bool:
        t0, wall0 = time.thread_time(), time.perf_counter()
        try:
            return post(self, body, n)
        finally:
            spent["post"] += time.thread_time() - t0
            spent["post_wall"] += time.perf_counter() - wall0  # mostly waiting for the collector's answer
            spent["posts"] += 1

    sender_mod.Sender._build_body = timed_build  # type: ignore[method-assign]
    sender_mod.Sender._post_with_retries = timed_post  # type: ignore[method-assign]
    print(machine_note())
    print(f"client code: {Path(tracecar.client.__file__).parent}")
    rng = random.Random(1)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    collector = start_collector(Path(tempfile.mkdtemp(prefix="tracecar-bench-posts-")) / "collector")
    with services(collector):
        tr = tracer.configure(url=collector.url, experiment="bench", queue_max_spans=args.calls + 1000)
        loop = hot_path.make_loop(rollout_trace_op)
        gap = args.gap_us / 1e6
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
            for i in range(200):  # warm: connection open, lazy imports paid
                loop.step(*inputs[i & 7])
            assert tr is not None and tr.flush(60)
            header(f"{args.calls} paced calls a round (gap {args.gap_us:g} µs)")
            for round_ in range(args.rounds):
                spent.update(build=0.0, post=0.0, posts=0, post_wall=0.0)
                cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
                for i in range(args.calls):
                    loop.step(*inputs[i & 7])
                    time.sleep(gap)
                cpu1, thread1, wall1 = time.process_time(), time.thread_time(), time.perf_counter()
                waited, backlog = spent["post_wall"], len(tr.sender.queue)
                tr.flush(60)
                background = (cpu1 - cpu0 - (thread1 - thread0) + time.process_time() - cpu1) * 1e6 / args.calls
                n = args.calls
                print(f"round {round_ + 1}: {spent['posts']} posts ({n / max(1, spent['posts']):.0f} spans a post); "
                      f"building {spent['build'] * 1e6 / n:.1f} µs a span, posting {spent['post'] * 1e6 / n:.1f} µs a span "
                      f"({spent['post'] * 1e6 / max(1, spent['posts']):.0f} µs a post); background CPU {background:.1f} µs a call; "
                      f"posts in flight {waited:.2f} s of the calls' {wall1 - wall0:.2f} s, {backlog} spans queued at their end")
        tr.flush(60)  # the trajectory's root, sent after its context closed
        stats = tr.stats()
        print(f"client stats: sent {stats['sent']}, dropped {stats['dropped']}")
        tracer.shutdown(10)  # before the collector stops
    print(machine_note())


if __name__ == "__main__":
    main()
