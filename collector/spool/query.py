"""Reads of the embedded store: trajectory lists with filters, and one trajectory as a tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from .store import Spool

SORTS = {
    "start": "r.start_time", "step": "r.step", "reward": "reward", "duration": "duration",
    "spans": "span_count", "sample_index": "r.sample_index",
}


def sample_index_values(value: int | str) -> list[int | str]:
    """What a ``sample_index`` filter matches: VERL's index is an int or a string, and a query
    parameter is always a string, so ``"7"`` matches both the int 7 and the string ``"7"``."""
    if type(value) is int:
        return [value, str(value)]
    text = str(value)
    try:
        number = int(text)
    except ValueError:
        return [text]
    return [number, text] if str(number) == text and -(2**63) <= number < 2**63 else [text]


@dataclass
class TrajectoryFilter:
    experiment: str | None = None
    step: int | None = None
    step_min: int | None = None
    step_max: int | None = None
    sample_index: int | str | None = None  # an int, or a string index when the client sends one
    rollout_n: int | None = None
    validate: bool | None = None
    worker: str | None = None
    has_error: bool | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    trained: bool | None = None  # what the trainer did, from annotations (client.annotate(trained=...))
    filtered_by: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses = ["r.parent_id IS NULL", "r.kind != 'annotation'"]
        params: list[Any] = []
        for column, value in (
            ("r.experiment", self.experiment), ("r.step", self.step),
            ("r.rollout_n", self.rollout_n), ("r.worker", self.worker),
        ):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if self.sample_index is not None:
            values = sample_index_values(self.sample_index)
            clauses.append(f"r.sample_index IN ({','.join('?' * len(values))})")
            params.extend(values)
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
                           AND s.reward IS NOT NULL ORDER BY s.seq DESC LIMIT 1)) AS reward{trainer}
FROM spans r
"""

#: What the trainer did with a trajectory (client.annotate: advantage=, trained=, filtered_by=,
#: policy_version=, trained_on_version=): the latest annotation that set each key wins.
TRAINER_KEYS = ("advantage", "trained", "filtered_by", "policy_version", "trained_on_version")
_LATEST_NOTE = ("(SELECT json_extract(CAST(s.payload AS TEXT), '$.attributes.{key}') FROM spans s"
                " WHERE s.trace_id = r.trace_id AND s.kind = 'annotation'"
                " AND json_extract(CAST(s.payload AS TEXT), '$.attributes.{key}') IS NOT NULL ORDER BY s.seq DESC LIMIT 1) AS {key}")
_WITH_TRAINER = _SUMMARY.format(trainer="".join(",\n       " + _LATEST_NOTE.format(key=k) for k in TRAINER_KEYS))
_SUMMARY = _SUMMARY.format(trainer="")


def _attach_trainer(spool: Spool, rows: list[dict[str, Any]]) -> None:
    """Adds the trainer's values to a page of rows: one read of their annotations, not a subquery per
    row and key over every trajectory (kept for when the page is filtered on them)."""
    for row in rows:
        row.update({k: None for k in TRAINER_KEYS})
    by_id = {row["trace_id"]: row for row in rows}
    ids = list(by_id)
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for note in spool.query(f"SELECT trace_id, payload FROM spans WHERE kind = 'annotation' AND trace_id IN"
                                f" ({','.join('?' * len(chunk))}) ORDER BY seq", chunk):
            try:
                attrs = orjson.loads(note["payload"]).get("attributes") or {}
            except (orjson.JSONDecodeError, AttributeError):
                continue
            for key in TRAINER_KEYS:  # oldest first: later notes win
                if attrs.get(key) is not None:
                    by_id[note["trace_id"]][key] = attrs[key]


def list_trajectories(spool: Spool, flt: TrajectoryFilter, *, limit: int = 50, offset: int = 0,
                      sort: str = "start", descending: bool = True) -> dict[str, Any]:
    """One page of trajectory summaries plus the total matching count."""
    where, params = flt.where()
    order = SORTS.get(sort, "r.start_time")
    outer: list[str] = []
    outer_params: list[Any] = []
    if flt.has_error is not None:
        outer.append("has_error = ?")
        outer_params.append(int(flt.has_error))
    if flt.reward_min is not None:
        outer.append("reward >= ?")
        outer_params.append(flt.reward_min)
    if flt.reward_max is not None:
        outer.append("reward <= ?")
        outer_params.append(flt.reward_max)
    if flt.trained is not None:
        outer.append("trained = ?")
        outer_params.append(int(flt.trained))
    if flt.filtered_by is not None:
        outer.append("filtered_by = ?")
        outer_params.append(flt.filtered_by)
    outer_sql = (" WHERE " + " AND ".join(outer)) if outer else ""
    by_trainer = flt.trained is not None or flt.filtered_by is not None
    base = f"SELECT * FROM ({_WITH_TRAINER if by_trainer else _SUMMARY} WHERE {where}){outer_sql}"
    total = spool.query(f"SELECT COUNT(*) AS n FROM ({base})", [*params, *outer_params])[0]["n"]
    direction = "DESC" if descending else "ASC"
    rows = spool.query(
        f"{base} ORDER BY {order.replace('r.', '')} IS NULL, {order.replace('r.', '')} {direction} LIMIT ? OFFSET ?",
        [*params, *outer_params, limit, offset],
    )
    if not by_trainer:
        _attach_trainer(spool, rows)
    for row in rows:
        row["validate"] = None if row["validate"] is None else bool(row["validate"])
        row["has_error"] = bool(row["has_error"])
        row["trained"] = None if row["trained"] is None else bool(row["trained"])
    return {"total": total, "limit": limit, "offset": offset, "trajectories": rows}


def get_trajectory(spool: Spool, trace_id: str, max_depth: int = 64) -> dict[str, Any] | None:
    """The whole trajectory: every span (payload included) nested under its parent.

    Built without recursion, so any depth the store accepted is readable. Spans deeper than
    ``max_depth`` (the root is depth 0; ``TRACECAR_MAX_TREE_DEPTH``) are attached to their
    ancestor at depth ``max_depth - 1`` (so they sit at the cap), breadth-first, each flagged ``depth_capped`` with its
    true ``depth`` (``parent_id`` still names its real parent). A span whose parent never
    arrived, or whose parent chain loops (a cycle across batches), is attached to the root and
    flagged ``parent_missing``; every stored span appears exactly once.
    """
    rows = spool.query(
        "SELECT span_id, parent_id, kind, state, payload FROM spans WHERE trace_id = ? ORDER BY start_time, seq", [trace_id]
    )
    if not rows:
        return None
    spans: dict[str, dict[str, Any]] = {}
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
    if root is None:  # a root from another OTLP producer keeps its own span id
        root = next((s for s in spans.values() if s["parent_id"] is None), None)
    if root is None:  # the root has not arrived (yet): show what there is
        root = {"span_id": trace_id, "trace_id": trace_id, "name": "(root not received)", "kind": "missing",
                "children": [], "attributes": {}, "parent_missing": False}
    kids: dict[str, list[dict[str, Any]]] = {}
    for span in spans.values():  # start order is kept: rows came sorted
        if span is not root and span["parent_id"] in spans and span["parent_id"] != span["span_id"]:
            kids.setdefault(span["parent_id"], []).append(span)
    placed: set[int] = set()
    _place(root, kids, max_depth, placed)
    for span in list(spans.values()):  # no parent here (or a loop): under the root, with their subtrees
        if span is not root and id(span) not in placed:
            span["parent_missing"] = True
            root["children"].append(span)
            _place(span, kids, max_depth, placed, depth=1, cap_parent=root if max_depth <= 1 else None)
    return {"trace_id": trace_id, "root": root, "annotations": annotations, "span_count": len(spans),
            "depth_cap": max_depth}


def _place(top: dict[str, Any], kids: dict[str, list[dict[str, Any]]], max_depth: int, placed: set[int],
           depth: int = 0, cap_parent: dict[str, Any] | None = None) -> None:
    """Appends the subtree under ``top`` breadth-first, adding each span's id to ``placed``.

    ``cap_parent`` is the span at depth ``max_depth - 1`` that deeper descendants are attached
    to (found on the way down; given when ``top`` itself is already at the cap).
    """
    placed.add(id(top))
    queue: list[tuple[dict[str, Any], int, dict[str, Any] | None]] = [(top, depth, cap_parent)]
    at = 0
    while at < len(queue):
        span, level, anchor = queue[at]
        at += 1
        if level == max_depth - 1:
            anchor = span
        for child in kids.get(span["span_id"], ()):
            if id(child) in placed:
                continue
            placed.add(id(child))
            if level + 1 > max_depth and anchor is not None:
                child["depth_capped"] = True
                child["depth"] = level + 1
                anchor["children"].append(child)
            else:
                span["children"].append(child)
            queue.append((child, level + 1, anchor))
