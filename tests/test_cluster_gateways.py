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

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.cluster_workload import (
    EXPERIMENTS,
    PER_STEP,
    STEPS,
    TAIL_BUDGETS,
    Feeder,
    batches,
    kept_set,
    node_of,
    post,
    workload,
)
from tests.conftest import FAKE_WANDB_KEY
from tests.support.cluster import Cluster, process_collector, start_cluster, wait_until
from tests.support.collector import metric_value, scrape_metric
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


def two_gateway_cluster(tmp_path: Path, peers: bool = False, **gateway: Any) -> tuple[Cluster, list[str]]:
    """Four nodes and two gateways (not started), on ports chosen so that both gateways own steps; ``peers``: each
    gateway lists both (TRACECAR_GATEWAY_PEERS), answering reads for the two."""
    cluster: Cluster = start_cluster(tmp_path, NODES, gateway={**TAIL_BUDGETS, **gateway}, gateways=2, start=False)
    for gw, port in zip(cluster.gateways, two_gateway_ports()):
        gw.url = f"http://127.0.0.1:{port}"
        gw.env["TRACECAR_PORT"] = str(port)
    urls = [g.url for g in cluster.gateways]
    for n in cluster.nodes:
        n.env["TRACECAR_GATEWAY_URL"] = ",".join(urls)
    if peers:
        for gw in cluster.gateways:
            gw.env["TRACECAR_GATEWAY_PEERS"] = ",".join(urls)
    return cluster, urls


def test_two_gateways_each_decide_their_steps_exactly_as_one_collector(tmp_path: Path) -> None:
    """Each gateway's own answers (``scope=local``) hold its steps only; either gateway's merged answers
    (TRACECAR_GATEWAY_PEERS) are the single collector's (see test_either_gateway_answers_for_both)."""
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    cluster, urls = two_gateway_cluster(tmp_path, peers=True)
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
            assert kept_set(urls[i], experiment, step, scope="local") == want, (experiment, step)
            assert kept_set(urls[1 - i], experiment, step, scope="local") == {}, (experiment, step)  # nothing on the other
            kept = sorted(t for t, (keep, _) in want.items() if keep)
            assert listed(urls[i], experiment=experiment, step=step, scope="local") == kept
            assert listed(urls[1 - i], experiment=experiment, step=step, scope="local") == []
            single_groups = groups(single.url, experiment, step)
            assert groups(urls[i], experiment, step, scope="local") == single_groups  # whole, rewards and all
            # either gateway answers for the step, wherever it lives
            assert kept_set(urls[1 - i], experiment, step) == want and groups(urls[1 - i], experiment, step) == single_groups
            assert listed(urls[1 - i], experiment=experiment, step=step) == kept
        everything = listed(single.url)
        parts = [listed(u, scope="local") for u in urls]
        assert parts[0] and parts[1] and sorted(parts[0] + parts[1]) == everything
        either_gateway_answers_for_both(single.url, urls, parts)
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
        cluster.more_gateways[0].kill()  # the second gateway down: the first answers what it has, and says so
        down = httpx.get(urls[0] + "/v1/trajectories", params={"limit": 1000}, timeout=60).json()
        assert down["partial"] and down["gateways"][1]["error"].startswith("unreachable") and down["total"] == len(parts[0])
        gone = httpx.get(f"{urls[0]}/v1/trajectories/{parts[1][0]}", timeout=60)
        assert gone.status_code == 503 and urls[1] in gone.text and gone.headers["retry-after"]
        assert scrape_metric(urls[0], "tracecar_gateway_peer_failures_total", gateway=urls[1], reason="unreachable") >= 2
    finally:
        cluster.stop()
        single.terminate()


def either_gateway_answers_for_both(single: str, urls: list[str], parts: list[list[str]]) -> None:
    """TRACECAR_GATEWAY_PEERS: a merged list is the single collector's (every sort, pages across the two gateways' rows),
    one trajectory and its tokens come from the gateway that holds it, the JSONL export and the facets cover both; with
    one gateway down a list says it is partial and a trajectory only it holds is a 503 naming it."""
    def page(url: str, **params: Any) -> dict[str, Any]:
        r = httpx.get(url + "/v1/trajectories", params={"limit": 1000, **params}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    whole = page(single, sort="reward", order="desc")
    for url in urls:
        for sort, order in (("reward", "desc"), ("reward", "asc"), ("start", "desc"), ("sample_index", "asc"),
                            ("turns", "desc"), ("advantage", "asc")):
            merged, one = page(url, sort=sort, order=order), page(single, sort=sort, order=order)
            assert merged["total"] == one["total"] and not merged["partial"], (sort, order)
            key = {"start": "start_time", "turns": "turns"}.get(sort, sort)
            assert [t[key] for t in merged["trajectories"]] == [t[key] for t in one["trajectories"]], (url, sort, order)
            assert sorted(t["trace_id"] for t in merged["trajectories"]) == sorted(t["trace_id"] for t in one["trajectories"])
        full = page(url, sort="reward", order="desc")["trajectories"]
        for offset, limit in ((0, 7), (7, 11), (len(full) - 3, 10)):
            assert page(url, sort="reward", order="desc", offset=offset, limit=limit)["trajectories"] == full[offset:offset + limit]
        assert [t["reward"] for t in full] == [t["reward"] for t in whole["trajectories"]]
        ui = httpx.get(url + "/ui/api/trajectories", params={"limit": 500, "sort": "reward"}, timeout=60).json()
        assert ui["total"] == whole["total"]
        facets = httpx.get(url + "/ui/api/facets", timeout=60).json()
        want = httpx.get(single + "/ui/api/facets", timeout=60).json()
        assert {e["experiment"]: e["trajectories"] for e in facets["experiments"]} == {
            e["experiment"]: e["trajectories"] for e in want["experiments"]}
        for experiment in EXPERIMENTS:  # each gateway's steps, binned over the job's reward range: the single one's
            merged_view = httpx.get(url + "/ui/api/overview", params={"experiment": experiment}, timeout=60).json()
            single_view = httpx.get(single + "/ui/api/overview", params={"experiment": experiment}, timeout=60).json()
            assert not merged_view["partial"] and merged_view["steps"], experiment
            for key in ("bin_edges", "trajectories", "rules"):
                assert merged_view[key] == single_view[key], (experiment, key)
            strip = ("worst", "best")  # ties between equal rewards break by each store's own row order
            assert [{k: v for k, v in e.items() if k not in strip} for e in merged_view["steps"]] == [
                {k: v for k, v in e.items() if k not in strip} for e in single_view["steps"]], experiment
            assert [(e.get("worst") or {}).get("reward") for e in merged_view["steps"]] == [
                (e.get("worst") or {}).get("reward") for e in single_view["steps"]]
        exported = sorted(orjson.loads(line)["trace_id"] for line in
                          httpx.get(url + "/v1/export", timeout=120).content.splitlines())
        assert exported == sorted(parts[0] + parts[1])
    for i, part in enumerate(parts):  # one held by gateway i, read through the other one
        trace = part[0]
        for path in (f"/v1/trajectories/{trace}", f"/v1/trajectories/{trace}/tokens", f"/ui/api/trajectories/{trace}"):
            through = httpx.get(urls[1 - i] + path, timeout=60)
            assert through.status_code == 200 and through.content == httpx.get(urls[i] + path, params={"scope": "local"},
                                                                               timeout=60).content, path
        assert httpx.get(urls[1 - i] + f"/v1/trajectories/{trace}", params={"scope": "local"}, timeout=60).status_code == 404
    assert httpx.get(urls[0] + "/v1/trajectories/nosuchtrajectory000", timeout=60).status_code == 404
    assert httpx.get(urls[0] + "/v1/trajectories", params={"offset": 9_990, "limit": 20}, timeout=60).status_code == 422


def test_two_gateways_with_a_node_and_a_gateway_killed_lose_nothing_and_deliver_once(tmp_path: Path,
                                                                                    faulty_weave_stub: Any) -> None:
    """A node SIGKILLed mid-step (restarted on its spool, its routes remembered only there) and one gateway
    SIGKILLed mid-step: every step's decisions at its owner equal the fault-free single collector's, the other
    gateway has none of it, every acknowledged span of a kept trajectory (the stepless reward annotations too)
    is at its owner, and each kept call reached Weave once, through one gateway."""
    stub = faulty_weave_stub
    weave = {"TRACECAR_BACKEND": "weave", "WANDB_API_KEY": FAKE_WANDB_KEY, "WF_TRACE_SERVER_URL": stub.url,
             "TRACECAR_WANDB_ENTITY": "ent", "TRACECAR_WANDB_PROJECT": "proj", "forward_retry_initial_s": 0.05,
             "forward_retry_max_s": 0.5}
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    cluster, urls = two_gateway_cluster(tmp_path, **weave)
    plan = list(batches(workload(), per_trajectory=True))
    feeder = Feeder([n.url for n in cluster.nodes], plan, pace_s=0.03)
    try:
        for pc in cluster.all:
            pc.start()
        feed(single.url, None)
        feeder.start()
        wait_until(lambda: feeder.progress() >= 0.2, 120, "20% fed")
        cluster.nodes[1].kill()  # what it acknowledged is in its spool, owed to one gateway each
        cluster.nodes[1].start()
        wait_until(lambda: feeder.progress() >= 0.5, 120, "50% fed")
        cluster.gateways[1].kill()
        time.sleep(1.0)
        cluster.gateways[1].start()
        feeder.join(180)
        assert not feeder.is_alive() and feeder.done_batches == len(plan) and feeder.errors == []
        cluster.wait_drained(120)
        own = owners(urls)
        for (experiment, step), i in own.items():
            wait_until(lambda: step_decided(urls[i], experiment, step), 120, f"gateway {i} decided {experiment} {step}")
        kept: set[str] = set()
        for (experiment, step), i in own.items():
            want = kept_set(single.url, experiment, step)
            assert kept_set(urls[i], experiment, step) == want, (experiment, step)
            assert kept_set(urls[1 - i], experiment, step) == {}, (experiment, step)
            kept |= {t for t, (keep, _) in want.items() if keep}
        step_of = {t.trace_id: (t.experiment, t.step) for t in workload()}
        wanted = {s["span_id"]: t.trace_id for t in workload() if t.trace_id in kept for s in [*t.spans, t.reward]}
        assert set(wanted) <= set(feeder.acked)
        for trace_id in kept:
            tree = httpx.get(f"{urls[own[step_of[trace_id]]]}/v1/trajectories/{trace_id}", timeout=30).json()
            assert tree["span_count"] == sum(1 for s, t in wanted.items() if t == trace_id and not s.endswith("-r")), trace_id
            assert [a["span_id"] for a in tree["annotations"]] == [f"{trace_id}-r"], trace_id  # its reward, at the same gateway
        for url in urls:
            wait_until(lambda: metric_value(httpx.get(url + "/metrics", timeout=10).text, "tracecar_spool_depth") == 0,
                       120, f"{url} drained to Weave")
            assert metric_value(httpx.get(url + "/metrics", timeout=10).text, "tracecar_dead_letters") == 0
        delivered = stub.delivered()
        assert len(delivered) == len(set(delivered)), "a call reached Weave twice"
        assert set(delivered) == {s for s in wanted if not s.endswith("-r")}
    finally:
        feeder.stop.set()
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
        page = httpx.get(gateway + "/v1/trajectories", params={"experiment": t.experiment, "step": t.step, "limit": 1000,
                                                              "scope": "local"}, timeout=30).json()
        row = next(r for r in page["trajectories"] if r["trace_id"] == trace_id)
        detail = httpx.get(f"{gateway}/v1/trajectories/{trace_id}", params={"scope": "local"}, timeout=30).text
        assert "tracecar_route" not in detail
        return row.get("trained_on_version") == 99

    for t in chosen:
        wait_until(lambda: arrived(t), 60, f"the trainer's annotation of {t.spans[0]['trace_id']} at its gateway")
