"""Tracing health: the numbers a user must trust traces by, in one JSON answer (``GET /v1/health``).

Spans the workers dropped before sending, spans sampled out, rejected, trajectories dropped by
a tail decision, decode failures, what waits in the spool, and whether the backend is reachable.
All are this collector's totals since it started (Prometheus counters read back), so a trainer
logging them at every step (``tracecar.client.log_health``) sees a gap in traces as a jump on
its W&B run page.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from tracecar.client import __version__

# answer key -> (metric family, label whose values become the keys; None for an unlabelled value)
COUNTERS: dict[str, tuple[str, str | None]] = {
    "client_dropped": ("tracecar_client_dropped_spans", "reason"),
    "sampled_out": ("tracecar_spans_sampled_out", "budget"),
    "trajectories_dropped": ("tracecar_trajectories_dropped", "reason"),
    "rejected": ("tracecar_spans_rejected", "reason"),
    "batches_rejected": ("tracecar_batches_rejected", "reason"),
    "decode_failures": ("tracecar_decode_failures", "reason"),
    "forward_failures": ("tracecar_forward_failures", "kind"),
}
SCALARS = {
    "spans_received": "tracecar_spans_received", "spans_accepted": "tracecar_spans_accepted",
    "spans_forwarded": "tracecar_spans_forwarded", "spans_dead_lettered": "tracecar_spans_dead_lettered",
    "spool_depth": "tracecar_spool_depth", "held_spans": "tracecar_held_spans",
    "backend_unreachable": "tracecar_backend_unreachable",
}


def _samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out.setdefault(family.name, []).append((sample.labels, sample.value))
    return out


def health_snapshot(registry: CollectorRegistry, client_drops_by_worker: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The ``/v1/health`` answer: per-reason totals with a ``*_total`` sum each, and gauges."""
    samples = _samples(registry)
    answer: dict[str, Any] = {"version": __version__}
    for key, (family, label) in COUNTERS.items():
        by: dict[str, int] = {}
        for labels, value in samples.get(family, []):
            name = labels.get(label or "", "")
            by[name] = by.get(name, 0) + int(value)
        answer[key] = by
        answer[key + "_total"] = sum(by.values())
    for key, family in SCALARS.items():
        answer[key] = int(sum(value for _, value in samples.get(family, [])))
    # with fan-out each exporter counts its own deliveries: a span is forwarded when every exporter has it
    by_exporter: dict[str, int] = {}
    for labels, value in samples.get("tracecar_spans_forwarded", []):
        name = labels.get("exporter") or labels.get("backend") or ""
        by_exporter[name] = by_exporter.get(name, 0) + int(value)
    answer["spans_forwarded_by_exporter"] = by_exporter
    if by_exporter:
        answer["spans_forwarded"] = min(by_exporter.values())
    answer["client_dropped_by_worker"] = client_drops_by_worker
    return answer
