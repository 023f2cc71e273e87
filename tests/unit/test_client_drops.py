"""Client drop reports: the reason label values a client may create are bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from tracecar.collector.receivers.client_drops import MAX_DISTINCT_REASONS, OTHER_REASON, ClientDrops, parse_dropped


def test_reason_labels_are_bounded_and_the_rest_counted_as_other():
    registry = CollectorRegistry()
    counter = Counter("drops", "test", ["reason"], registry=registry)
    drops = ClientDrops(counter)
    for i in range(MAX_DISTINCT_REASONS + 40):  # a buggy or hostile client inventing reasons
        totals = parse_dropped({f"reason_{i}": 2})
        assert totals is not None
        drops.observe(f"w{i}", totals)
    labels = {s.labels["reason"] for m in registry.collect() for s in m.samples if s.name == "drops_total"}
    assert len(labels) == MAX_DISTINCT_REASONS + 1 and OTHER_REASON in labels
    assert registry.get_sample_value("drops_total", {"reason": OTHER_REASON}) == 2 * 40
    assert registry.get_sample_value("drops_total", {"reason": "reason_0"}) == 2
