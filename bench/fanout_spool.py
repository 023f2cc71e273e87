"""Fan-out cost in the spool: ingest with two exporters against one, and a healthy exporter's
batch while another owes a big backlog.

Same run, same machine, same spans (``--batch`` spans of ``--payload`` bytes per commit):

* ingest: spans/s committed by ``Spool.write`` with one exporter (today's fast path: the state
  column alone), with two (one ``deliveries`` row per exporter per span), and with two gateways
  (a node listing two: each span's one owner decided at the write, exporters/gateway_route.py);
  the ratios are the price of a second destination, and of routing, at the spool;
* healthy exporter: the time of one forward cycle of ``--forward-batch`` spans (``next_pending``
  + ``mark_forwarded``) for exporter ``a`` while exporter ``b`` is caught up, and again while
  ``b`` owes ``--backlog`` spans (its backend down), then again once ``b`` has caught up on
  the same file (the baseline of the ratio: same file size, no backlog); the ratio says how much
  a backlog elsewhere slows the healthy one.

    .venv/bin/python bench/fanout_spool.py [--spans 60000] [--backlog 200000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from tracecar.collector.exporters.gateway_route import GatewayRouter
from tracecar.collector.spool.store import Spool, SpoolRow

GATEWAYS = ("http://10.0.0.1:9470", "http://10.0.0.2:9470")


class Ids:
    def __init__(self) -> None:
        self.n = 0

    def span_rows(self, count: int, payload: int) -> list[SpoolRow]:
        """``count`` spans in trajectories of 8 (a root and its ops), as ingest stores them."""
        rows = []
        blob = "x" * payload
        for _ in range(count):
            self.n += 1
            trace = f"0{self.n // 8:031x}"
            span_id = trace if self.n % 8 == 0 else f"1{self.n:031x}"
            span = {"span_id": span_id, "trace_id": trace, "parent_id": None if span_id == trace else trace,
                    "name": "Agent.generate", "kind": "op", "worker": "w0", "start_time": 1.0, "end_time": 2.0,
                    "exception": None, "attributes": {"step": self.n // 4096, "sample_index": self.n // 8, "rollout_n": 0,
                                                       "experiment_name": "bench"},
                    "inputs": {"blob": blob}, "output": {"token_ids": list(range(16))}}
            rows.append(SpoolRow(span=span, payload=orjson.dumps(span), warnings=None))
        return rows


def ingest_rate(path: Path, exporters: tuple[str, ...], ids: Ids, spans: int, batch: int, payload: int,
                routed: bool = False) -> float:
    router = GatewayRouter(GATEWAYS) if routed else None
    spool = Spool(path, local_only=False, exporters=tuple(router.names) if router else exporters, routing=router)
    batches = [ids.span_rows(batch, payload) for _ in range(spans // batch)]
    started = time.perf_counter()
    for rows in batches:
        spool.write(rows)
    elapsed = time.perf_counter() - started
    spool.close()
    return len(batches) * batch / elapsed


def forward_cycles(spool: Spool, ids: Ids, exporter: str, rounds: int, batch: int, payload: int,
                   others: tuple[str, ...]) -> list[float]:
    """Per round: ingest one batch, time ``exporter``'s fetch + record of it, then let ``others``
    (caught-up exporters) take theirs, untimed; with none, the other exporter is down."""
    times = []
    for _ in range(rounds):
        spool.write(ids.span_rows(batch, payload))
        started = time.perf_counter()
        rows = spool.next_pending(batch, exporter)
        spool.mark_forwarded([r[0] for r in rows], True, exporter)
        times.append(time.perf_counter() - started)
        assert len(rows) == batch, len(rows)
        for other in others:
            taken = spool.next_pending(batch, other)
            spool.mark_forwarded([r[0] for r in taken], True, other)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=60_000, help="spans ingested per ingest run")
    parser.add_argument("--batch", type=int, default=500, help="spans per ingest commit")
    parser.add_argument("--payload", type=int, default=1000, help="bytes of inputs per span")
    parser.add_argument("--backlog", type=int, default=200_000, help="spans the down exporter owes")
    parser.add_argument("--forward-batch", type=int, default=1000, help="spans per forward batch")
    parser.add_argument("--rounds", type=int, default=30, help="timed forward cycles per case")
    parser.add_argument("--repeats", type=int, default=6, help="ingest runs per mode (back-to-back pairs; median pair ratio)")
    args = parser.parse_args()
    print(f"load at start: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    ids = Ids()
    with tempfile.TemporaryDirectory(prefix="tracecar-fanout-bench-") as tmp:
        rates: dict[int, list[float]] = {1: [], 2: [], 3: []}
        for r in range(args.repeats):  # back-to-back rounds, order alternating, so a busy moment hits every mode alike
            modes = [(1, ("a",)), (2, ("a", "b")), (3, ())]
            for n, exporters in modes if r % 2 == 0 else modes[::-1]:
                rates[n].append(ingest_rate(Path(tmp) / f"ingest-{n}-{r}.sqlite3", exporters, ids,
                                            args.spans, args.batch, args.payload, routed=n == 3))
        pair_ratios = [two / one for one, two in zip(rates[1], rates[2])]
        routed_ratios = [routed / two for two, routed in zip(rates[2], rates[3])]
        for n, what in ((1, "1 exporter: "), (2, "2 exporters:"), (3, "2 gateways: ")):
            print(f"ingest, {what} median {statistics.median(rates[n]):,.0f} spans/s (runs: {', '.join(f'{x:,.0f}' for x in rates[n])})")

        spool = Spool(Path(tmp) / "forward.sqlite3", local_only=False, exporters=("a", "b"))
        small = forward_cycles(spool, ids, "a", args.rounds, args.forward_batch, args.payload, others=("b",))
        # b's backend goes down: it stops taking spans and its backlog grows to --backlog
        while spool.owed_count("b") < args.backlog:
            spool.write(ids.span_rows(args.batch, args.payload))
            rows = spool.next_pending(args.batch, "a")
            spool.mark_forwarded([r[0] for r in rows], True, "a")
        backlog = spool.owed_count("b")
        behind = forward_cycles(spool, ids, "a", args.rounds, args.forward_batch, args.payload, others=())
        while spool.owed_count("b"):  # b is back and catches up: the same file, no backlog (the fair baseline)
            rows = spool.next_pending(5000, "b")
            spool.mark_forwarded([r[0] for r in rows], True, "b")
        caught_up = forward_cycles(spool, ids, "a", args.rounds, args.forward_batch, args.payload, others=("b",))
        spool.close()
    med_small, med_up, med_behind = (statistics.median(x) for x in (small, caught_up, behind))
    print(f"healthy exporter, forward cycle of {args.forward_batch} spans (fetch + record), other caught up, fresh spool: "
          f"median {med_small * 1e3:.2f} ms, max {max(small) * 1e3:.2f} ms")
    print(f"healthy exporter, same, other owing {backlog:,} spans: median {med_behind * 1e3:.2f} ms, "
          f"max {max(behind) * 1e3:.2f} ms")
    print(f"healthy exporter, same, other caught up again (same file): median {med_up * 1e3:.2f} ms, "
          f"max {max(caught_up) * 1e3:.2f} ms")
    print(f"load at end: {os.getloadavg()[0]:.2f}")
    print("RATIOS")
    print(f"  ingest 2 exporters / 1 exporter (spans/s, median of {len(pair_ratios)} back-to-back pairs): "
          f"{statistics.median(pair_ratios):.2f} (pairs: {', '.join(f'{x:.2f}' for x in pair_ratios)})")
    print(f"  ingest 2 gateways (routed) / 2 exporters (spans/s, median of {len(routed_ratios)} rounds): "
          f"{statistics.median(routed_ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in routed_ratios)})")
    print(f"  healthy batch with backlog elsewhere / without, same file (median): {med_behind / med_up:.2f}")


if __name__ == "__main__":
    main()
