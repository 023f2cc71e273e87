"""A node that falls behind holds its steps open at the gateway (issue 26: budgets exact under faults).

Without a ``count`` (``TRACECAR_TRAJECTORIES_PER_STEP``) a step closes on ``next_step``: once every
worker that sent spans of it has started a later step. One collector sees every worker as it
sends; a gateway sees a worker only once its node forwarded it. Here a node is restarted
pointed at nowhere (it acknowledges its workers' spans but delivers none, and stops reporting):
the other nodes' workers move on to the next step, and the gateway must still not decide the step
without the silent node's trajectories (service/roles.py NodeMarks). Once the node is back, the
gateway decides every step exactly as one collector fed directly.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster_workload import EXPERIMENTS, STEPS, TAIL_BUDGETS, WORKERS, batches, kept_set, node_of, post, trajectory, workload
from tests.support import free_port
from tests.support.cluster import process_collector, start_cluster, wait_until
from tests.test_cluster_budgets import NODES, decided

pytestmark = pytest.mark.timeout(300)
BUDGETS = {k: v for k, v in TAIL_BUDGETS.items() if k != "trajectories_per_step"}  # steps close on next_step


def sentinels() -> list[tuple[str, list[dict]]]:
    """A step-3 trajectory per worker and experiment: every worker moves on past step 2."""
    rng = random.Random(3)
    out = []
    for w in range(WORKERS):
        for e in EXPERIMENTS:
            t = trajectory(e, 3, 100 + w, 0, f"w{w}", rng, 0.0, 0.0)
            out.append((t.worker, [*t.spans, t.reward]))
    return out


def closed_by(url: str, experiment: str, step: int) -> set[str]:
    answer = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": step}, timeout=30).json()
    return {d["closed_by"] for d in answer["decisions"]}


def test_a_lagging_node_holds_its_steps_open_until_it_delivers(tmp_path: Path) -> None:
    plan = [*batches(workload()), *sentinels()]
    single = process_collector(tmp_path / "single", log_level="warning", **BUDGETS).start()
    cluster = start_cluster(tmp_path, NODES, gateway=BUDGETS, node={"gateway_heartbeat_s": 0.2})
    gw = cluster.gateway.url
    try:
        with httpx.Client() as client:
            for worker, spans in plan:
                post(client, single.url, worker, spans)
        wait_until(lambda: decided(single.url), 60, "the single collector decided steps 1 and 2")
        assert {c for e in EXPERIMENTS for s in STEPS for c in closed_by(single.url, e, s)} == {"next_step"}
        wait_until(lambda: len(httpx.get(gw + "/v1/cluster/nodes").json()["nodes"]) == NODES, 30, "every node reported")

        lagging = cluster.nodes[1]  # restarted pointed at nowhere: acknowledges, delivers nothing, reports nothing
        lagging.terminate()
        right_url = lagging.env["TRACECAR_GATEWAY_URL"]
        lagging.env["TRACECAR_GATEWAY_URL"] = f"http://127.0.0.1:{free_port()}"
        lagging.start()
        # the gateway takes a node heard from within TRACECAR_NODE_SILENT_S as of its last report: wait until
        # this one counts as silent, as a node down for longer than a heartbeat would
        wait_until(lambda: httpx.get(gw + "/v1/cluster/nodes").json()["nodes"]["node1"]["heard_s_ago"] > 3.5, 30,
                   "the lagging node counts as silent")
        with httpx.Client() as client:
            for worker, spans in plan:
                post(client, cluster.nodes[node_of(worker, NODES)].url, worker, spans)
        for node in cluster.nodes:
            if node is not lagging:
                wait_until(lambda node=node: cluster.owed(node) == 0, 60, "the other nodes delivered")
        owed = cluster.owed(lagging)
        assert owed > 0
        time.sleep(3)  # ticks enough for next_step: every worker the gateway knows has moved on
        for experiment in EXPERIMENTS:
            answer = httpx.get(gw + "/v1/decisions", params={"experiment": experiment, "step": 1}, timeout=30).json()
            assert answer["decisions"] == [] and answer["open"], (experiment, answer["decisions"][:2])
        nodes = httpx.get(gw + "/v1/cluster/nodes").json()["nodes"]
        assert nodes["node1"]["heard_s_ago"] > 2 and all(nodes[f"node{i}"]["heard_s_ago"] < 2 for i in (0, 2, 3))

        lagging.terminate()  # back, pointed right: it delivers, the steps close
        lagging.env["TRACECAR_GATEWAY_URL"] = right_url
        lagging.start()
        cluster.wait_drained(60)
        wait_until(lambda: decided(gw), 60, "the gateway decided steps 1 and 2")
        for experiment in EXPERIMENTS:
            for step in STEPS:
                assert kept_set(gw, experiment, step) == kept_set(single.url, experiment, step), (experiment, step)
                assert closed_by(gw, experiment, step) == {"next_step"}
        assert json.loads((tmp_path / "gateway" / "cluster-nodes.json").read_text()).keys() == {f"node{i}" for i in range(NODES)}
    finally:
        cluster.stop()
        single.terminate()
