"""Several gateways: nodes route each step to one of them, and the budgets stay exact (issue 26).

Four node collectors list two gateways (``TRACECAR_GATEWAY_URL=a,b``); each routes a span by its
trajectory's (experiment, validate, step) with rendezvous hashing, so a step — and every GRPO group
in it, split over nodes — reaches one gateway whole, and the reward annotations follow their
trajectories. The same VERL-shaped workload (tests/cluster_workload.py) goes to one collector that
sees everything: each step's decisions, kept set and groups at its owning gateway equal that
collector's, the other gateway has nothing of the step, and the two gateways' lists together are
the single collector's. Every process has its own data dir on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.cluster_workload import EXPERIMENTS, PER_STEP, STEPS, TAIL_BUDGETS, kept_set, node_of, post, workload
from tests.support.cluster import Cluster, process_collector, start_cluster, wait_until
from tests.support.collector import scrape_metric
from tests.support.processes import free_port
from tests.test_cluster_budgets import NODES, feed, groups, listed
from tracecar.collector.exporters.gateway_route import owner, route_key

pytestmark = pytest.mark.timeout(300)


def owners(urls: list[str]) -> dict[tuple[str, int], int]:
    """Which gateway (index in ``urls``) owns each step of the workload, as every node computes it."""
    return {(e, s): owner(route_key(e, False, s), urls) for e in EXPERIMENTS for s in STEPS}


def two_gateway_ports() -> tuple[int, int]:
    """Two free ports whose gateways each own some of the workload's steps (the URLs are the hash's input)."""
    first = free_port()
    for _ in range(200):
        second = free_port()
        if second != first and len(set(owners([f"http://127.0.0.1:{p}" for p in (first, second)]).values())) == 2:
            return first, second
    raise AssertionError("no pair of ports splits the steps between two gateways")


def step_decided(url: str, experiment: str, step: int) -> bool:
    answer = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": step}, timeout=30).json()
    return len(answer["decisions"]) == PER_STEP and not answer["open"]


def test_two_gateways_each_decide_their_steps_exactly_as_one_collector(tmp_path: Path) -> None:
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    ports = two_gateway_ports()
    cluster: Cluster = start_cluster(tmp_path, NODES, gateway=TAIL_BUDGETS, gateways=2, start=False)
    for gw, port in zip(cluster.gateways, ports):  # the ports chosen so that both gateways own steps
        gw.url = f"http://127.0.0.1:{port}"
        gw.env["TRACECAR_PORT"] = str(port)
    urls = [g.url for g in cluster.gateways]
    for n in cluster.nodes:
        n.env["TRACECAR_GATEWAY_URL"] = ",".join(urls)
    try:
        for pc in cluster.all:
            pc.start()
        feed(single.url, cluster)
        own = owners(urls)
        for experiment, step in own:
            wait_until(lambda: step_decided(single.url, experiment, step), 120, f"single decided {experiment} {step}")
        cluster.wait_drained()
        for (experiment, step), i in own.items():
            wait_until(lambda: step_decided(urls[i], experiment, step), 120, f"gateway {i} decided {experiment} {step}")
        for (experiment, step), i in own.items():
            want = kept_set(single.url, experiment, step)
            assert kept_set(urls[i], experiment, step) == want, (experiment, step)
            assert kept_set(urls[1 - i], experiment, step) == {}, (experiment, step)  # nothing of it on the other
            kept = sorted(t for t, (keep, _) in want.items() if keep)
            assert listed(urls[i], experiment=experiment, step=step) == kept
            assert listed(urls[1 - i], experiment=experiment, step=step) == []
            assert groups(urls[i], experiment, step) == groups(single.url, experiment, step)  # whole, rewards and all
        everything = listed(single.url)
        parts = [listed(u) for u in urls]
        assert parts[0] and parts[1] and sorted(parts[0] + parts[1]) == everything
        # each node heard from both, and delivered to each only its share: the forwarded counters add up
        for n in cluster.nodes:
            per_gateway = [scrape_metric(n.url, "tracecar_spans_forwarded_total", exporter="gateway@" + u.split("//", 1)[1])
                           for u in urls]
            assert all(c > 0 for c in per_gateway), (n.url, per_gateway)
        received = [sum(scrape_metric(u, "tracecar_gateway_spans_received_total", node=n.env["TRACECAR_NODE_NAME"])
                        for n in cluster.nodes) for u in urls]
        forwarded = [sum(scrape_metric(n.url, "tracecar_spans_forwarded_total", exporter="gateway@" + u.split("//", 1)[1])
                         for n in cluster.nodes) for u in urls]
        assert received == forwarded, (received, forwarded)  # nothing sent to a gateway that does not own it
        trainer_annotations_follow_their_route(cluster, urls, own)
    finally:
        cluster.stop()
        single.terminate()



def trainer_annotations_follow_their_route(cluster: Cluster, urls: list[str], own: dict[tuple[str, int], int]) -> None:
    """VERL's trainer annotates from the driver's node, which holds none of the trajectories: the route VERL's
    batch carries beside each id (``tracecar_route``) takes the annotation to the trajectory's gateway — chosen
    here where the trace id alone would hash to the other one — and is not stored as an attribute."""
    chosen = []
    for t in workload():
        owner_of_step = own[(t.experiment, t.step)]
        if t.experiment in ("exp-traj", "exp-group") and owner(f"trace:{t.spans[0]['trace_id']}", urls) != owner_of_step and \
                kept_set(urls[owner_of_step], t.experiment, t.step).get(t.spans[0]["trace_id"], (False,))[0]:
            chosen.append(t)
    assert chosen, "kept trajectories whose trace id alone would go to the wrong gateway"
    chosen = chosen[:8]
    with httpx.Client() as client:
        for t in chosen:
            trace_id = t.spans[0]["trace_id"]
            route = orjson.dumps([t.experiment, False, t.step]).decode()
            driver = cluster.nodes[(node_of(t.worker, NODES) + 1) % NODES]  # not the node that holds it
            post(client, driver.url, "trainer", [{
                "span_id": f"{trace_id}-trainer", "trace_id": trace_id, "parent_id": None, "name": "annotation",
                "kind": "annotation", "start_time": 1.0, "end_time": 1.0,
                "attributes": {"trained_on_version": 99, "tracecar_route": route}}])

    def arrived(t: Any) -> bool:
        gateway = urls[own[(t.experiment, t.step)]]
        trace_id = t.spans[0]["trace_id"]
        page = httpx.get(gateway + "/v1/trajectories", params={"experiment": t.experiment, "step": t.step, "limit": 1000},
                         timeout=30).json()
        row = next(r for r in page["trajectories"] if r["trace_id"] == trace_id)
        detail = httpx.get(f"{gateway}/v1/trajectories/{trace_id}", timeout=30).text
        assert "tracecar_route" not in detail
        return row.get("trained_on_version") == 99

    for t in chosen:
        wait_until(lambda: arrived(t), 60, f"the trainer's annotation of {t.spans[0]['trace_id']} at its gateway")
