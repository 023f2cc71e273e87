"""The cluster tier, really started: a gateway and node collectors, each its own process and data dir.

``start_cluster`` runs ``python -m tracecar.collector`` once as ``TRACECAR_ROLE=gateway`` and N
times as nodes with ``TRACECAR_GATEWAY_URL`` set, all on 127.0.0.1; ``Cluster.stop`` stops them.
Nothing here imports pytest (bench scripts may use it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.collector import ProcessCollector, collector_env, metric_value, scrape_metric
from tests.support.processes import free_port, stop_process


def process_collector(data_dir: Path, port: int | None = None, **settings: Any) -> ProcessCollector:
    """A collector process (not started) on 127.0.0.1 with its own data dir and ``settings`` (TRACECAR_* names or
    setting names; see collector_env)."""
    port = port or free_port()
    return ProcessCollector(url=f"http://127.0.0.1:{port}", env=collector_env(port, data_dir, **settings))


@dataclass
class Cluster:
    gateway: ProcessCollector
    nodes: list[ProcessCollector] = field(default_factory=list)
    more_gateways: list[ProcessCollector] = field(default_factory=list)  # the second and later of several

    @property
    def gateways(self) -> list[ProcessCollector]:
        return [self.gateway, *self.more_gateways]

    @property
    def all(self) -> list[ProcessCollector]:
        return [*self.gateways, *self.nodes]

    def stop(self) -> None:
        for pc in self.all:
            if pc.proc is not None and pc.proc.poll() is None:
                stop_process(pc.proc, grace_s=20)

    def owed(self, node: ProcessCollector) -> float:
        """Spans a node still owes its gateway(s) (their delivery cursors' backlogs)."""
        text = httpx.get(node.url + "/metrics", timeout=10).text
        if len(self.gateways) == 1:
            return metric_value(text, "tracecar_exporter_pending", exporter="gateway")
        return sum(metric_value(text, "tracecar_exporter_pending", exporter="gateway@" + g.url.split("//", 1)[1])
                   for g in self.gateways)

    def held(self, node: ProcessCollector) -> float:
        """Spans a node holds until its view of their step closes (sending its gateway candidates only)."""
        return scrape_metric(node.url, "tracecar_held_spans")

    def wait_drained(self, timeout: float = 60.0) -> None:
        """Until every node has delivered everything to the gateway (and holds nothing back)."""
        wait_until(lambda: all(self.owed(n) == 0 and self.held(n) == 0 for n in self.nodes
                               if n.proc is not None and n.proc.poll() is None), timeout, "nodes drained to the gateway")


def start_cluster(root: Path, nodes: int, gateway: dict[str, Any] | None = None, node: dict[str, Any] | None = None,
                  start: bool = True, gateways: int = 1) -> Cluster:
    """A gateway (data dir ``root/gateway``) and ``nodes`` node collectors (``root/node<i>``) feeding it
    (``gateways`` > 1: that many gateways, ``root/gateway<i>`` from the second, every node listing all).

    The nodes close a step they hold (sending the gateway candidates only) after 2 s without spans
    (``TRACECAR_STEP_IDLE_S``; the workload's last step has no next one), unless ``node`` says otherwise."""
    gw = process_collector(root / "gateway", role="gateway", log_level="warning", **(gateway or {}))
    cluster = Cluster(gw)
    for i in range(1, gateways):
        cluster.more_gateways.append(process_collector(root / f"gateway{i}", role="gateway", log_level="warning",
                                                       **(gateway or {})))
    urls = ",".join(g.url for g in cluster.gateways)
    for i in range(nodes):
        cluster.nodes.append(process_collector(root / f"node{i}", role="node", gateway_url=urls, node_name=f"node{i}",
                                               log_level="warning", forward_retry_max_s=2,
                                               **{"step_idle_s": 2, **(node or {})}))
    if start:
        try:
            for pc in cluster.all:
                pc.start()
        except BaseException:
            cluster.stop()
            raise
    return cluster


def wait_until(check: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"not reached within {timeout}s: {what}")
