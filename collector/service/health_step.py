"""Tracing health of one step (``GET /v1/health?step=N``, ``tracecar health --step N``).

The totals of ``/v1/health`` are the collector's counters since it started: a jump shows that
something was lost, not in which step. What the store knows per step is answered here, each
from a bounded read: its trajectories from the viewer's trajectory index (one row per
trajectory, indexed by experiment and step), still running ones from the live view's query
(bounded by ``TRACECAR_LIVE_MAX_SCAN_SPANS``), held spans from the spool's held index (bounded by
the held set), and the sampling decisions of the step (``/v1/decisions``' counts, without the
per-trajectory rows). Client drops are reported by workers as running totals per worker, not
per step, so they stay in the totals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..read_store import ReadStore
from ..spool.live import running_trajectories
from ..spool.store import Spool
from ..trajectory_filter import TrajectoryFilter

DECISION_KEYS = ("mode", "budget", "kept", "dropped", "kept_by_rule", "dropped_by_reason")


def latest_experiment(index: ReadStore) -> str | None:
    known = index.facets()["experiments"]
    return known[0]["experiment"] if known else None


def held_spans_of_step(spool: Spool, experiment: str | None, step: int, validate: bool | None) -> int:
    """Spans of the step held for a tail-based decision (the spool's held index: bounded by the held set)."""
    sql = "SELECT COUNT(*) AS n FROM spans INDEXED BY spans_held WHERE state = 3 AND step = ? AND experiment IS ?"
    params: list[Any] = [step, experiment]
    if validate is not None:
        sql += " AND validate = ?"
        params.append(int(validate))
    return int(spool.query(sql, params)[0]["n"])


def step_health(spool: Spool, index: ReadStore, experiment: str | None, step: int, validate: bool | None, *,
                window_s: float, max_scan_spans: int, open_calls: Callable[[], list[dict[str, Any]]],
                decisions: dict[str, Any]) -> dict[str, Any]:
    """Blocking: the per-step part of ``/v1/health`` (``experiment`` None: the latest; "" none)."""
    if experiment is None:
        experiment = latest_experiment(index)
    flt = TrajectoryFilter(experiment="" if experiment is None else experiment, step=step, validate=validate)
    stored = index.step_counts(flt)
    live = running_trajectories(spool, flt, window_s=window_s, max_scan_spans=max_scan_spans, limit=1, open_calls=open_calls)
    return {
        "experiment": experiment, "step": step, "validate": validate, **stored,
        "running": live["total"], "running_scan_capped": live["scan_capped"],
        "held_spans": held_spans_of_step(spool, experiment or None, step, validate),
        "sampling": {k: decisions.get(k) for k in DECISION_KEYS},
    }
