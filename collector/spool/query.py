"""Reads of the embedded store: one trajectory as a tree.

Lists of trajectories (``/v1/trajectories``, the viewer, export, groups) are answered from the
viewer's trajectory index (collector/viewer/index.py), filtered by the one
:class:`~tracecar.collector.trajectory_filter.TrajectoryFilter`; SQL over the spans took seconds
per page on a million spans.
"""

from __future__ import annotations

from typing import Any

import orjson

from .archive import Fetched
from .full_payloads import Loader, full_spans, spool_loader, with_rows
from .store import Spool


def get_trajectory(spool: Spool, trace_id: str, max_depth: int = 64, archived: Fetched | None = None) -> dict[str, Any] | None:
    """The whole trajectory: every span (payload included) nested under its parent.

    Built without recursion, so any depth the store accepted is readable. Spans deeper than
    ``max_depth`` (the root is depth 0; ``TRACECAR_MAX_TREE_DEPTH``) are attached to their
    ancestor at depth ``max_depth - 1`` (so they sit at the cap), breadth-first, each flagged ``depth_capped`` with its
    true ``depth`` (``parent_id`` still names its real parent). A span whose parent never
    arrived, or whose parent chain loops (a cycle across batches), is attached to the root and
    flagged ``parent_missing``; every stored span appears exactly once.
    """
    rows = spool.with_archive(trace_id, spool.query(
        "SELECT seq, span_id, parent_id, kind, state, start_time, payload FROM spans WHERE trace_id = ? ORDER BY start_time, seq",
        [trace_id]), archived)  # and what retention moved to the archive (spool/archive.py; ``archived``: read already)
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
    full_spans([*spans.values(), *annotations], trajectory_loader(spool, trace_id, rows))  # stored prompt references, rebuilt
    root = spans.get(trace_id)
    if root is None:  # a root from another OTLP producer keeps its own span id
        root = next((s for s in spans.values() if s["parent_id"] is None), None)
    if root is None:  # the root has not arrived (yet): show what there is, filed as its spans say
        known = next((s.get("attributes") for s in spans.values() if isinstance(s.get("attributes"), dict)), None) or {}
        filed = {k: known[k] for k in ("experiment_name", "step", "sample_index", "rollout_n", "validate") if k in known}
        root = {"span_id": trace_id, "trace_id": trace_id, "name": "(root not received)", "kind": "missing",
                "children": [], "attributes": filed, "parent_missing": False}
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


def trajectory_loader(spool: Spool, trace_id: str, rows: list[dict[str, Any]]) -> Loader:
    """What rebuilds a trajectory's stored prompt references: the spool, and the rows in hand first when some came
    from the archive (a reference names a span of its own trajectory, which may no longer be in the spool)."""
    load = spool_loader(spool.query)
    if spool.archive is None:
        return load
    return with_rows({r["span_id"]: (trace_id, r["payload"]) for r in rows}, load)


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
