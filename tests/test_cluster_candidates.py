"""A node that sends its gateway candidates only, SIGKILLed while it holds a step (issue 26, item 2).

The node holds the step's spans in its durable spool until its own view of the step closes; killed
before that, it has forwarded nothing of the step. Restarted on the same data dir, it rebuilds the
held step from its spool (and the gateway's budgets it learned, ``gateway-budgets.json``), closes
it, and forwards its candidates once. The gateway's decisions still equal one collector's, and
it received each of the node's candidates' spans exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.cluster_workload import EXPERIMENTS, PER_STEP, STEPS, TAIL_BUDGETS, kept_set, node_of, workload
from tests.support.cluster import process_collector, start_cluster, wait_until
from tests.support.collector import scrape_metric
from tests.test_cluster_budgets import CANDIDATES, NODES, decided, feed

pytestmark = pytest.mark.timeout(300)
HOLD_S = 20  # the nodes' TRACECAR_STEP_IDLE_S: the last step stays held that long without spans


def test_a_node_killed_while_holding_a_step_forwards_its_candidates_once(tmp_path: Path) -> None:
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    cluster = start_cluster(tmp_path, NODES, gateway=TAIL_BUDGETS, node={"step_idle_s": HOLD_S})
    victim = cluster.nodes[1]
    try:
        wait_until(lambda: (tmp_path / "node1" / "gateway-budgets.json").exists(), 30, "the node learned the budgets")
        feed(single.url, cluster)
        wait_until(lambda: decided(single.url), 120, "the single collector decided every step")
        # step 1 closed on the node (its workers moved on) and went out; step 2 is held
        wait_until(lambda: cluster.owed(victim) == 0 and all(
            kept_set(victim.url, e, 1) for e in CANDIDATES), 60, "the node forwarded step 1")
        last = STEPS[-1]
        holding = httpx.get(victim.url + "/v1/decisions", params={"experiment": "exp-topk", "step": last}, timeout=30).json()
        assert holding["decisions"] == [] and holding["open"], holding
        assert cluster.held(victim) > 0
        victim.kill()  # SIGKILL: what it acknowledged is in its spool, held

        victim.env["TRACECAR_STEP_IDLE_S"] = "2"
        victim.start()
        cluster.wait_drained(90)
        wait_until(lambda: decided(cluster.gateway.url), 120, "the gateway decided every step")
        for experiment in EXPERIMENTS:
            for step in STEPS:
                assert kept_set(cluster.gateway.url, experiment, step) == kept_set(single.url, experiment, step), (experiment, step)

        # the victim's candidates of the held step reached the gateway, once each (spans counted as received)
        mine = [t for t in workload() if node_of(t.worker, NODES) == 1]
        sent = {trace for e in CANDIDATES for s in STEPS for trace, (keep, _) in kept_set(victim.url, e, s).items() if keep}
        assert sent and all(kept_set(victim.url, e, last) for e in CANDIDATES)
        others = [t for t in mine if t.experiment not in CANDIDATES]
        received = scrape_metric(cluster.gateway.url, "tracecar_gateway_spans_received_total", node="node1")
        assert received == 5 * (len(others) + len(sent)), (received, len(others), len(sent))
        assert len(sent) < len([t for t in mine if t.experiment in CANDIDATES])  # not everything: candidates only
        assert json.loads((tmp_path / "node1" / "gateway-budgets.json").read_text())["experiments"].keys() >= set(CANDIDATES)
        assert all(len(kept_set(cluster.gateway.url, e, s)) == PER_STEP for e in EXPERIMENTS for s in STEPS)
    finally:
        cluster.stop()
        single.terminate()
