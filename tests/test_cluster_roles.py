"""Two roles, one program (issue 26, stage A): node collectors forward decoded trajectories to a gateway.

Every collector here is its own ``python -m tracecar.collector`` process with its own data dir on
127.0.0.1. The nodes decode with the job's tokenizer; the gateway has none, and must store what
one collector fed by the workers directly stores (compared span by span with such a collector).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from tests.cluster_workload import node_of, post, workload
from tests.support import clean_env, free_port
from tests.support.cluster import process_collector, start_cluster, wait_until
from tests.support.collector import scrape_metric

pytestmark = pytest.mark.timeout(240)


def serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecar.collector", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("env", "args", "expected"), [
    ({"TRACECAR_ROLE": "gateway", "TRACECAR_GATEWAY_URL": "http://127.0.0.1:9"}, (), "TRACECAR_GATEWAY_URL is set on a gateway"),
    ({}, ("--role", "gateway", "--gateway", "http://127.0.0.1:9"), "TRACECAR_GATEWAY_URL is set on a gateway"),
    ({"TRACECAR_GATEWAY_URL": "gateway:9470"}, (), "TRACECAR_GATEWAY_URL is not an http(s)://HOST:PORT URL"),
    ({}, ("--gateway", "http://127.0.0.1:99999"), "TRACECAR_GATEWAY_URL is not a URL"),
    ({"TRACECAR_GATEWAY_URL": "http://127.0.0.1:9/v1/spans"}, (), "must be the gateway's base URL"),
    ({"TRACECAR_ROLE": "primary"}, (), "role: Input should be 'node' or 'gateway'"),
    ({"TRACECAR_GATEWAY_URL": "http://127.0.0.1:9", "TRACECAR_MAX_TRAJECTORIES_PER_STEP": "8"}, (),
     "the gateway decides the global budgets"),
    ({"TRACECAR_GATEWAY_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40, "WANDB_ENTITY": "team"}, (),
     "W&B credentials belong on the gateway only"),
    ({"TRACECAR_GATEWAY_URL": "http://127.0.0.1:9", "TRACECAR_EXPORTERS": "otlp"}, (), "the gateway fans out to the exporters"),
    ({"TRACECAR_EXPORTERS": "gateway"}, (), "TRACECAR_EXPORTERS includes gateway but TRACECAR_GATEWAY_URL is not set"),
    ({"TRACECAR_ROLE": "gateway", "TRACECAR_MAX_SAMPLES_PER_STEP_PER_WORKER": "4"}, (),
     "VERL's per-worker budget is decided by the node collectors"),
])
def test_a_role_misconfiguration_is_one_line_and_exit_2(tmp_path: Path, env: dict[str, str], args: tuple[str, ...],
                                                         expected: str) -> None:
    full = clean_env(TRACECAR_DATA_DIR=str(tmp_path / "data"), TRACECAR_HOST="127.0.0.1", TRACECAR_PORT=str(free_port()), **env)
    done = serve(full, *args)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracecar: ") and expected in lines[0], done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was created


def _without_times(tree: dict) -> dict:
    """A trajectory answer without what depends on when it was received (arrival times, the node's row order)."""
    skip = {"received_at", "seq"}
    return {k: (_without_times(v) if isinstance(v, dict) else [_without_times(c) if isinstance(c, dict) else c for c in v]
                if isinstance(v, list) else v) for k, v in tree.items() if k not in skip}


def test_nodes_forward_decoded_trajectories_that_the_gateway_stores_as_one_collector_would(tmp_path: Path,
                                                                                            small_bpe_path: str) -> None:
    decode = {"token2text": True, "tokenizer": small_bpe_path}
    cluster = start_cluster(tmp_path, 2, node=decode)
    single = process_collector(tmp_path / "single", log_level="warning", **decode).start()
    try:
        trajectories = [t for t in workload() if t.experiment == "exp-traj" and t.step == 1]
        with httpx.Client() as client:
            for t in trajectories:  # each worker's spans to its own node; the same to the single collector
                node = cluster.nodes[node_of(t.worker, 2)]
                for spans in (t.spans, [t.reward]):
                    post(client, node.url, t.worker, spans, tokenizer=small_bpe_path, wandb_run_id="team/proj/run-1")
                    post(client, single.url, t.worker, spans, tokenizer=small_bpe_path, wandb_run_id="team/proj/run-1")
        cluster.wait_drained()
        gw = cluster.gateway.url
        wait_until(lambda: httpx.get(gw + "/v1/trajectories", params={"limit": 1000}).json()["total"] == len(trajectories),
                   60, "every trajectory at the gateway")
        for t in trajectories:
            at_gateway = httpx.get(f"{gw}/v1/trajectories/{t.trace_id}").json()
            at_single = httpx.get(f"{single.url}/v1/trajectories/{t.trace_id}").json()
            assert _without_times(at_gateway) == _without_times(at_single)
            tokens_gw = httpx.get(f"{gw}/v1/trajectories/{t.trace_id}/tokens").json()
            assert tokens_gw == httpx.get(f"{single.url}/v1/trajectories/{t.trace_id}/tokens").json()
            assert tokens_gw["spans"] and all(s["text"] and s["text_note"] is None for s in tokens_gw["spans"])  # offsets came along
        # decoded on the nodes only, never twice; each node's spans counted under its name
        assert scrape_metric(gw, "tracecar_decoded_tokens_total") == 0
        assert all(scrape_metric(n.url, "tracecar_decoded_tokens_total") > 0 for n in cluster.nodes)
        total_spans = sum(len(t.spans) + 1 for t in trajectories)
        by_node = [scrape_metric(gw, "tracecar_gateway_spans_received_total", node=f"node{i}") for i in range(2)]
        assert sum(by_node) == total_spans and all(by_node)
        # the workers' own names, projects and W&B run travel with the spans
        listed = httpx.get(gw + "/v1/trajectories", params={"worker": "w7", "limit": 1000}).json()
        assert {x["trace_id"] for x in listed["trajectories"]} == {t.trace_id for t in trajectories if t.worker == "w7"}
        # the gateway keeps which node forwarded each trajectory: a column of its list, a filter, a facet, an export field
        everything = httpx.get(gw + "/v1/trajectories", params={"limit": 1000}).json()["trajectories"]
        assert {x["trace_id"]: x["node"] for x in everything} == {t.trace_id: f"node{node_of(t.worker, 2)}" for t in trajectories}
        on_node1 = httpx.get(gw + "/v1/trajectories", params={"node": "node1", "limit": 1000}).json()["trajectories"]
        assert {x["trace_id"] for x in on_node1} == {t.trace_id for t in trajectories if node_of(t.worker, 2) == 1}
        assert httpx.get(gw + "/ui/api/facets").json()["nodes"] == [
            {"node": f"node{i}", "trajectories": sum(1 for t in trajectories if node_of(t.worker, 2) == i)} for i in range(2)]
        exported = [orjson.loads(line) for line in httpx.get(gw + "/v1/export", params={"node": "node0"}).content.splitlines()]
        assert exported and {r["node"] for r in exported} == {"node0"}
        cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", gw, "--node", "node1", "--json",
                              "--limit", "1000"], capture_output=True, text=True, timeout=60, check=True)
        assert {x["trace_id"] for x in orjson.loads(cli.stdout)["trajectories"]} == {x["trace_id"] for x in on_node1}
        # ... and the viewer's page (Chromium): a node filter listing each node, the trajectory page naming its node
        from tests.test_viewer import Page, _browser, expect

        with _browser() as pw:
            b = Page(pw, tmp_path, gw)
            try:
                b.page.goto(gw + "/ui/#/list")
                choice = b.page.locator("[data-testid=filter-node]")
                expect(choice.locator("option")).to_have_count(3)  # any, node0, node1
                choice.select_option("node1")
                b.page.locator("[data-testid=apply-filters]").click()
                rows = b.page.locator("[data-testid=traj-row]")
                expect(rows).to_have_count(len(on_node1))
                b.page.goto(gw + "/ui/#/t/" + on_node1[0]["trace_id"])
                expect(b.page.locator("[data-testid=trajectory] dl.kv").first).to_contain_text("node1")
                b.check_clean()
            finally:
                b.close()
        # a collector fed by its workers directly (the single one, each node itself) has no forwarding node
        assert {x["node"] for x in httpx.get(single.url + "/v1/trajectories", params={"limit": 1000}).json()["trajectories"]} == {None}
        assert httpx.get(cluster.nodes[0].url + "/ui/api/facets").json()["nodes"] == []
        # each node's own viewer still has its part
        own = httpx.get(cluster.nodes[0].url + "/v1/trajectories", params={"limit": 1000}).json()["total"]
        assert own == sum(1 for t in trajectories if node_of(t.worker, 2) == 0)
        # /readyz of a node says how its gateway exporter is doing
        ready = httpx.get(cluster.nodes[0].url + "/readyz").json()
        assert ready["exporters"]["gateway"]["pending"] == 0 and ready["exporters"]["gateway"]["reachable"] is True
    finally:
        cluster.stop()
        single.terminate()


def test_a_forwarded_batch_to_a_collector_that_is_not_a_gateway_is_retried_never_lost(tmp_path: Path) -> None:
    """A node pointed at a plain collector: 421, retried (its /readyz says why); pointed right, it delivers."""
    plain = process_collector(tmp_path / "plain", log_level="warning").start()
    node = process_collector(tmp_path / "node", gateway_url=plain.url, node_name="n0", log_level="warning",
                             forward_retry_max_s=1).start()
    try:
        t = workload()[0]
        with httpx.Client() as client:
            post(client, node.url, t.worker, t.spans)
        wait_until(lambda: "not a gateway" in str(httpx.get(node.url + "/readyz").json()["exporters"]["gateway"]["last_forward_error"]),
                   30, "the node says its gateway is not one")
        assert httpx.get(plain.url + "/v1/trajectories").json()["total"] == 0
        assert scrape_metric(node.url, "tracecar_exporter_pending", exporter="gateway") == len(t.spans)
    finally:
        node.terminate()
        plain.terminate()


def test_a_nodes_groups_page_says_its_groups_may_be_partial(start_collector, tmp_path: Path) -> None:
    """A node's own groups view (API and page, in Chromium) names the gateway and the rollouts that ran elsewhere."""
    from tests.test_viewer import Page, _browser, expect

    gateway_url = f"http://127.0.0.1:{free_port()}"  # nobody there: the node keeps its spans pending, its views work
    node = start_collector(role="node", gateway_url=gateway_url, node_name="node-a", forward_retry_max_s=1)
    mine = [t for t in workload() if t.experiment == "exp-traj" and t.step == 1 and t.worker == "w2"]  # part of groups 2 and 3
    with httpx.Client() as client:
        post(client, node.url, "w2", [s for t in mine for s in t.spans] + [t.reward for t in mine])
    answer = httpx.get(node.url + "/v1/groups", params={"experiment": "exp-traj", "step": 1}).json()
    assert answer["scope"]["gateway"] == gateway_url and answer["scope"]["node"] == "node-a"
    missing = {g["sample_index"]: g["rollouts_missing"] for g in answer["groups"]}
    assert missing == {2: [0, 1], 3: []}  # w2 ran rollouts 2-3 of prompt 2 and 0-2 of prompt 3
    with _browser() as pw:
        b = Page(pw, tmp_path, node.url)
        try:
            b.page.goto(node.url + "/ui/#/groups?experiment=exp-traj&step=1")
            scope = b.page.locator("[data-testid=groups-scope]")
            expect(scope).to_contain_text("node-a")
            expect(scope).to_contain_text(gateway_url)
            expect(scope).to_contain_text("1 group(s) on this page miss rollouts")
            b.check_clean()
        finally:
            b.close()
