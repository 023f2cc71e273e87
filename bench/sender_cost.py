"""Where the tracecar sender's background CPU per span goes, for bench/hot_path.py's call.

Records are made by the real decorator in trajectories of 4 and packed by the sender's own
``Sender._build_body`` on this thread (bench/sender_harness.py: wire v3, prompt deltas, short ids,
open markers, the spliced pieces joined once a body; nothing is posted, no network). It prints:

- the thread CPU per span of the whole build, and its stages as they run inside it (each stage
  wrapped in a thread-clock timer: ``to_wire`` with the exception scrub, the prompt deltas, the
  short ids, the packing of a span's pieces, the body's join with its minor page faults, the rest
  being the loop itself), median of ``--rounds`` builds;
- the same generate span's ``to_wire`` and packing timed alone in a tight loop: warm caches, the
  floor the stages above would reach if nothing around them touched memory;
- a cProfile top list of the real build.

    .venv/bin/python bench/sender_cost.py [--spans 2000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import orjson
from sender_harness import shutdown, traced_sender

STAGES = ("to_wire", "prompt deltas", "short ids", "packing", "body join")


def per_span_us(fn: Callable[[], Any], n: int) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) * 1e6 / n


def _id_lists(wire: dict[str, Any]) -> list[list[int]]:
    return [v for part in ("inputs", "output") if type(wire.get(part)) is dict
            for v in wire[part].values() if type(v) is list and len(v) > 100]


def timed_stages(sender: Any, sender_mod: Any) -> tuple[dict[str, float], list[int]]:
    """Wraps the build's stages (where ``_build_body`` looks them up) in thread-clock timers;
    returns the seconds per stage and [the join's minor page faults, the bodies joined]."""
    spent: dict[str, float] = defaultdict(float)
    faults = [0, 0]

    def timer(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - t0
        return timed

    join = sender_mod.batch_body_pieces

    def counted_join(*args: Any) -> Any:
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        try:
            return join(*args)
        finally:
            faults[0] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
            faults[1] += 1

    sender._wire = timer("to_wire", sender._wire)
    sender.deltas.apply = timer("prompt deltas", sender.deltas.apply)
    sender_mod.shorten_record = timer("short ids", sender_mod.shorten_record)
    sender._pack = timer("packing", sender._pack)
    sender_mod.batch_body_pieces = timer("body join", counted_join)
    return spent, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=2000, help="calls traced a build (a quarter as many trajectory spans on top)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from tracecar.client import sender as sender_mod
    from tracecar.client.wire import pieces_size

    traced = traced_sender()
    sender, cfg = traced.sender, traced.sender.config
    pack, to_wire = sender._pack, sender._wire  # unwrapped, for the tight loops
    traced.trace(args.spans)
    traced.build_all()  # warm: the caches, the prompt contexts' first fills
    spent, faults = timed_stages(sender, sender_mod)
    totals: list[float] = []
    per_stage: dict[str, list[float]] = {label: [] for label in (*STAGES, "the loop (the rest)")}
    join_faults: list[float] = []
    bodies = 0
    for _ in range(args.rounds):
        traced.trace(args.spans)
        spent.clear()
        faults[0] = faults[1] = 0
        t0 = time.thread_time()
        spans = traced.build_all()
        total = time.thread_time() - t0
        bodies = faults[1]
        totals.append(total * 1e6 / spans)
        for label in STAGES:
            per_stage[label].append(spent[label] * 1e6 / spans)
        per_stage["the loop (the rest)"].append((total - sum(spent.values())) * 1e6 / spans)
        join_faults.append(faults[0] / spans)
    traced.trace(8)
    record = next(r for r in sender.queue if _id_lists(to_wire(r)))  # a call, not its trajectory
    sender.queue.clear()
    sender.opens.clear()
    wire = to_wire(record)
    pieces = pack(wire, sender.encoder, cfg.max_string_chars)
    ids = _id_lists(wire)
    print(f"{spans} spans a build ({args.spans} calls + their trajectories, {bodies} bodies), {args.rounds} builds; "
          f"a generate span packs to {pieces_size(pieces):,} bytes in {len(pieces)} pieces")
    print(f"the build, all of it:             {statistics.median(totals):6.1f} µs CPU a span (spread "
          f"{min(totals):.1f}–{max(totals):.1f})")
    for label, values in per_stage.items():
        extra = f"   ({statistics.median(join_faults):.2f} minor page faults a span)" if label == "body join" else ""
        print(f"  {label:30s}  {statistics.median(values):6.1f} µs{extra}")
    print("one generate span alone, in a tight loop (warm caches):")
    print(f"  to_wire                         {per_span_us(lambda: to_wire(record), 2000):6.1f} µs")
    print(f"  packing                         {per_span_us(lambda: pack(wire, sender.encoder, cfg.max_string_chars), 2000):6.1f} µs")
    print(f"    of which the ids' orjson.dumps {per_span_us(lambda: [orjson.dumps(v) for v in ids], 2000):5.1f} µs")
    print(f"    the redaction search          {per_span_us(lambda: sender.encoder.redact.might_hold(pieces[0]), 2000):6.1f} µs")
    traced.trace(args.spans)
    prof = cProfile.Profile()
    prof.runcall(traced.build_all)
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    shutdown()


if __name__ == "__main__":
    main()
