"""A local-only store's forwarder is not woken after each commit (every span is written done: nothing
is ever pending there), yet spans an earlier run with an exporter left pending in the same data dir
still reach the done state (the forwarder's first pass at start, then its poll once a second), and
every span stays readable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from tracecar.collector.exporters.forward import SendResult

pytestmark = pytest.mark.timeout(120)


class DownSink:
    """An exporter that is down: every span is retryable, so it stays pending in the spool."""

    name = "weave"

    async def send(self, spans: Sequence[Any]) -> SendResult:
        return SendResult(retryable=[s["span_id"] for s in spans], retry_reason="backend down")

    async def aclose(self) -> None:
        return None


def test_pending_spans_of_an_earlier_run_are_settled_by_a_local_collector(start_collector, kit, tmp_path) -> None:
    data_dir = tmp_path / "shared-data"
    first = start_collector(sink=DownSink(), data_dir=data_dir, forward_retry_max_s=30.0)
    assert first.collector.forwarder.notify in first.collector.pipeline.on_committed  # an exporter: woken per commit
    earlier = kit.trajectory(children=3, sample_index=1)
    assert kit.post(first.url, earlier).status_code == 200
    assert kit.metrics(first.url, "tracecar_spool_depth") == len(earlier)  # pending: the exporter is down
    first.stop()

    local = start_collector(data_dir=data_dir)  # the same store, now local only
    assert local.collector.spool.local_only
    assert local.collector.forwarder.notify not in local.collector.pipeline.on_committed  # no wake per commit
    assert kit.wait_for(lambda: kit.metrics(local.url, "tracecar_spool_depth") == 0, timeout=20), \
        "the earlier run's pending spans were never settled"
    later = kit.trajectory(children=2, sample_index=2)
    assert kit.post(local.url, later).status_code == 200
    assert kit.metrics(local.url, "tracecar_spool_depth") == 0  # written done: nothing to forward
    listed = httpx.get(local.url + "/v1/trajectories", params={"experiment": "exp-fault"}, timeout=10).json()
    traces = {t["trace_id"] for t in listed["trajectories"]}
    assert {earlier[-1]["trace_id"], later[-1]["trace_id"]} <= traces
