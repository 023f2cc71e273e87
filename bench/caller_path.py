"""The caller's path alone: what ``rollout_trace_op`` adds to a call, with no sender thread running.

``hot_path.py`` measures what a worker sees (paced calls, the sender building and posting on
the other core); this isolates the Python the caller runs, so a change to it can be A/B-tested
without the sender's noise: the tracer is configured but its thread never starts, and the
queue is emptied between chunks (outside the timing) as the sender would.

Prints, best of ``--rounds``: the undecorated call (the baseline, same run), the decorated one,
the difference, and each piece of the path timed on its own.

  .venv/bin/python bench/caller_path.py [--calls 200000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import timeit
from typing import Any

CHUNK = 2000


class Loop:
    def step(self, prompt_ids: list[int], response_ids: list[int], tool_call: dict[str, Any], reward: float) -> dict[str, Any]:
        """hot_path.py's traced method: one turn's bookkeeping."""
        return {"num_turns": 3, "reward": reward, "tool": tool_call["name"], "response_len": len(response_ids)}


def per_call_us(step: Any, args: tuple[Any, ...], calls: int, sender: Any) -> float:
    total = 0.0
    for _ in range(max(1, calls // CHUNK)):
        t0 = time.perf_counter()
        for _ in range(CHUNK):
            step(*args)
        total += time.perf_counter() - t0
        if sender is not None:
            sender.queue.clear()
            sender.opens.clear()
    return total / (max(1, calls // CHUNK) * CHUNK) * 1e6


def pieces(parent: Any, n: int = 200_000) -> dict[str, float]:
    """Each piece of the path on its own, ns per call (best of 5)."""
    from tracecar.client import tracer, tracing
    from tracecar.client.spans import KIND_OP, SpanRecord, _LazySignature, snapshot

    sig = _LazySignature(Loop.step)
    args = (object(), [1] * 1500, [2] * 500, {"name": "search"}, 0.5)
    out = {"num_turns": 3, "reward": 0.5, "tool": "search", "response_len": 500}
    attrs = tracing._attributes_of(parent)
    env = {"SpanRecord": SpanRecord, "KIND_OP": KIND_OP, "parent": parent, "attrs": attrs, "sig": sig, "args": args,
           "snapshot": snapshot, "out": out, "tracing": tracing, "cv": tracer.current, "c": itertools.count()}
    stmts = {
        "record (with the list lengths)": "SpanRecord('x', KIND_OP, 1.0, parent, attrs, sig, args, None)",
        "output snapshot": "snapshot(out)",
        "parent attributes": "tracing._attributes_of(parent)",
        "time.time()": "tracing._now()",
        "context variable set + reset": "t = cv.set(parent); cv.reset(t)",
    }
    return {label: min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n * 1e9 for label, stmt in stmts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

    tr = tracer.configure(url="http://127.0.0.1:9", experiment="bench", queue_max_spans=10 * CHUNK)
    assert tr is not None
    sender = tr.sender
    sender._thread = object()  # never started: this measures the caller alone
    plain = Loop()

    class Traced(Loop):
        step = rollout_trace_op(Loop.step)  # type: ignore[assignment]

    traced = Traced()
    rng = random.Random(1)
    call_args = ([rng.randrange(150_000) for _ in range(1500)], [rng.randrange(150_000) for _ in range(500)],
                 {"name": "search", "arguments": {"query": "x"}}, 0.5)
    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0) as root:
        rounds = [(per_call_us(plain.step, call_args, args.calls, None), per_call_us(traced.step, call_args, args.calls, sender))
                  for _ in range(args.rounds)]
        parts = pieces(root)
    sender.queue.clear()
    sender.opens.clear()
    sender._stopping = True
    base = min(p for p, _ in rounds)
    best = min(t - p for p, t in rounds)
    print(f"undecorated call (baseline): {base:.3f} µs")
    print(f"decorated call:              {min(t for _, t in rounds):.3f} µs")
    print(f"added by tracecar (best of {args.rounds}): {best:.3f} µs; each round: " + ", ".join(f"{t - p:.3f}" for p, t in rounds))
    print(f"ratio decorated / undecorated: {min(t for _, t in rounds) / base:.1f}x")
    print("pieces, ns per call:")
    for label, ns in parts.items():
        print(f"  {label:32s} {ns:7.1f}")


if __name__ == "__main__":
    main()
