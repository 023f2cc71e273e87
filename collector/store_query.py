"""Reads of the embedded store: trajectory lists with filters, and one trajectory as a tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from .spool import Spool

SORTS = {
    "start": "r.start_time", "step": "r.step", "reward": "reward", "duration": "duration",
    "spans": "span_count", "sample_index": "r.sample_index",
}


@dataclass
class TrajectoryFilter:
    experiment: str | None = None
    step: int | None = None
    step_min: int | None = None
    step_max: int | None = None
    sample_index: int | None = None
    rollout_n: int | None = None
    validate: bool | None = None
    worker: str | None = None
    has_error: bool | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses = ["r.parent_id IS NULL", "r.kind != 'annotation'"]
        params: list[Any] = []
        for column, value in (
            ("r.experiment", self.experiment), ("r.step", self.step), ("r.sample_index", self.sample_index),
            ("r.rollout_n", self.rollout_n), ("r.worker", self.worker),
        ):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if self.validate is not None:
            clauses.append("r.validate = ?")
            params.append(int(self.validate))
        if self.step_min is not None:
            clauses.append("r.step >= ?")
            params.append(self.step_min)
        if self.step_max is not None:
            clauses.append("r.step <= ?")
            params.append(self.step_max)
        return " AND ".join(clauses), params


_SUMMARY = """
SELECT r.trace_id, r.name, r.experiment, r.step, r.sample_index, r.rollout_n, r.validate, r.worker,
       r.start_time, r.end_time, (r.end_time - r.start_time) AS duration,
       (SELECT COUNT(*) FROM spans s WHERE s.trace_id = r.trace_id AND s.kind != 'annotation') AS span_count,
       (SELECT MAX(s.has_error) FROM spans s WHERE s.trace_id = r.trace_id) AS has_error,
       COALESCE(r.reward, (SELECT s.reward FROM spans s WHERE s.trace_id = r.trace_id AND s.kind = 'annotation'
                           AND s.reward IS NOT NULL ORDER BY s.seq DESC LIMIT 1)) AS reward
FROM spans r
"""


def list_trajectories(spool: Spool, flt: TrajectoryFilter, *, limit: int = 50, offset: int = 0,
                      sort: str = "start", descending: bool = True) -> dict[str, Any]:
    """One page of trajectory summaries plus the total matching count."""
    where, params = flt.where()
    order = SORTS.get(sort, "r.start_time")
    outer, outer_params = [], []
    if flt.has_error is not None:
        outer.append("has_error = ?")
        outer_params.append(int(flt.has_error))
    if flt.reward_min is not None:
        outer.append("reward >= ?")
        outer_params.append(flt.reward_min)
    if flt.reward_max is not None:
        outer.append("reward <= ?")
        outer_params.append(flt.reward_max)
    outer_sql = (" WHERE " + " AND ".join(outer)) if outer else ""
    base = f"SELECT * FROM ({_SUMMARY} WHERE {where}){outer_sql}"
    total = spool.query(f"SELECT COUNT(*) AS n FROM ({base})", [*params, *outer_params])[0]["n"]
    direction = "DESC" if descending else "ASC"
    rows = spool.query(
        f"{base} ORDER BY {order.replace('r.', '')} IS NULL, {order.replace('r.', '')} {direction} LIMIT ? OFFSET ?",
        [*params, *outer_params, limit, offset],
    )
    for row in rows:
        row["validate"] = None if row["validate"] is None else bool(row["validate"])
        row["has_error"] = bool(row["has_error"])
    return {"total": total, "limit": limit, "offset": offset, "trajectories": rows}


def get_trajectory(spool: Spool, trace_id: str) -> dict[str, Any] | None:
    """The whole trajectory: every span (payload included) nested under its parent.

    A span whose parent never arrived is attached to the root and flagged ``parent_missing``.
    """
    rows = spool.query(
        "SELECT span_id, parent_id, kind, state, payload FROM spans WHERE trace_id = ? ORDER BY start_time, seq", [trace_id]
    )
    if not rows:
        return None
    spans = {}
    annotations = []
    for row in rows:
        span = orjson.loads(row["payload"])
        attributes = span.get("attributes")
        if isinstance(attributes, dict) and isinstance(attributes.get("tracecar"), dict):
            del attributes["tracecar"]  # the client's placement mark, for the Weave sink only
        span["children"] = []
        span["forward_state"] = {0: "pending", 1: "done", 2: "dead", 3: "held"}.get(row["state"], "unknown")
        if row["kind"] == "annotation":
            annotations.append(span)
        else:
            spans[row["span_id"]] = span
    root = spans.get(trace_id)
    orphans = []
    for span in spans.values():
        if span is root:
            continue
        parent = spans.get(span["parent_id"]) if span["parent_id"] else None
        if parent is None:
            span["parent_missing"] = True
            orphans.append(span)
        else:
            parent["children"].append(span)
    if root is None:  # the root has not arrived (yet): show what there is
        root = {"span_id": trace_id, "trace_id": trace_id, "name": "(root not received)", "kind": "missing",
                "children": [], "attributes": {}, "parent_missing": False}
    root["children"].extend(orphans)
    return {"trace_id": trace_id, "root": root, "annotations": annotations, "span_count": len(spans)}
