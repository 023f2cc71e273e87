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


def rollouts_of_steps(rollouts: list[tuple[int, int, int, float]]) -> dict[str, Any]:
    """Runs in a Ray worker: (step, sample, rollout, reward) trajectories to this node's collector."""
    import tracecar.client as tc
    from tracecar.client import ray_collectors as rc
    from tracecar.client import tracer

    tracer.configure(url=rc.node_local_url(), flush_interval_s=0.02, experiment="ray-gateways")

    @tc.rollout_trace_op
    def generate(prompt: str) -> dict[str, Any]:
        return {"response_text": prompt[::-1]}

    for step, sample, rollout, reward in rollouts:
        with tc.rollout_trace_attr(step=step, sample_index=sample, rollout_n=rollout, name="agent_loop") as traj:
            generate(f"prompt {step} {sample}")
        tc.annotate(traj, reward=reward)
    flushed = tc.flush(30)
    tracer.shutdown(10)
    return {"node_id": ray.get_runtime_context().get_node_id(), "flushed": flushed}


def test_several_gateways_one_a_node_each_decide_their_steps(ray_nodes: Any, tmp_path: Path) -> None:
    """``start_gateways(2)`` puts a gateway on the head node and one on the next; the node collectors list
    both, and each step (its groups split over the three nodes) is decided whole by the one that owns it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tracecar.collector.exporters.gateway_route import owner, route_key

    budget = {"max_groups_per_step": 1, "keep_spread_groups": 1, "keep_reward_extremes": 0, "keep_errors_share": 0,
              "trajectories_per_step": PROMPTS * ROLLOUT_N, "reward_wait_s": 60}
    gateways = ray_collectors.start_gateways(2, port=0, settings=budget, data_dir=str(tmp_path / "gateway{index}"))
    nodes = ray_collectors.start_node_collectors(port=0, gateway=gateways, data_dir=str(tmp_path / "{node_id}"),
                                                 settings={"forward_retry_max_s": 2})
    try:
        head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        assert gateways[0].info["node_id"] == head and gateways[1].info["node_id"] != head
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert {"tracecar-gateway", "tracecar-gateway-1"} <= named
        urls = [g.url for g in gateways]
        owners = {step: owner(route_key("ray-gateways", False, step) or "", urls) for step in range(1, 40)}
        steps = [next(s for s, i in owners.items() if i == 0), next(s for s, i in owners.items() if i == 1)]
        task = ray.remote(num_cpus=0)(rollouts_of_steps)
        refs = []
        for r, node_id in enumerate(sorted(nodes.infos)):  # rollout r of every prompt of both steps on node r
            mine = [(step, s, r, float((s * 7 + r * 3) % 5) / 4 if s % 3 else 1.0) for step in steps for s in range(PROMPTS)]
            refs.append(task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(mine))
        assert all(x["flushed"] for x in ray.get(refs, timeout=120))

        def decisions(url: str, step: int) -> dict[str, Any]:
            return httpx.get(url + "/v1/decisions", params={"experiment": "ray-gateways", "step": step}, timeout=10).json()

        for step in steps:
            mine, other = urls[owners[step]], urls[1 - owners[step]]
            deadline = time.monotonic() + 90
            while len(decisions(mine, step)["decisions"]) < PROMPTS * ROLLOUT_N and time.monotonic() < deadline:
                time.sleep(0.3)
            decided = decisions(mine, step)
            assert len(decided["decisions"]) == PROMPTS * ROLLOUT_N and decided["kept"] == ROLLOUT_N, (step, decided)
            assert decisions(other, step)["decisions"] == []  # nothing of the step at the other gateway
            groups = httpx.get(mine + "/v1/groups", params={"experiment": "ray-gateways", "step": step}, timeout=10).json()
            assert [g["n"] for g in groups["groups"]] == [ROLLOUT_N]  # whole, across the three nodes
    finally:
        stopped = nodes.shutdown(timeout_s=30)
        gateways_stopped = [g.shutdown(timeout_s=30) for g in gateways]
    assert all(s.get("clean") and s.get("left_in_spool") == 0 for s in stopped.values()), stopped
    assert all(g.get("clean") for g in gateways_stopped), gateways_stopped
