"""Live: trajectories still running — spans stored, root not yet arrived.

The client sends a span when its call ends, so a trajectory's root (its ``rollout_trace_attr``)
comes last. Until then its finished calls are in the store (pending, or held awaiting a
tail-based decision) and this module finds them: the recent spans (the last
``TRACECAR_LIVE_WINDOW_S``, at most ``TRACECAR_LIVE_MAX_SCAN_SPANS`` of them) are grouped by
trace, traces whose root is nowhere in the store are the running ones, and their spans so far
are read through the trace index. Reads only: nothing here moves a row, so looking at a
running trajectory never forwards it.

Calls still running are known from the clients' open markers
(:mod:`tracecar.collector.processors.open_calls`, passed in): ``stuck_call`` is the innermost
one that started first, the call the trajectory waits on. Without markers
(``TRACECAR_OPEN_MARKERS=false``) a stuck call shows as a trajectory idle since ``last_span``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..trajectory_filter import TrajectoryFilter
from .store import HELD, Spool

SPANS_PER_TRAJECTORY = 500  # spans listed per running trajectory (the count is always exact)


#: The filters the live view answers: the columns every stored span carries (and an open call's marker).
LIVE_FILTERS = ("experiment", "step", "validate", "worker", "sample_index")


def first_seq_since(spool: Spool, since: float) -> int:
    """The first row received at or after ``since``: a binary search over ``seq`` (rows are
    appended in arrival order), a few primary-key probes instead of a scan."""
    # two queries: SQLite answers MIN and MAX of the rowid from the b-tree's ends only when asked alone
    lo = spool.query("SELECT MIN(seq) AS lo FROM spans")[0]["lo"]
    hi = spool.query("SELECT MAX(seq) AS hi FROM spans")[0]["hi"]
    if lo is None:
        return 0
    hi += 1
    while lo < hi:
        mid = (lo + hi) // 2
        found = spool.query("SELECT seq, received_at FROM spans WHERE seq >= ? ORDER BY seq LIMIT 1", (mid,))
        if not found:
            hi = mid
        elif found[0]["received_at"] < since:
            lo = found[0]["seq"] + 1
        else:
            hi = mid
    return lo


def _has_root(spool: Spool, trace_id: str) -> bool:
    return bool(spool.query(
        "SELECT 1 AS x FROM spans WHERE trace_id = ? AND parent_id IS NULL AND kind != 'annotation' LIMIT 1", (trace_id,)))


def candidates_sql(flt: TrajectoryFilter, start_seq: int) -> tuple[str, list[Any]]:
    """Traces with spans at or after ``start_seq`` and no root among them. ``NOT INDEXED``: the
    rowid range is the bound that keeps this cheap; SQLite would otherwise walk the whole
    trace index to save the GROUP BY's sort."""
    clauses, params = flt.where(allowed=LIVE_FILTERS)  # the one filter builder (trajectory_filter.py)
    where = "seq >= ? AND kind != 'annotation'" + (f" AND {clauses}" if clauses else "")
    return ("SELECT trace_id, MAX(received_at) AS last_received FROM spans NOT INDEXED WHERE " + where
            + " GROUP BY trace_id HAVING SUM(parent_id IS NULL) = 0", [start_seq, *params])


def running_trajectories(spool: Spool, flt: TrajectoryFilter, *, window_s: float, max_scan_spans: int,
                         limit: int = 100, now: float | None = None,
                         open_calls: Callable[[], list[dict[str, Any]]] = list) -> dict[str, Any]:
    """The running trajectories seen in the window, the longest idle first (a stuck one on top).

    ``open_calls``: the calls the workers say are still running (their open markers), so a
    trajectory whose first call hangs is listed too, and the call that hangs is named. Read
    after the spans, so a batch committed in between cannot show spans without its markers.
    """
    now = time.time() if now is None else now
    start_seq = first_seq_since(spool, now - window_s)
    newest = spool.query("SELECT MAX(seq) AS hi FROM spans")[0]["hi"] or 0
    scan_capped = newest - start_seq + 1 > max_scan_spans
    start_seq = max(start_seq, newest - max_scan_spans + 1)
    sql, params = candidates_sql(flt, start_seq)
    last_activity: dict[str, float] = {row["trace_id"]: row["last_received"] for row in spool.query(sql, params)}
    opened: dict[str, list[dict[str, Any]]] = {}
    for call in open_calls():
        if flt.matches(call, unknown_passes=("validate",)):  # a marker may not say
            opened.setdefault(call["trace_id"], []).append(call)
    for trace_id, calls in opened.items():
        newest_start = max(c["start_time"] for c in calls)
        last_activity[trace_id] = max(last_activity.get(trace_id, 0.0), newest_start)
    running: list[dict[str, Any]] = []
    total = 0
    for trace_id in sorted(last_activity, key=last_activity.__getitem__):
        if _has_root(spool, trace_id):  # the root arrived (before the window, or just now): finished
            continue
        total += 1
        if len(running) < limit:
            running.append(_describe(spool, trace_id, now, opened.get(trace_id, [])))
    return {"now": now, "window_s": window_s, "scan_capped": scan_capped, "total": total,
            "truncated": total > len(running), "trajectories": running, "steps": step_progress(spool, running)}


def step_progress(spool: Spool, running: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (experiment, step) of the listed running trajectories: how many of the step's trajectories are
    done (their root stored, held or not, or sampled out by a tail budget) and how many still run.

    Reads the roots' partial index (experiment, step) and the step's decisions: a few seeks a step."""
    counts: dict[tuple[Any, Any], int] = {}
    for t in running:
        if t["step"] is not None:
            key = (t["experiment"], t["step"])
            counts[key] = counts.get(key, 0) + 1
    steps = []
    for (experiment, step), still in sorted(counts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        stored = spool.query("SELECT COUNT(*) AS n FROM spans WHERE experiment IS ? AND step = ? AND parent_id IS NULL"
                             " AND kind != 'annotation'", (experiment, step))[0]["n"]
        dropped = spool.query("SELECT COUNT(*) AS n FROM trajectory_decisions WHERE step = ? AND experiment IS ? AND keep = 0",
                              (step, experiment))[0]["n"]
        steps.append({"experiment": experiment, "step": step, "done": stored + dropped, "running": still,
                      "total": stored + dropped + still})
    return steps


def _stuck_call(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost open call that started first: what the trajectory waits on."""
    parents = {c["parent_id"] for c in calls}
    leaves = [c for c in calls if c["span_id"] not in parents]
    return min(leaves, key=lambda c: c["start_time"]) if leaves else None


def _describe(spool: Spool, trace_id: str, now: float, calls: list[dict[str, Any]]) -> dict[str, Any]:
    rows = spool.query(
        "SELECT span_id, parent_id, name, kind, worker, experiment, step, sample_index, rollout_n, validate,"
        " start_time, end_time, has_error, received_at, state FROM spans WHERE trace_id = ? AND kind != 'annotation'"
        " ORDER BY start_time, seq", (trace_id,))
    ended = {r["span_id"] for r in rows}
    calls = sorted((c for c in calls if c["span_id"] not in ended), key=lambda c: c["start_time"])
    described = [*rows, *calls]
    attrs = next((r for r in reversed(described) if r["step"] is not None), described[-1])
    last = max(rows, key=lambda r: (r["end_time"] or 0.0, r["received_at"])) if rows else None
    first_start = min((r["start_time"] for r in described if r["start_time"] is not None), default=None)
    activity = [r["end_time"] or r["received_at"] for r in rows] + [c["start_time"] for c in calls]
    stuck = _stuck_call(calls)
    return {
        "trace_id": trace_id, "experiment": attrs["experiment"], "step": attrs["step"],
        "sample_index": attrs["sample_index"], "rollout_n": attrs["rollout_n"],
        "validate": None if attrs["validate"] is None else bool(attrs["validate"]), "worker": attrs["worker"],
        "spans": len(rows), "errors": sum(r["has_error"] for r in rows), "held": sum(r["state"] == HELD for r in rows),
        "started_at": first_start, "age_s": None if first_start is None else max(0.0, now - first_start),
        "last_received_at": max((r["received_at"] for r in rows), default=None),
        "idle_s": max(0.0, now - max(activity)),
        "last_span": None if last is None else {"span_id": last["span_id"], "name": last["name"], "end_time": last["end_time"],
                                                "has_error": bool(last["has_error"])},
        "open_calls": [{"span_id": c["span_id"], "parent_id": c["parent_id"], "name": c["name"],
                        "start_time": c["start_time"], "running_s": max(0.0, now - c["start_time"])} for c in calls],
        "stuck_call": None if stuck is None else {"span_id": stuck["span_id"], "name": stuck["name"],
                                                  "start_time": stuck["start_time"],
                                                  "running_s": max(0.0, now - stuck["start_time"])},
        "span_list": [
            {"span_id": r["span_id"], "parent_id": r["parent_id"], "name": r["name"], "kind": r["kind"],
             "start_time": r["start_time"], "end_time": r["end_time"], "has_error": bool(r["has_error"])}
            for r in rows[:SPANS_PER_TRAJECTORY]
        ],
    }
