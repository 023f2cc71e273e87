"""What answering for several gateways costs (``TRACECAR_GATEWAY_PEERS``): a merged read against one gateway's own.

Starts two gateway processes on 127.0.0.1 listing each other, feeds each ``--trajectories`` of its own
(5 spans each, several steps), then times, alternating per request (ABAB), each read merged over both
gateways and the same read of one gateway's own store (``scope=local``): a first list page (50 rows,
by reward), a deep page (offset 2,000), one step's groups, one trajectory's tree (held by the other
gateway, against its own gateway's local answer). Prints medians (ms) and the ratio.

    .venv/bin/python bench/federation.py [--trajectories 5000] [--reads 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cluster import trajectory  # noqa: E402
from tests.support.cluster import process_collector, wait_until  # noqa: E402
from tests.support.processes import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=5000, help="per gateway")
    parser.add_argument("--reads", type=int, default=40, help="requests per read and mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracecar-federation-") as tmp:
        ports = [free_port(), free_port()]
        peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
        gateways = [process_collector(Path(tmp) / f"gw{i}", port=p, role="gateway", gateway_peers=peers,
                                      log_level="warning").start() for i, p in enumerate(ports)]
        try:
            held: list[list[str]] = [[], []]
            with httpx.Client(timeout=60) as client:
                for i, gw in enumerate(gateways):
                    for n in range(0, args.trajectories, 50):
                        spans = [s for k in range(n, min(n + 50, args.trajectories))
                                 for s in trajectory(f"{i:x}" * 16, k, f"exp{i}", "w")]
                        r = client.post(gw.url + "/v1/spans", json={"v": 1, "worker": "w", "spans": spans})
                        assert r.status_code == 200, r.text
                        held[i] += [s["trace_id"] for s in spans if s["parent_id"] is None]
                for gw in gateways:
                    wait_until(lambda gw=gw: client.get(gw.url + "/v1/trajectories", params={"limit": 1, "scope": "local"})
                               .json()["total"] == args.trajectories, 300, "every trajectory listed")
                reads: dict[str, tuple[str, dict[str, Any], str, dict[str, Any]]] = {
                    "list, first page": ("/v1/trajectories", {"limit": 50, "sort": "reward"}, "/v1/trajectories",
                                         {"limit": 50, "sort": "reward"}),
                    "list, offset 2,000": ("/v1/trajectories", {"limit": 50, "offset": 2000, "sort": "start"},
                                           "/v1/trajectories", {"limit": 50, "offset": 2000, "sort": "start"}),
                    "one step's groups": ("/v1/groups", {"experiment": "exp1", "step": 3}, "/v1/groups",
                                          {"experiment": "exp0", "step": 3}),
                    "one trajectory (held by the other)": (f"/v1/trajectories/{held[1][7]}", {},
                                                           f"/v1/trajectories/{held[0][7]}", {}),
                }
                print(f"two gateways, {args.trajectories:,} trajectories each; medians of {args.reads}, alternating")
                for name, (merged_path, merged_params, own_path, own_params) in reads.items():
                    ms: dict[str, list[float]] = {"merged": [], "own": []}
                    for n in range(args.reads):
                        order = (("merged", merged_path, merged_params), ("own", own_path, {**own_params, "scope": "local"}))
                        for mode, path, params in order if n % 2 == 0 else order[::-1]:
                            t0 = time.perf_counter()
                            r = client.get(gateways[0].url + path, params=params)
                            ms[mode].append((time.perf_counter() - t0) * 1000)
                            assert r.status_code == 200, (path, r.text[:200])
                    a, b = statistics.median(ms["merged"]), statistics.median(ms["own"])
                    print(f"  {name}: merged {a:.1f} ms, one gateway's own {b:.1f} ms: {a / b:.2f}x")
        finally:
            for gw in gateways:
                gw.terminate()


if __name__ == "__main__":
    main()
