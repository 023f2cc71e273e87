"""Node collectors and a gateway on a multi-node Ray cluster (issue 26, stage C).

``ray.cluster_utils.Cluster`` is Ray's own way to test several nodes on one machine: a head and
two more raylets, each a node with its own node id. ``start_gateway`` puts the gateway collector
on the head node (bound to the node's address), ``start_node_collectors(gateway=...)`` one node
collector per node (loopback, each its own port and data dir here, since the three "nodes" share
one loopback); a traced Ray task pinned to each node sends GRPO groups through its node's
collector, and the gateway decides one tail budget over all of them, with every group whole.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:
    ray = None

from tracecar.client import ray_collectors  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
NODES, PROMPTS, ROLLOUT_N = 3, 6, 3


@pytest.fixture(scope="module")
def ray_nodes() -> Any:
    if ray is None:
        pytest.skip("ray is not installed (pip install 'tracecar[ray]')")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="tracecar-cluster-test", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def rollouts_on_this_node(rollouts: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Runs in a Ray worker: traces (sample, rollout, reward) trajectories to this node's collector."""
    import tracecar.client as tc
    from tracecar.client import ray_collectors as rc
    from tracecar.client import tracer

    url = rc.node_local_url()
    tracer.configure(url=url, flush_interval_s=0.02, experiment="ray-cluster")

    @tc.rollout_trace_op
    def generate(prompt: str) -> dict[str, Any]:
        return {"response_text": prompt[::-1]}

    for sample, rollout, reward in rollouts:
        with tc.rollout_trace_attr(step=1, sample_index=sample, rollout_n=rollout, name="agent_loop") as traj:
            generate(f"prompt {sample}")
        tc.annotate(traj, reward=reward)
    flushed = tc.flush(30)
    tracer.shutdown(10)
    return {"node_id": ray.get_runtime_context().get_node_id(), "url": url, "flushed": flushed}


def test_node_collectors_feed_a_gateway_on_the_head_node(ray_nodes: Any, tmp_path: Path) -> None:
    budget = {"max_groups_per_step": 2, "keep_spread_groups": 1, "keep_reward_extremes": 0, "keep_errors_share": 0,
              "trajectories_per_step": PROMPTS * ROLLOUT_N, "reward_wait_s": 60}
    gateway = ray_collectors.start_gateway(port=0, settings=budget, data_dir=str(tmp_path / "gateway"))
    nodes = ray_collectors.start_node_collectors(port=0, gateway=gateway, data_dir=str(tmp_path / "{node_id}"),
                                                 settings={"forward_retry_max_s": 2})
    try:
        head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        assert gateway.info["node_id"] == head
        assert len(nodes.infos) == NODES and len({i["data_dir"] for i in nodes.infos.values()}) == NODES
        # the rollouts of a group are spread over the nodes (rollout r of every prompt runs on node r)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0)(rollouts_on_this_node)
        node_ids = sorted(nodes.infos)
        refs = []
        for r, node_id in enumerate(node_ids):
            mine = [(s, r, float((s * 7 + r * 3) % 5) / 4 if s % 3 else 1.0) for s in range(PROMPTS)]
            refs.append(task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(mine))
        ran = ray.get(refs, timeout=120)
        assert sorted(x["node_id"] for x in ran) == node_ids and all(x["flushed"] for x in ran)
        assert {x["url"] for x in ran} == set(nodes.urls.values())

        deadline = time.monotonic() + 90
        while True:
            decided = httpx.get(gateway.url + "/v1/decisions", params={"experiment": "ray-cluster", "step": 1}, timeout=10).json()
            if len(decided["decisions"]) == PROMPTS * ROLLOUT_N or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert len(decided["decisions"]) == PROMPTS * ROLLOUT_N, decided
        assert decided["kept"] == 2 * ROLLOUT_N  # two whole groups across the job, not two per node
        groups = httpx.get(gateway.url + "/v1/groups", params={"experiment": "ray-cluster", "step": 1}, timeout=10).json()
        assert len(groups["groups"]) == 2 and all(g["n"] == ROLLOUT_N for g in groups["groups"])
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        for node_id in node_ids:  # each node forwarded under its node id
            assert f'tracecar_gateway_spans_received_total{{node="{node_id}"}}' in metrics
    finally:
        stopped = nodes.shutdown(timeout_s=30)
        gateway_stopped = gateway.shutdown(timeout_s=30)
    assert all(s.get("clean") and s.get("left_in_spool") == 0 for s in stopped.values()), stopped
    assert gateway_stopped.get("clean"), gateway_stopped
