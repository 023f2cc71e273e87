"""The caller's path alone: what ``rollout_trace_op`` adds to a call, with no sender thread running.

``hot_path.py`` measures what a worker sees (paced calls, the sender building and posting on
the other core); this isolates the Python the caller runs, so a change to it can be A/B-tested
without the sender's noise: the tracer is configured but its thread never starts, and the
queue is emptied between chunks (outside the timing) as the sender would.

Prints, best of ``--rounds``: the undecorated call (the baseline, same run), the decorated one
under each ``TRACECAR_SNAPSHOT`` mode (``refs``, ``shallow``, ``deep``: interleaved in every
round, so the modes are compared in the same run), the differences, and each piece of the path
timed on its own.

  .venv/bin/python bench/caller_path.py [--calls 200000] [--rounds 5] [--modes refs,shallow,deep]
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
    from tracecar.client.spans import deep_inputs, deep_snapshot

    verl_out = {"prompt_ids": list(range(1500)), "response_ids": list(range(500)), "response_mask": [1] * 500,
                "num_turns": 3, "metrics": {"generate_sequences": 0.5, "tool_calls": 0.1}, "extra_fields": {}}
    env.update(deep_inputs=deep_inputs, deep_snapshot=deep_snapshot, verl_out=verl_out)
    stmts = {
        "record (with the list lengths)": "SpanRecord('x', KIND_OP, 1.0, parent, attrs, sig, args, None, False)",
        "output snapshot": "snapshot(out)",
        "shallow: record + dict copies": "SpanRecord('x', KIND_OP, 1.0, parent, attrs, sig, args, None, True)",
        "deep: argument copy": "deep_inputs(args, None)",
        "deep: output snapshot": "deep_snapshot(out)",
        "VERL run output, snapshot": "snapshot(verl_out)",
        "VERL run output, deep": "deep_snapshot(verl_out)",
        "parent attributes": "tracing._attributes_of(parent)",
        "time.time()": "tracing._now()",
        "context variable set + reset": "t = cv.set(parent); cv.reset(t)",
    }
    return {label: min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n * 1e9 for label, stmt in stmts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="refs,shallow,deep", help="TRACECAR_SNAPSHOT modes, interleaved in every round")
    args = parser.parse_args()

    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tracers = {}
    for mode in modes:
        made = tracer.Tracer(tracer.ClientConfig(url="http://127.0.0.1:9", experiment="bench", queue_max_spans=10 * CHUNK,
                                                 snapshot=mode))
        made.sender._thread = object()  # never started: this measures the caller alone
        tracers[mode] = made
    tr = tracer.active = tracers[modes[0]]
    plain = Loop()

    class Traced(Loop):
        step = rollout_trace_op(Loop.step)  # type: ignore[assignment]

    traced = Traced()
    rng = random.Random(1)
    call_args = ([rng.randrange(150_000) for _ in range(1500)], [rng.randrange(150_000) for _ in range(500)],
                 {"name": "search", "arguments": {"query": "x"}}, 0.5)
    rounds: list[dict[str, float]] = []
    with rollout_trace_attr(sample_index=0, step=1, rollout_n=0) as root:
        for _ in range(args.rounds):
            row = {"plain": per_call_us(plain.step, call_args, args.calls, None)}
            for mode in modes:  # interleaved: every mode in every round
                tracer.active = tracers[mode]
                row[mode] = per_call_us(traced.step, call_args, args.calls, tracers[mode].sender)
            rounds.append(row)
        tracer.active = tr
        parts = pieces(root)
    for made in tracers.values():
        made.sender.queue.clear()
        made.sender.opens.clear()
        made.sender._stopping = True
    tracer.active = None
    base = min(r["plain"] for r in rounds)
    print(f"undecorated call (baseline): {base:.3f} µs")
    for mode in modes:
        best = min(r[mode] - r["plain"] for r in rounds)
        print(f"TRACECAR_SNAPSHOT={mode:8s} decorated {min(r[mode] for r in rounds):.3f} µs, added by tracecar (best of "
              f"{args.rounds}) {best:.3f} µs; each round: " + ", ".join(f"{r[mode] - r['plain']:.3f}" for r in rounds))
    if len(modes) > 1:
        first = modes[0]
        for mode in modes[1:]:
            ratios = sorted((r[mode] - r["plain"]) / (r[first] - r["plain"]) for r in rounds)
            print(f"added time {mode} / {first}, per round (same round): median {ratios[len(ratios) // 2]:.2f}, "
                  + ", ".join(f"{x:.2f}" for x in ratios))
    print("pieces, ns per call:")
    for label, ns in parts.items():
        print(f"  {label:32s} {ns:7.1f}")


if __name__ == "__main__":
    main()
