"""When is one gateway enough? The cluster tier's throughput against one collector, same run (ABAB).

Round A: one collector (local store, token2text off) fed by ``--nodes`` feeder threads, each
posting its share of the trajectories (one batch per trajectory, 5 spans of ~600 bytes), as the
workers of that many nodes would. Round B: the same volume (fresh ids) posted to ``--nodes``
node collectors that forward to one gateway. Rounds alternate (A B A B …). Per round: spans/s
until every span is acknowledged, spans/s until every trajectory is queryable (at the collector;
at the gateway), and CPU seconds per 1,000 spans of the collector, the gateway and the nodes
(psutil, their process trees). Figures on a shared 2-core machine carry every process at once
(feeders, nodes and gateway): compare the ratios. RATIOS last.

``--clickhouse``: also round C, the same volume through a second cluster whose gateway keeps its
read store in ClickHouse (embedded chDB, ``TRACECAR_STORE=clickhouse``), rounds A B C alternating:
spans/s to queryable at the gateway and its CPU per 1,000 spans, chDB against SQLite.

``--gateways N``: also round D, the same volume through a cluster whose nodes list N gateways (each
step to one of them): spans/s to queryable over all of them, their CPU per 1,000 spans together and
the nodes' (what routing costs them), against round B's one gateway.

    .venv/bin/python bench/cluster.py [--nodes 4] [--trajectories 600] [--rounds 2] [--clickhouse] [--gateways 2]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.cluster import Cluster, process_collector, start_cluster  # noqa: E402
from tests.support.collector import ProcessCollector  # noqa: E402

SPANS_PER_TRAJECTORY = 5


def trajectory(prefix: str, n: int, experiment: str, worker: str) -> list[dict[str, Any]]:
    trace = f"{prefix}{n:016x}"
    attrs = {"step": n // 64, "sample_index": n % 64, "rollout_n": 0, "experiment_name": experiment}
    text = ("the policy answered with a tool call and a long explanation; " * 10)[:600]
    spans = [{"span_id": f"{trace}-{i}", "trace_id": trace, "parent_id": trace, "name": "generate", "kind": "op",
              "start_time": 1.0 + i, "end_time": 1.5 + i, "attributes": attrs, "inputs": {"prompt": text},
              "output": {"response_text": text}} for i in range(SPANS_PER_TRAJECTORY - 1)]
    spans.append({"span_id": trace, "trace_id": trace, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                  "start_time": 1.0, "end_time": 9.0, "attributes": attrs, "inputs": {}, "output": None})
    return spans


def cpu_s(pc: ProcessCollector) -> float:
    assert pc.proc is not None
    proc = psutil.Process(pc.proc.pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def feed(urls: list[str], count: int, experiment: str) -> float:
    """Posts ``count`` trajectories spread over ``urls`` (one thread each); seconds until all acknowledged."""
    prefix = secrets.token_hex(8)

    def run(k: int) -> None:
        with httpx.Client() as client:
            for n in range(k, count, len(urls)):
                body = {"v": 1, "worker": f"w{k}", "spans": trajectory(prefix, n, experiment, f"w{k}")}
                while True:
                    r = client.post(urls[k] + "/v1/spans", json=body, timeout=60)
                    if r.status_code == 200:
                        break
                    time.sleep(float(r.headers.get("retry-after", "0.2")))

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def queryable(url: str, experiment: str) -> int:
    return int(httpx.get(url + "/v1/trajectories", params={"experiment": experiment, "limit": 1}, timeout=60).json()["total"])


def wait_queryable(urls: str | list[str], experiment: str, count: int, timeout_s: float = 600) -> None:
    """Until ``count`` trajectories are listed at ``urls`` together (several gateways: each lists its steps)."""
    urls = [urls] if isinstance(urls, str) else urls
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(queryable(url, experiment) for url in urls) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{count} trajectories of {experiment} not queryable at {', '.join(urls)}")


def round_direct(single: ProcessCollector, nodes: int, count: int, r: int) -> dict[str, float]:
    experiment = f"direct-{r}"
    cpu0 = cpu_s(single)
    started = time.perf_counter()
    acked = feed([single.url] * nodes, count, experiment)
    wait_queryable(single.url, experiment, count)
    queryable = time.perf_counter() - started
    spans = count * SPANS_PER_TRAJECTORY
    return {"acked_rate": spans / acked, "queryable_rate": spans / queryable, "cpu_per_1k": (cpu_s(single) - cpu0) / spans * 1000}


def round_cluster(cluster: Cluster, count: int, r: int) -> dict[str, float]:
    experiment = f"cluster-{len(cluster.gateways)}-{r}"
    gw0, nodes0 = sum(cpu_s(g) for g in cluster.gateways), sum(cpu_s(n) for n in cluster.nodes)
    started = time.perf_counter()
    acked = feed([n.url for n in cluster.nodes], count, experiment)
    wait_queryable([g.url for g in cluster.gateways], experiment, count)
    took = time.perf_counter() - started
    spans = count * SPANS_PER_TRAJECTORY
    out = {"acked_rate": spans / acked, "queryable_rate": spans / took,
           "gateway_cpu_per_1k": (sum(cpu_s(g) for g in cluster.gateways) - gw0) / spans * 1000,
           "nodes_cpu_per_1k": (sum(cpu_s(n) for n in cluster.nodes) - nodes0) / spans * 1000,
           "behind_s": took - acked}
    if len(cluster.gateways) > 1:  # the share of the trajectories the busiest gateway got
        out["largest_share"] = max(queryable(g.url, experiment) for g in cluster.gateways) / count
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=600, help="per round")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of rounds (A B)")
    ap.add_argument("--clickhouse", action="store_true", help="round C: a second cluster, its gateway's store on chDB")
    ap.add_argument("--gateways", type=int, default=1, help="round D when > 1: a cluster whose nodes list this many gateways")
    args = ap.parse_args()
    print(f"load at start: {os.getloadavg()}")
    root = Path(tempfile.mkdtemp(prefix="tracecar-bench-cluster-"))
    single = process_collector(root / "single", log_level="warning").start()
    cluster = start_cluster(root, args.nodes)
    chdb = start_cluster(root / "chdb", args.nodes, gateway={"store": "clickhouse"}) if args.clickhouse else None
    several = start_cluster(root / "several", args.nodes, gateways=args.gateways) if args.gateways > 1 else None
    direct: list[dict[str, float]] = []
    tier: list[dict[str, float]] = []
    tier_ch: list[dict[str, float]] = []
    tier_n: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            direct.append(round_direct(single, args.nodes, args.trajectories, r))
            print(f"A direct  {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in direct[-1].items()))
            tier.append(round_cluster(cluster, args.trajectories, r))
            print(f"B cluster {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in tier[-1].items()))
            if chdb is not None:
                tier_ch.append(round_cluster(chdb, args.trajectories, r))
                print(f"C cluster, gateway on chDB {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in tier_ch[-1].items()))
            if several is not None:
                tier_n.append(round_cluster(several, args.trajectories, r))
                print(f"D cluster, {args.gateways} gateways {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in tier_n[-1].items()))
    finally:
        if several is not None:
            several.stop()
        if chdb is not None:
            chdb.stop()
        cluster.stop()
        single.terminate()
    print(f"load at end: {os.getloadavg()}")

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print("RATIOS")
    print(f"  spans/s to queryable: gateway fed by {args.nodes} nodes {med(tier, 'queryable_rate'):.0f} / one collector fed "
          f"directly {med(direct, 'queryable_rate'):.0f} = {med(tier, 'queryable_rate') / med(direct, 'queryable_rate'):.2f}")
    print(f"  spans/s acknowledged: {args.nodes} nodes {med(tier, 'acked_rate'):.0f} / one collector {med(direct, 'acked_rate'):.0f}"
          f" = {med(tier, 'acked_rate') / med(direct, 'acked_rate'):.2f}")
    print(f"  gateway queryable {med(tier, 'behind_s'):.2f} s after the last node acknowledgement (keeps up when ~0)")
    print(f"  CPU-s per 1,000 spans: gateway {med(tier, 'gateway_cpu_per_1k'):.3f}, nodes (all) {med(tier, 'nodes_cpu_per_1k'):.3f},"
          f" one collector {med(direct, 'cpu_per_1k'):.3f}; gateway / one collector = "
          f"{med(tier, 'gateway_cpu_per_1k') / med(direct, 'cpu_per_1k'):.2f}")
    if tier_ch:
        print(f"  gateway on chDB / on SQLite: spans/s to queryable {med(tier_ch, 'queryable_rate'):.0f} / "
              f"{med(tier, 'queryable_rate'):.0f} = {med(tier_ch, 'queryable_rate') / med(tier, 'queryable_rate'):.2f}; "
              f"gateway CPU-s per 1,000 spans {med(tier_ch, 'gateway_cpu_per_1k'):.3f} / {med(tier, 'gateway_cpu_per_1k'):.3f} = "
              f"{med(tier_ch, 'gateway_cpu_per_1k') / med(tier, 'gateway_cpu_per_1k'):.2f}; queryable "
              f"{med(tier_ch, 'behind_s'):.2f} s after the last node acknowledgement")

    if tier_n:
        print(f"  {args.gateways} gateways / one: spans/s to queryable {med(tier_n, 'queryable_rate'):.0f} / "
              f"{med(tier, 'queryable_rate'):.0f} = {med(tier_n, 'queryable_rate') / med(tier, 'queryable_rate'):.2f}; "
              f"gateways' CPU-s per 1,000 spans together {med(tier_n, 'gateway_cpu_per_1k'):.3f} / "
              f"{med(tier, 'gateway_cpu_per_1k'):.3f} = {med(tier_n, 'gateway_cpu_per_1k') / med(tier, 'gateway_cpu_per_1k'):.2f}; "
              f"nodes' {med(tier_n, 'nodes_cpu_per_1k'):.3f} / {med(tier, 'nodes_cpu_per_1k'):.3f} = "
              f"{med(tier_n, 'nodes_cpu_per_1k') / med(tier, 'nodes_cpu_per_1k'):.2f}; the busiest gateway's share "
              f"{med(tier_n, 'largest_share'):.2f}; queryable {med(tier_n, 'behind_s'):.2f} s after the last acknowledgement")


if __name__ == "__main__":
    main()
