"""The cluster tier with each collector in its own network namespace (issue 26, stage D, the realistic one).

Five namespaces on a bridge (tests/support/netns.py): the gateway in one, a node collector in
each of four others, every one on its own address and the same port, as on real machines; the
test process (the workers' side) and the Weave stand-in sit in the root namespace. Faults are
network partitions, not dead processes: a node's link goes down mid-step (the workers' posts to
it and its forwards hang until their timeouts, then retry), then the gateway's link goes down
under load. Afterwards the decisions equal one collector's that saw the workload without faults,
every acknowledged span of a kept trajectory is at the gateway, and each kept call reached Weave
exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster_workload import TAIL_BUDGETS, Feeder, batches, workload
from tests.conftest import FAKE_WANDB_KEY
from tests.support import netns
from tests.support.cluster import process_collector, wait_until
from tests.support.collector import scrape_metric
from tests.support.weave_stub import WeaveStub
from tests.test_cluster_budgets import NODES, decided, feed
from tests.test_cluster_faults import assert_exact_and_once

pytestmark = pytest.mark.timeout(300)
TOKEN = "netns-" + "0123456789abcdef" * 2
PORT = 9470
PARTITION_S = 10.0


@pytest.fixture
def namespaces() -> netns.Namespaces:
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces: {why}")
    spaces = netns.Namespaces(NODES + 1).create()
    yield spaces
    spaces.delete()


def test_partitioned_nodes_and_gateway_lose_nothing_and_deliver_once(tmp_path: Path, namespaces: netns.Namespaces) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    single = process_collector(tmp_path / "single", log_level="warning", **TAIL_BUDGETS).start()
    stub = WeaveStub(host=namespaces.host).start()  # reachable from the gateway's namespace over the bridge
    gateway = netns.namespaced_collector(
        namespaces.names[0], namespaces.address(0), PORT, tmp_path / "gateway", role="gateway", token=TOKEN, log_level="warning",
        TRACECAR_BACKEND="weave", WANDB_API_KEY=FAKE_WANDB_KEY, WF_TRACE_SERVER_URL=stub.url, TRACECAR_WANDB_ENTITY="ent",
        TRACECAR_WANDB_PROJECT="proj", forward_retry_initial_s=0.05, forward_retry_max_s=0.5, **TAIL_BUDGETS)
    nodes = [netns.namespaced_collector(namespaces.names[i + 1], namespaces.address(i + 1), PORT, tmp_path / f"node{i}",
                                        role="node", gateway_url=gateway.url, node_name=f"node{i}", token=TOKEN,
                                        log_level="warning", gateway_timeout_s=3, forward_retry_max_s=1,
                                        step_idle_s=2)  # the last step a node holds (candidates only) closes on idle
             for i in range(NODES)]
    started = [gateway]
    feeder: Feeder | None = None
    try:
        gateway.start()
        for node in nodes:
            started.append(node.start())
        feed(single.url, None)  # the reference: one collector, no faults
        plan = list(batches(workload(), per_trajectory=True))
        feeder = Feeder([n.url for n in nodes], plan, pace_s=0.03, headers=auth, timeout_s=3)
        feeder.start()

        wait_until(lambda: feeder.progress() >= 0.2, 120, "20% fed")
        namespaces.partition(2)  # node1 cut off: from its workers and from the gateway
        time.sleep(PARTITION_S / 2)
        namespaces.heal(2)

        wait_until(lambda: feeder.progress() >= 0.45, 120, "45% fed")
        namespaces.partition(0)  # the gateway cut off under load: the nodes keep acknowledging into their spools
        acked_at_cut = len(feeder.acked)
        time.sleep(PARTITION_S)
        acked_while_cut = len(feeder.acked) - acked_at_cut
        owed_while_cut = sum(scrape_metric(n.url, "tracecar_exporter_pending", exporter="gateway") for n in nodes)
        namespaces.heal(0)

        feeder.join(240)
        assert not feeder.is_alive() and feeder.done_batches == len(plan)
        assert acked_while_cut > 50 and owed_while_cut > 0
        wait_until(lambda: all(scrape_metric(n.url, "tracecar_exporter_pending", exporter="gateway") == 0
                               and scrape_metric(n.url, "tracecar_held_spans") == 0 for n in nodes),
                   180, "nodes drained to the gateway")
        wait_until(lambda: decided(gateway.url, auth), 120, "the gateway decided every step")
        kept, delivered = assert_exact_and_once(
            single.url, gateway.url, feeder, lambda: [c["attributes"]["tracecar"]["span_id"] for c in stub.completed_calls()],
            headers=auth)
        print(f"\ncluster netns: batches={len(plan)} failed_posts={feeder.failed_posts} acked_while_cut={acked_while_cut} "
              f"owed_while_cut={owed_while_cut:.0f} kept={len(kept)} weave_calls={len(delivered)}")
    finally:
        if feeder is not None:
            feeder.stop.set()
        for pc in started:
            if pc.proc is not None and pc.proc.poll() is None:
                pc.terminate()
        stub.stop()
        single.terminate()
