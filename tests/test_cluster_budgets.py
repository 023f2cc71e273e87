"""Global budgets exactly equal to one collector that saw everything (issue 26, stage B).

The same VERL-shaped workload (tests/cluster_workload.py: 10 prompts × 4 rollouts over 8 workers,
so most GRPO groups are split across workers and nodes) runs through one collector and through
four node collectors and a gateway, each its own process and data dir on 127.0.0.1. Every tail
rule is on: N per step with error, best/worst and spread quotas (``exp-traj``), whole groups per
step (``exp-group``), a uniform choice (``exp-uniform``: the seeded hash fill alone), N per step
with error and best/worst quotas alone (``exp-topk``). The decisions, the kept sets and the GRPO
groups (stats, advantages, all-equal flags) must be equal.

The last two decompose (docs/cluster.md, *Sending candidates only*): each node holds a step until
its own view of it closes and forwards only its candidates (each rule's local top-k), so the
gateway gets at most nodes × (the rules' k) trajectories of a step, and never the rest; its kept
set, rules and stamped chances are still one collector's.
The gateway keeps its read store in ClickHouse (embedded chDB, ``TRACECAR_STORE=clickhouse``), the
single collector in SQLite: its lists, searches, per-step health and exports must be equal too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.cluster_workload import EXPERIMENTS, PER_STEP, ROLLOUT_N, STEPS, TAIL_BUDGETS, batches, kept_set, node_of, post, workload
from tests.support.cluster import Cluster, process_collector, start_cluster, wait_until
from tests.support.collector import scrape_metric

pytestmark = pytest.mark.timeout(300)
NODES = 4
#: experiments whose budget decomposes: at most this many candidates per node and step (the union of the rules'
#: local top-k: fill k, errors ceil(share × k), best and worst)
CANDIDATES = {"exp-uniform": 4, "exp-topk": 3 + 1 + 1 + 1}


def not_sent(cluster: Cluster, experiment: str, step: int) -> int:
    """Trajectories of a step the nodes kept to themselves (decided not candidates)."""
    return sum(1 for n in cluster.nodes for _, why in kept_set(n.url, experiment, step).values() if why == "not_candidate")


def decided(url: str, headers: dict[str, str] | None = None) -> bool:
    """Every step of every experiment decided (all its trajectories have a decision, no round open)."""
    for experiment in EXPERIMENTS:
        for step in STEPS:
            answer = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": step}, headers=headers,
                               timeout=30).json()
            if len(answer["decisions"]) != PER_STEP or answer["open"]:
                return False
    return True


def groups(url: str, experiment: str, step: int, **params: Any) -> dict[str, Any]:
    answer = httpx.get(url + "/v1/groups", params={"experiment": experiment, "step": step, "limit": 1000, **params},
                       timeout=30).json()
    answer.pop("index", None)  # the viewer index's own progress, not the answer
    return answer


def listed(url: str, **params: Any) -> list[str]:
    page = httpx.get(url + "/v1/trajectories", params={"limit": 1000, "sort": "start", **params}, timeout=30).json()
    return sorted(t["trace_id"] for t in page["trajectories"])


def feed(single_url: str | None, cluster: Cluster | None) -> None:
    """Each worker's batches in VERL's order: to the single collector, and to the worker's node."""
    with httpx.Client() as client:
        for worker, spans in batches(workload()):
            if single_url is not None:
                post(client, single_url, worker, spans)
            if cluster is not None:
                post(client, cluster.nodes[node_of(worker, NODES)].url, worker, spans)


def assert_same_as_single(single_url: str, gateway_url: str, cluster: Cluster | None = None) -> None:
    """Decisions, kept sets and groups equal; groups whole at the gateway. With ``cluster``: the gateway of
    the experiments that decompose got each node's candidates only, at most nodes × k a step."""
    for experiment in EXPERIMENTS:
        for step in STEPS:
            want = kept_set(single_url, experiment, step)
            got = kept_set(gateway_url, experiment, step)
            assert got == want, (experiment, step)  # the trajectories nodes kept to themselves too (their summaries)
            if cluster is not None and experiment in CANDIDATES:  # ... but their spans never reached the gateway
                sent = len(got) - not_sent(cluster, experiment, step)
                assert sent <= NODES * CANDIDATES[experiment] < PER_STEP, (experiment, step, sent)
            kept = sorted(t for t, (keep, _) in want.items() if keep)
            assert kept and len(kept) < PER_STEP  # the budget chose
            assert listed(gateway_url, experiment=experiment, step=step) == kept
            assert groups(gateway_url, experiment, step) == groups(single_url, experiment, step)
    rules = {rule for e in EXPERIMENTS for s in STEPS for keep, rule in kept_set(single_url, e, s).values() if keep}
    assert {"error", "reward_max", "reward_min", "reward_spread", "fill"} <= rules  # every rule took part
    reasons = {reason for e in EXPERIMENTS for s in STEPS for keep, reason in kept_set(single_url, e, s).values() if not keep}
    assert {"max_trajectories_per_step", "max_bytes_per_step", "max_tokens_per_step"} <= reasons
    for step in STEPS:  # the uniform choice: each kept trajectory stamped with its chance (4 of 40), the same at the gateway
        for trace_id, (keep, _) in kept_set(single_url, "exp-uniform", step).items():
            if keep:
                roots = [httpx.get(f"{url}/v1/trajectories/{trace_id}", timeout=30).json()["root"]["attributes"]
                         for url in (single_url, gateway_url)]
                assert roots[0]["inclusion_probability"] == roots[1]["inclusion_probability"] == 0.1
                assert "tracecar_unsent" not in roots[1]  # the nodes' report to the gateway, not stored
        kept_traj = [t for t, (keep, _) in kept_set(single_url, "exp-traj", step).items() if keep]
        root = httpx.get(f"{gateway_url}/v1/trajectories/{kept_traj[0]}", timeout=30).json()["root"]["attributes"]
        assert "inclusion_probability" not in root  # under a token limit the fill is not a uniform draw
    for step in STEPS:  # exp-group keeps whole groups, whole at the gateway though split over nodes
        answer = groups(gateway_url, "exp-group", step)
        assert answer["groups"] and all(g["n"] == ROLLOUT_N for g in answer["groups"])


def summaries(url: str, **params: Any) -> tuple[int, list[dict[str, Any]]]:
    """A list's total and rows by trace id (the order of equal sort keys is arrival order, which differs)."""
    page = httpx.get(url + "/v1/trajectories", params={"limit": 1000, **params}, timeout=30).json()
    return page["total"], sorted(page["trajectories"], key=lambda t: t["trace_id"])


def without_node(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[tuple[str, str | None]]]:
    """Rows without their forwarding node (a gateway's only: the single collector's is null), and (worker, node) pairs."""
    return [{k: v for k, v in r.items() if k != "node"} for r in rows], {(r["worker"], r.get("node")) for r in rows}


def assert_same_reads(single_url: str, gateway_url: str) -> None:
    """The gateway answers from ClickHouse (chDB) what the single collector answers from SQLite, and keeps which
    node forwarded each trajectory (the workers' node, by the workload's placement)."""
    state = httpx.get(gateway_url + "/v1/trajectories", params={"limit": 1}, timeout=30).json()["index"]
    assert state["store"] == "clickhouse", state
    for params in ({}, {"sort": "reward", "reward_min": 0.5}, {"has_error": "true"}, {"kept_because": "fill"},
                   {"experiment": "exp-group", "step": 2}, {"q": "calculator"}):
        (total_gw, rows_gw), (total_single, rows_single) = summaries(gateway_url, **params), summaries(single_url, **params)
        (gw, gw_nodes), (one, one_nodes) = without_node(rows_gw), without_node(rows_single)
        assert (total_gw, gw) == (total_single, one), params
        assert all(node == f"node{node_of(worker, NODES)}" for worker, node in gw_nodes) and {n for _, n in one_nodes} <= {None}
    everything = summaries(gateway_url)[1]
    for i in range(NODES):  # the node filter, answered by ClickHouse
        assert [t["trace_id"] for t in summaries(gateway_url, node=f"node{i}")[1]] == \
            [t["trace_id"] for t in everything if node_of(t["worker"], NODES) == i]
    for experiment in EXPERIMENTS:
        health = [httpx.get(url + "/v1/health", params={"experiment": experiment, "step": 1}, timeout=30).json()["step"]
                  for url in (single_url, gateway_url)]
        assert health[0] == health[1], experiment
        exports = [sorted(without_node([orjson.loads(line) for line in httpx.get(url + "/v1/export", params={"experiment": experiment},
                                                                                timeout=60).content.splitlines()])[0],
                          key=lambda r: r["trace_id"])
                   for url in (single_url, gateway_url)]
        assert exports[0] == exports[1] and exports[0], experiment


def test_four_nodes_and_a_gateway_keep_exactly_what_one_collector_keeps(tmp_path: Path) -> None:
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    # the gateway on chDB, moving each trajectory to its span archive 2 s after it arrived (once listed): the reads
    # below (trajectories, exports) come from ClickHouse's span table as much as from the spool
    cluster = start_cluster(tmp_path, NODES, gateway={**TAIL_BUDGETS, "store": "clickhouse", "store_max_age_s": 2})
    try:
        trajectories = workload()
        split = {(t.experiment, t.step, t.sample_index) for t in trajectories
                 if len({node_of(u.worker, NODES) for u in trajectories
                         if (u.experiment, u.step, u.sample_index) == (t.experiment, t.step, t.sample_index)}) > 1}
        assert len(split) >= 10  # groups whose rollouts ran on different nodes
        feed(single.url, cluster)
        wait_until(lambda: decided(single.url), 120, "the single collector decided every step")
        cluster.wait_drained()
        wait_until(lambda: decided(cluster.gateway.url), 120, "the gateway decided every step")
        assert_same_as_single(single.url, cluster.gateway.url, cluster)
        # the gateway's input from the experiments that decompose: the candidates, counted on the nodes
        sent = sum(scrape_metric(n.url, "tracecar_node_candidates_total", sent="true") for n in cluster.nodes)
        kept_home = sum(scrape_metric(n.url, "tracecar_node_candidates_total", sent="false") for n in cluster.nodes)
        assert sent + kept_home == len(CANDIDATES) * len(STEPS) * PER_STEP, (sent, kept_home)
        assert sent <= len(STEPS) * NODES * sum(CANDIDATES.values()), sent
        received = sum(scrape_metric(cluster.gateway.url, "tracecar_gateway_spans_received_total", node=n.env["TRACECAR_NODE_NAME"])
                       for n in cluster.nodes)  # spans: every trajectory of the others, the candidates of these
        others = (len(EXPERIMENTS) - len(CANDIDATES)) * len(STEPS) * PER_STEP
        assert received == 5 * (others + sent), (received, others, sent)  # 4 spans and a reward annotation each
        print(f"\ncandidates only: {sent:.0f} of {sent + kept_home:.0f} trajectories of exp-uniform and exp-topk forwarded "
              f"({kept_home:.0f} kept on their nodes); gateway received {received:.0f} spans")
        kept = httpx.get(cluster.gateway.url + "/v1/trajectories", params={"limit": 1}, timeout=30).json()["total"]
        wait_until(lambda: scrape_metric(cluster.gateway.url, "tracecar_store_evicted_trajectories_total", reason="max_age")
                   >= kept > 0, 60, "the gateway moved every kept trajectory to its archive")
        assert scrape_metric(cluster.gateway.url, "tracecar_store_archived_spans_total") == \
            scrape_metric(cluster.gateway.url, "tracecar_store_evicted_spans_total", reason="max_age")
        assert_same_reads(single.url, cluster.gateway.url)
        # a node's own view has part of a split group; the gateway's has it whole
        experiment, step, sample = sorted(split)[0]
        node_groups = [g for n in cluster.nodes for g in groups(n.url, experiment, step)["groups"]
                       if str(g["sample_index"]) == str(sample)]
        assert len(node_groups) > 1 and all(g["n"] < ROLLOUT_N for g in node_groups)
        # ... and says so: its scope names the gateway, groups list the rollouts that ran elsewhere
        answer = groups(cluster.nodes[1].url, experiment, step)
        assert answer["scope"]["gateway"] == cluster.gateway.url and answer["scope"]["node"] == "node1"
        assert answer["scope"]["partial_groups_on_page"] >= 1
        assert any(g["rollouts_missing"] for g in answer["groups"])
        assert "scope" not in groups(cluster.gateway.url, experiment, step)
    finally:
        cluster.stop()
        single.terminate()
