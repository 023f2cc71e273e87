"""Cost of tracecar.client.traceparent() on the caller's path, against same-run baselines.

Prints per-call ns of: an empty call, traceparent() outside a trace, inside a traced call, and
a traced call itself (rollout_trace_op around an empty function); RATIOS last. No collector is
needed: the client is pointed at a closed loopback port and its queue is drained at the end.
"""

from __future__ import annotations

import argparse
import timeit

from common import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=20_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings (the minimum is kept)")
    args = parser.parse_args()
    port = free_port()  # nothing listens there: the tracer's sends fail fast, off the timed path
    from tracecar.client import rollout_trace_attr, rollout_trace_op, traceparent, tracer

    tracer.configure(url=f"http://127.0.0.1:{port}", shutdown_timeout_s=0.1, queue_max_spans=64)

    def per_call(fn) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e9

    @rollout_trace_op
    def traced() -> None:
        return None

    empty = per_call(lambda: None)
    outside = per_call(traceparent)
    with rollout_trace_attr(sample_index=0, step=0):
        inside = per_call(traceparent)
        op = per_call(traced)  # queue bounded at 64: the rest are dropped and counted, as in overload
    tracer.shutdown(0.1)
    print(f"empty call: {empty:.0f} ns; traceparent() outside a trace: {outside:.0f} ns; inside: {inside:.0f} ns;"
          f" one traced call: {op:.0f} ns")
    print("RATIOS")
    print(f"traceparent_inside / traced_call = {inside / op:.2f}")
    print(f"traceparent_inside - empty_call = {inside - empty:.0f} ns")


if __name__ == "__main__":
    main()
